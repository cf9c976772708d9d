"""Shared helpers for the benchmark scripts: timing, machine description, tables, JSON.

Benchmarks are run by hand (`python benchmarks/NAME.py`), never by the test suite. Each one
prints a markdown table and writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
if ROOT not in sys.path:  # `python benchmarks/x.py` from anywhere imports this checkout
    sys.path.insert(0, ROOT)


def pin_threads(threads: int | None) -> int:
    """Restrict this process to `threads` CPUs (default: all it may use) and return the count.

    XLA's CPU client sizes its intra-op thread pool from the CPUs the process may run on, so
    the affinity mask is how its thread count is set; call this before JAX creates its CPU
    client (before the first computation). PyTorch gets the same count via set_num_threads.
    """
    allowed = sorted(os.sched_getaffinity(0))
    if threads and threads < len(allowed):
        os.sched_setaffinity(0, allowed[:threads])
        allowed = allowed[:threads]
    os.environ.setdefault("OMP_NUM_THREADS", str(len(allowed)))
    return len(allowed)


def load_average() -> float:
    return os.getloadavg()[0]


def machine() -> dict[str, Any]:
    """CPU model, core count, memory and package versions of this run."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpus_used": len(os.sched_getaffinity(0)),
        "load_average_1min": round(load_average(), 2),
    }
    from tx_jax.training.logs import cpu

    info["cpu"] = cpu()  # model, cores, bfloat16 features
    for name in ("jax", "jaxlib", "flax", "optax", "numpy", "torch", "grain"):
        try:
            from importlib import metadata

            info[name] = metadata.version(name)
        except Exception:  # noqa: BLE001 - not installed is fine
            pass
    try:
        import jax

        info["jax_backend"] = jax.default_backend()
        info["devices"] = [str(d) for d in jax.devices()]
    except Exception:  # noqa: BLE001
        pass
    return info


def time_once(fn: Callable[[], Any], sync: Callable[[Any], Any]) -> float:
    start = time.perf_counter()
    sync(fn())
    return time.perf_counter() - start


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats get thousands separators or 3 significant digits."""

    def fmt(x: Any) -> str:
        if isinstance(x, float):
            if abs(x) >= 100:
                return f"{x:,.0f}"
            if abs(x) >= 10:
                return f"{x:.1f}"
            return f"{x:.3g}"
        if isinstance(x, int) and not isinstance(x, bool):
            return f"{x:,}"
        return str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def portable_path(path: str) -> str:
    """`path` as a results file records it: relative to the repository root when inside it,
    else only its last component (the directories above it are this machine's layout)."""
    path = os.path.abspath(path)
    if os.path.commonpath([path, ROOT]) == ROOT:
        return os.path.relpath(path, ROOT)
    return os.path.basename(path)


def _portable_arg(arg: str) -> str:
    """A command-line argument with its absolute path (bare or as --flag=PATH) made portable."""
    flag, eq, value = arg.partition("=")
    if eq and flag.startswith("-") and os.path.isabs(value):
        return f"{flag}={portable_path(value)}"
    return portable_path(arg) if os.path.isabs(arg) else arg


def write_json(name: str, payload: dict[str, Any], path: str | None = None) -> str:
    """Write `payload` (plus the machine description) to benchmarks/results/NAME.json.

    Absolute paths among the command-line arguments are recorded by `portable_path`."""
    path = path or os.path.join(RESULTS, f"{name}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    argv = [_portable_arg(a) for a in sys.argv[1:]]
    payload = {"benchmark": name, "machine": machine(), "argv": argv, **payload}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=float)
        f.write("\n")
    return path


def config_train_step(config, vocab_size: int, bos_id: int):
    """(strategy, compiled step, initial state) for `config` exactly as tx_jax.runner.loop
    builds them: tx_jax.training.parallel's strategy (config.parallel), the real train_step,
    state donated."""
    import functools

    import jax

    from tx_jax.model.config import ModelConfig
    from tx_jax.model.transformer import EncoderDecoder
    from tx_jax.training import optim, parallel
    from tx_jax.training.state import init_state
    from tx_jax.training.step import train_step

    cfg = ModelConfig.of_run(config, jax.default_backend(), vocab_size=vocab_size, bos_id=bos_id)
    model = EncoderDecoder(cfg)
    tx, schedule = optim.make_optimizer(config.train, cfg.d_model)
    strategy = parallel.make_strategy(config.parallel)
    init_fn = functools.partial(init_state, model, tx, config.seed)
    shardings = strategy.step_shardings(init_fn)
    step_fn = functools.partial(
        train_step,
        model=model,
        tx=tx,
        schedule=schedule,
        label_smoothing=config.train.label_smoothing,
    )
    step = strategy.compile_step(step_fn, donate=True, state_shardings=shardings)
    return strategy, step, strategy.init_state(init_fn)
