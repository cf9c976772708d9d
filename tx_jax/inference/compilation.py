"""Compilation, paid once: JAX's persistent compilation cache for the checkpoint commands, and
how much time a piece of work spent compiling.

    compilation.use_persistent_cache()           evaluate / translate / export: on by default
    with compilation.CompileTimer() as t: ...    t.seconds, t.programs, t.cache_hits

Decoding compiles one program per (search, batch shape): a handful per evaluation, each 1-3 s
on a 2-core CPU for the default model, more than decoding the test set takes once compiled.
The persistent cache (JAX's, keyed by the program, the compiler and the device) makes the
second process load them instead. Programs are cached whatever their compile time (JAX's
default skips those under 1 s: most of an evaluation's).
"""

from __future__ import annotations

import dataclasses
import os
import threading

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
    return directory


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
    """What the code inside `with CompileTimer() as t:` spent on compilation, from JAX's
    monitoring events (any thread): t.seconds (tracing, lowering, compiling or loading
    from the persistent cache), t.programs (executables built or loaded), t.cache_hits (of
    those, loaded from the persistent cache)."""

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
