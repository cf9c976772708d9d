"""`python -m MODULE ARGS...` for many commands at the start-up cost of a fork each.

Each command runs in a child of tests/zygote.py's interpreter, which has imported the
libraries every tx_jax command imports (JAX, Flax, Optax, NumPy, Orbax, Grain: about 3 s of
each command's start-up on a 2-core CPU) and forks one child per command; the child runs the
module as `__main__` with its arguments (runpy, as `python -m` does), the command's
environment and working directory, and pipes for its stdin, stdout and stderr. No JAX backend
exists before the fork (each child starts its own), so a child's behaviour is a fresh
process's; its absl flags are those of the modules it imports, which every tx_jax command
imports anyway.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence

import zygote


def run_modules(
    commands: Sequence[tuple],
    *,
    cwd: str | os.PathLike,
    env: dict[str, str] | None = None,
    parallel: int = 1,
    timeout: float = 300,
) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `python -m module *args < stdin` for each (module, args)
    or (module, args, stdin) of `commands` (stdin: a str, default empty), `parallel` at a time
    in their order, each in a child forked from tests/zygote.py's interpreter; all within
    `timeout` seconds."""
    deadline = time.time() + timeout
    results: list[tuple[int, str, str] | None] = [None] * len(commands)
    slots = threading.Semaphore(max(1, parallel))

    def one(i: int, command: tuple) -> None:
        module, args, stdin = command[0], list(command[1]), command[2] if len(command) > 2 else ""
        try:
            proc = zygote.Popen(
                [sys.executable, "-m", module, *args],
                cwd=cwd,
                env=env,
                stdin=zygote.PIPE,
                stdout=zygote.PIPE,
                stderr=zygote.PIPE,
                text=True,
            )
            try:
                out, err = proc.communicate(stdin, timeout=max(deadline - time.time(), 1))
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            results[i] = (proc.returncode, out, err)
        finally:
            slots.release()

    threads = []
    for i, command in enumerate(commands):  # started in their order, `parallel` at a time
        slots.acquire()
        threads.append(threading.Thread(target=one, args=(i, command), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(max(deadline - time.time(), 1))
    failed = [" ".join(map(str, c[:2])) for c, r in zip(commands, results) if r is None]
    if failed:
        raise AssertionError(f"no result within {timeout} s (or the launch failed): {failed}")
    return results
