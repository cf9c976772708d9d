"""`python -m MODULE ARGS...` for many commands at the start-up cost of one interpreter.

A fresh interpreter imports the third-party libraries every tx_jax command imports (JAX,
Flax, Optax, NumPy: about half of a command's 2 s of start-up on a 2-core CPU) and then forks
one child per command, which runs the module as `__main__` with its arguments (runpy, as
`python -m` does), with files for its stdin, stdout and stderr (fds 0, 1 and 2). None of those
libraries defines an absl flag (checked: only absl.logging's, which every absl command defines
through absl.app), and no JAX backend exists before the fork (each child starts its own), so
a child's flags, help text and behaviour are a fresh process's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

_SERVER = r"""
import atexit, json, os, runpy, sys, tempfile, traceback

import flax.linen, jax, jax.numpy, ml_collections, numpy, optax  # noqa: F401 (shared imports)
from absl import flags

_owners = {flags.FLAGS.find_module_defining_flag(name) for name in flags.FLAGS}
assert _owners <= {"absl.logging"}, f"a shared import defines absl flags: {_owners}"
assert not jax._src.xla_bridge.backends_are_initialized(), "a backend before the fork"


def child(module, args, stdin, path):
    with open(path + ".in", "w", encoding="utf-8") as f:
        f.write(stdin)
    create = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, name, mode in ((0, ".in", os.O_RDONLY), (1, ".out", create), (2, ".err", create)):
        os.dup2(os.open(path + name, mode), fd)
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # what the interpreter makes of it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


commands, parallel = json.loads(sys.argv[1]), int(sys.argv[2])
out = tempfile.mkdtemp(prefix="forked")
paths = [os.path.join(out, str(i)) for i in range(len(commands))]
codes, running, todo = [None] * len(commands), {}, list(range(len(commands)))
while todo or running:
    while todo and len(running) < parallel:
        i = todo.pop(0)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(*commands[i], paths[i])
        running[pid] = i
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
results = []
for code, path in zip(codes, paths):
    results.append([code])
    for name in (".out", ".err"):
        with open(path + name, encoding="utf-8", errors="replace") as f:
            results[-1].append(f.read())
    for name in (".in", ".out", ".err"):
        os.unlink(path + name)
os.rmdir(out)
print(json.dumps(results))
"""


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
    in their order, each in a child forked from one interpreter (the module docstring)."""
    listed = json.dumps([[c[0], list(c[1]), c[2] if len(c) > 2 else ""] for c in commands])
    proc = subprocess.run(
        [sys.executable, "-c", _SERVER, listed, str(parallel)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        failed = f"the forking interpreter failed ({proc.returncode})"
        raise AssertionError(f"{failed}:\n{proc.stderr[-4000:]}")
    return [tuple(x) for x in json.loads(proc.stdout.splitlines()[-1])]
