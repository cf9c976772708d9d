"""`python -c CODE` and `python -m MODULE` processes at the start-up cost of a fork.

A training or translating process spends about 3 s of CPU importing JAX, Flax, Orbax, Grain
and NumPy before it does anything (ml_dtypes alone registers its NumPy loops for over a second).
The tests start such processes by the dozen: the ones that are signalled, killed, resumed or
run as several jax.distributed processes. `Popen` here gets them from a zygote, an interpreter
started once per test process that has imported those libraries and forks one child per
command; the child takes the command's environment, working directory, sys.path, argv and
stdin/stdout/stderr (the file descriptors themselves, passed over a Unix socket), runs the
code or module as `__main__`, and exits as the interpreter would. It is an ordinary process:
signals, kill -9, /proc and jax.distributed work on it as on a fresh one.

What the zygote imports (the import lines of _SERVER below: JAX, Flax, Optax, NumPy,
ml_collections, Orbax, Grain, TensorStore, etils, SentencePiece, sacreBLEU: what every tx_jax
process imports) reads from the environment at import only JAX_PLATFORMS, TMPDIR (tempfile's
directory, read again in the child) and telemetry switches; a child whose JAX_*, TF_*, PYTHON*
or thread-count variables differ from the zygote's is started as a fresh process instead. No
JAX backend exists before the fork: XLA reads XLA_FLAGS (the forced device count) when the
child creates its backend, and no native thread either (OpenBLAS's pool is one thread, the
zygote's own): a fork copies only the forking thread, and a lock another one held would stay
locked in the child. Libraries that read HOME, TFDS_DATA_DIR or the GCS settings at import
(TFDS, gcsfs) are imported by the child, after its environment is set.

`Popen` takes the subset of subprocess.Popen's arguments the tests use (stdin, stdout and
stderr as PIPE, DEVNULL, STDOUT, a file or None; cwd, env, text) and falls back to
subprocess.Popen for any other command.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

PIPE, DEVNULL, STDOUT = subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT

_SERVER = r"""
import atexit, faulthandler, io, json, os, runpy, signal, socket, sys, tempfile, threading
import traceback, types

# no native thread alive when a child is forked (only this one is copied into it): NumPy's
# OpenBLAS would start a pool of them at import
os.environ["OPENBLAS_NUM_THREADS"] = "1"
import flax.linen, jax, jax.numpy, ml_collections, numpy, optax  # noqa: F401 (shared imports)
import etils.epath, grain, orbax.checkpoint, sacrebleu, sentencepiece, tensorstore  # noqa: F401

assert not jax._src.xla_bridge.backends_are_initialized(), "a backend before the fork"
assert len(os.listdir("/proc/self/task")) == 1, "a thread started at import: forks are unsafe"

sock = socket.socket(fileno=int(sys.argv[1]))
ours = ("", *os.environ.get("PYTHONPATH", "").split(os.pathsep))
base_path = [p for p in sys.path if p not in ours]
lock = threading.Lock()
live = set()


def send(message):
    with lock:
        try:
            sock.send(json.dumps(message).encode())
        except OSError:
            pass


def reap(pid):
    # the exit is reported before the pid is freed (WNOWAIT): a new child cannot take the pid
    # of one whose exit the test process has yet to hear of
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    send({"exit": pid, "code": code})
    os.waitpid(pid, 0)
    live.discard(pid)


def stream(fd, mode, unbuffered):
    # sys.stdin/stdout/stderr over fd as CPython makes them (-u: no buffer under the text)
    raw = io.FileIO(fd, mode, closefd=False)
    if mode == "r":
        return io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8")
    return io.TextIOWrapper(
        raw if unbuffered else io.BufferedWriter(raw),
        encoding="utf-8",
        errors="backslashreplace" if fd == 2 else "strict",
        line_buffering=fd == 2,
        write_through=unbuffered,
    )


def child(request, fds):
    code, interrupted = 0, False
    try:
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in set(fds):
            os.close(fd)
        sock.close()
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        # as CPython starts: a write to a closed pipe or socket is an OSError, not a kill
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # TMPDIR is read again
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = stream(0, "r", False)
        sys.stdout = stream(1, "w", unbuffered)
        sys.stderr = stream(2, "w", unbuffered)
        faulthandler.enable()  # a crash in native code leaves its Python stack in the output
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if request["module"]:
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            sys.argv = [request["module"], *request["args"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path[:] = ["", *extra, *base_path]
            sys.argv = ["-c", *request["args"]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    except SystemExit as e:  # what the interpreter makes of it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # as the interpreter's own exit: threads joined, then the atexit functions
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        if interrupted:  # as CPython: an uncaught KeyboardInterrupt ends by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


while True:
    message, fds, _, _ = socket.recv_fds(sock, 1 << 22, 3)
    if not message:
        break
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        child(request, fds)
    for fd in set(fds):
        os.close(fd)
    live.add(pid)
    send({"started": request["id"], "pid": pid})
    threading.Thread(target=reap, args=(pid,), daemon=True).start()
for pid in list(live):  # the test process went away: so do its children
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


# Environment variables read when an interpreter starts or the shared libraries are imported:
# a child whose value differs from the zygote's is started as a fresh process instead.
_READ_AT_START = ("JAX_", "TF_", "PYTHON", "OMP_", "OPENBLAS_", "MKL_", "NUMPY")
_READ_LATER = {  # read by the child's own code (tx_jax, runpy, the zygote's child set-up)
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
}


def _read_at_start(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(_READ_AT_START) and k not in _READ_LATER}


class _Zygote:
    def __init__(self):
        self.env = _read_at_start(os.environ)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self.cond = threading.Condition()
        self.started: dict[int, int] = {}  # request id -> pid
        self.codes: dict[int, int] = {}  # pid -> exit code
        self.next_id = 0
        self.dead = False
        self.send_lock = threading.Lock()
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                message = self.sock.recv(1 << 16)
            except OSError:
                message = b""
            if not message:
                with self.cond:
                    self.dead = True
                    self.cond.notify_all()
                return
            reply = json.loads(message)
            with self.cond:
                if "started" in reply:  # before its exit: a reused pid's old code goes
                    self.codes.pop(reply["pid"], None)
                    self.started[reply["started"]] = reply["pid"]
                else:
                    self.codes[reply["exit"]] = reply["code"]
                self.cond.notify_all()

    def start(self, request: dict, fds: list[int]) -> int:
        with self.send_lock:
            request["id"] = self.next_id
            self.next_id += 1
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
        with self.cond:
            self.cond.wait_for(lambda: request["id"] in self.started or self.dead, timeout=600)
            if request["id"] not in self.started:
                raise RuntimeError("the zygote did not start the process")
            return self.started.pop(request["id"])

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: pid in self.codes or self.dead, timeout=timeout)
            if pid in self.codes:
                return self.codes[pid]
            if self.dead:
                raise RuntimeError(f"the zygote went away before process {pid} ended")
            return None

    def close(self) -> None:
        """End the zygote (and any child still running): the end of its socket."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the listening thread's recv
        self.sock.close()
        self.proc.wait(timeout=60)


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _get() -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.dead:
            _zygote = _Zygote()
            atexit.register(_zygote.close)
        return _zygote


def _command(args: Sequence[str]) -> tuple[str | None, str | None, list[str]] | None:
    """(module, code, argv after it) of `python -m M ...` or `python -c CODE ...`, else None."""
    args = [str(a) for a in args]
    if len(args) < 3 or args[0] != sys.executable or args[1] not in ("-c", "-m"):
        return None
    if args[1] == "-m":
        return args[2], None, args[3:]
    return None, args[2], args[3:]


def Popen(args, **kwargs):  # noqa: N802 (subprocess.Popen's name)
    """subprocess.Popen(args, **kwargs), forked from the zygote when `args` is
    `[sys.executable, "-c" | "-m", ...]` and the environment allows (else a fresh process)."""
    env = kwargs.get("env")
    if _command(args) is None or set(kwargs) - {"cwd", "env", "stdin", "stdout", "stderr", "text"}:
        return subprocess.Popen(args, **kwargs)
    if _read_at_start(os.environ if env is None else env) != _get().env:
        return subprocess.Popen(args, **kwargs)
    return _Forked(args, **kwargs)


class _Forked:
    """A child of the zygote, with the part of subprocess.Popen's interface the tests use."""

    def __init__(
        self,
        args,
        *,
        cwd=None,
        env=None,
        stdin=None,
        stdout=None,
        stderr=None,
        text=False,
    ):
        module, code, rest = _command(args)
        self.args, self.returncode = args, None
        self.stdin = self.stdout = self.stderr = None
        fds, ours_to_close = [], []
        for name, spec in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
            fd = {"stdin": 0, "stdout": 1, "stderr": 2}[name]
            if spec is None:
                fds.append(fd)  # inherited, as subprocess does
            elif spec == STDOUT and name == "stderr":
                fds.append(fds[1])
            elif spec == DEVNULL:
                fds.append(os.open(os.devnull, os.O_RDWR))
                ours_to_close.append(fds[-1])
            elif spec == PIPE:
                r, w = os.pipe()
                child, mine, mode = (r, w, "w") if name == "stdin" else (w, r, "r")
                fds.append(child)
                ours_to_close.append(child)
                f = os.fdopen(mine, mode, encoding="utf-8") if text else os.fdopen(mine, mode + "b")
                setattr(self, name, f)
            else:  # a file object or a descriptor
                fds.append(spec.fileno() if hasattr(spec, "fileno") else spec)
        request = {
            "module": module,
            "code": code,
            "args": rest,
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": dict(os.environ if env is None else env),
        }
        try:
            self._zygote = _get()
            self.pid = self._zygote.start(request, fds)
        finally:
            for fd in ours_to_close:
                os.close(fd)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input=None, timeout: float | None = None):
        """As subprocess.Popen.communicate: (stdout, stderr) of the pipes, None for others."""
        results: dict[str, object] = {}

        def read(name: str, f) -> None:
            results[name] = f.read()
            f.close()

        readers = [
            threading.Thread(target=read, args=(name, f), daemon=True)
            for name, f in (("out", self.stdout), ("err", self.stderr))
            if f is not None
        ]
        for t in readers:
            t.start()
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        for t in readers:
            t.join(timeout)
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        return results.get("out"), results.get("err")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


def run(args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """subprocess.run for `[sys.executable, "-c" | "-m", ...]`, forked from the zygote."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = PIPE
    if input is not None:
        kwargs["stdin"] = PIPE
    proc = Popen(args, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done
