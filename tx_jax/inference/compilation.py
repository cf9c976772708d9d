"""Compilation, paid once: JAX's persistent compilation cache for the checkpoint commands, and
how much time a piece of work spent compiling.

    compilation.use_persistent_cache()           evaluate / translate / export: on by default
    compilation.cached_call(fn, static, *args)   fn(*args, **static), traced once per machine
    compilation.program(fn, static, *specs)      the traceable program cached_call runs
    compilation.dispatch(calls, keys)            calls on one thread per core, programs built once
    with compilation.CompileTimer() as t: ...    t.seconds, t.programs, t.cache_hits

Decoding compiles a program per (search, batch shape), each longer to build than the decoding
takes. The persistent cache keeps every program (JAX's default skips those under 1 s), and
`cached_call` keeps each traced program too (jax.export, keyed by the function, its static
arguments, the shapes, tx_jax's source and JAX), so a later process neither traces nor compiles.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
import pathlib
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
from jax import monitoring

ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable: a directory, or '' for no cache


def default_cache_dir() -> str:
    """$JAX_COMPILATION_CACHE_DIR when set (launch.sh sets it), else ~/.cache/tx_jax/jax."""
    if ENV in os.environ:
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tx_jax", "jax")


def use_persistent_cache(directory: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache in `directory` (default `default_cache_dir`;
    '' leaves it off) -> the directory used, or None."""
    directory = default_cache_dir() if directory is None else directory
    if not directory:
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    global _export_dir
    _export_dir = pathlib.Path(directory) / "tx_jax_exported"
    return directory


# --------------------------------------------------------------- traced programs, kept

_export_dir: pathlib.Path | None = None  # set by use_persistent_cache
_calls: dict[str, Callable] = {}


@functools.cache
def _source_digest() -> str:
    """tx_jax's own source: an edit makes every kept program stale."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return h.hexdigest()


def on_one_device(args: Any) -> bool:
    """Whether every jax.Array in `args` lives on a single device."""
    leaves = jax.tree.leaves(args)
    return all(
        len(getattr(x, "sharding", None).device_set) == 1
        for x in leaves
        if isinstance(x, jax.Array)
    )


def clear() -> None:
    """Forget the programs this process holds (traced, kept, compiled), for a measurement that
    must see them built again."""
    _calls.clear()
    jax.clear_caches()


def cached_call(fn: Callable, static: dict[str, Any], *args: Any) -> Any:
    """fn(*args, **static), with the traced program kept on disk (module docstring) when the
    persistent cache is on and every array lives on one device; else just the call.

    `static` must have a stable repr (numbers, strings, frozen dataclasses such as
    ModelConfig); `args` a pytree of arrays (plain dicts, lists, tuples)."""
    if _export_dir is None or not on_one_device(args):
        return fn(*args, **static)
    return program(fn, static, *args)(*args)


def program(fn: Callable, static: dict[str, Any], *args: Any) -> Callable:
    """The traceable function behind cached_call for arguments shaped as `args` (arrays or
    ShapeDtypeStructs): the kept program when the persistent cache is on, else fn with
    `static` bound; callable inside other transformations (data_parallel.py's shard_map)."""
    if _export_dir is None:
        return functools.partial(fn, **static)
    key = _key(fn, static, args)
    call = _calls.get(key)
    if call is None:
        path = _export_dir / f"{key}.jaxexport"
        exported = None
        if path.exists():
            try:
                exported = jax.export.deserialize(bytearray(path.read_bytes()))
            except Exception:  # a partial or foreign file: trace again and replace it
                exported = None
        if exported is None:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
            exported = jax.export.export(jax.jit(lambda *a: fn(*a, **static)))(*shapes)
            _save(path, exported.serialize())
        call = _calls[key] = jax.jit(exported.call)
    return call


def _key(fn: Callable, static: dict[str, Any], args: Any) -> str:
    specs = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), args)
    call = (fn.__module__, fn.__qualname__, sorted(static.items()), jax.tree.structure(args))
    key_text = repr((*call, specs, jax.__version__, jax.default_backend(), _source_digest()))
    return hashlib.sha256(key_text.encode()).hexdigest()[:32]


def _save(path: pathlib.Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic: concurrent processes never read half a file


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# Programs built at a time in this process (dispatch): XLA:CPU's compiler already uses the
# cores, so on a small host more at once only makes each slower.
BUILDS = max(1, usable_cores() // 4)
_build_slots = threading.BoundedSemaphore(BUILDS)


def dispatch(calls: Sequence[Callable[[], Any]], keys: Sequence[Hashable], workers=None) -> list:
    """[calls[i]() for i] on `workers` threads (default: the usable cores); calls with the same
    key (argument shapes) share one program. The first call of a key builds it, at most
    BUILDS at a time, while the other threads run the calls whose program is ready: on CPU,
    XLA runs a program in the calling thread, so threads run batches side by side. Programs
    with collectives (a mesh's) need workers=1: every device must see them in one order."""
    queues: dict[Hashable, collections.deque[int]] = {}
    for i, key in enumerate(keys):
        queues.setdefault(key, collections.deque()).append(i)
    workers = max(1, min(workers or usable_cores(), len(calls)))
    out: list[Any] = [None] * len(calls)
    if workers == 1:
        return [call() for call in calls]
    started: set[Hashable] = set()
    ready: set[Hashable] = set()
    errors: list[BaseException] = []
    cond = threading.Condition()

    def take() -> tuple[Hashable, int] | None:  # under cond
        for key, queue in queues.items():  # a program nobody builds yet, if a slot is free
            if key not in started and queue and _build_slots.acquire(blocking=False):
                started.add(key)
                return key, queue.popleft()
        for key, queue in queues.items():
            if key in ready and queue:
                return key, queue.popleft()
        return None

    def work() -> None:
        while True:
            with cond:
                task = take()
                while task is None and not errors and any(queues.values()):
                    # a program being built here, or a build slot taken by another dispatch
                    # (which does not notify this one)
                    cond.wait(timeout=0.05)
                    task = take()
                if task is None or errors:
                    return
            key, i = task
            building = key not in ready
            try:
                out[i] = calls[i]()
            except BaseException as e:  # noqa: BLE001  (re-raised by the caller's thread)
                with cond:
                    errors.append(e)
                    cond.notify_all()
                return
            finally:
                if building:
                    _build_slots.release()
            if building:
                with cond:
                    ready.add(key)
                    cond.notify_all()

    threads = [threading.Thread(target=work, name=f"tx_jax-dispatch-{n}") for n in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


# ------------------------------------------------------------------------ time spent

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE = "/jax/core/compile/backend_compile_duration"  # compiling, or loading from the cache
_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class _Totals:
    seconds: float = 0.0  # tracing + lowering + compiling (or loading)
    programs: int = 0  # backend compilations (or cache loads)
    cache_hits: int = 0


_totals = _Totals()
_lock = threading.Lock()
_registered = False


def _on_duration(event: str, seconds: float, **_) -> None:
    if event in (_TRACE, _LOWER, _COMPILE):
        with _lock:
            _totals.seconds += seconds
            _totals.programs += event == _COMPILE


def _on_event(event: str, **_) -> None:
    if event == _HIT:
        with _lock:
            _totals.cache_hits += 1


def _register() -> None:
    global _registered
    if not _registered:  # listeners cannot be removed: one pair for the process
        monitoring.register_event_duration_secs_listener(_on_duration)
        monitoring.register_event_listener(_on_event)
        _registered = True


class CompileTimer:
    """What the code inside `with CompileTimer() as t:` spent on compilation (JAX's monitoring
    events, any thread): t.seconds (tracing, lowering, compiling or loading), t.programs
    (executables built or loaded), t.cache_hits (of those, loaded from the persistent cache)."""

    def __enter__(self) -> CompileTimer:
        _register()
        with _lock:
            self._start = dataclasses.replace(_totals)
        self.seconds, self.programs, self.cache_hits = 0.0, 0, 0
        return self

    def __exit__(self, *exc) -> None:
        self.update()

    def update(self) -> CompileTimer:
        """Bring the figures up to now (also usable inside the block)."""
        with _lock:
            self.seconds = _totals.seconds - self._start.seconds
            self.programs = _totals.programs - self._start.programs
            self.cache_hits = _totals.cache_hits - self._start.cache_hits
        return self
