"""Where a traced piece of work spent its time, read from a `jax.profiler` trace without
TensorBoard: the XLA operations (fusions, dots, copies) of the traced programs, by total time.

    rows = trace_summary.top_ops(trace_dir)            [(name, total ms, calls), ...]
    print(trace_summary.format_rows(rows, wall=...))

On CPU, XLA's thunk executor records one event per operation run, named as in the compiled
HLO, once per loop iteration; the executor's own and Python's events are left out.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence

import jax
from etils import epath

# Where operations run: XLA:CPU's thunk-executor threads; an accelerator's "XLA Ops" line.
_OP_LINES = ("tf_XLAEigen", "XLA Ops")
# Events there that enclose others (the executor, thread-pool waits, a loop or branch around
# its body's operations), not operations.
_ENCLOSING = ("ThunkExecutor", "Await", "$", "PjRt", "TfrtCpu", "XlaModule", "Execute")
_CONTROL = re.compile(r"(while|conditional|call)(\.\d+)?$")


def latest_trace(trace_dir: str | epath.Path) -> epath.Path:
    """The newest *.xplane.pb under `trace_dir` (jax.profiler writes plugins/profile/<time>/)."""
    found = epath.Path(trace_dir).glob("plugins/profile/*/*.xplane.pb")  # jax.profiler's layout
    files = sorted(found, key=lambda p: p.stat().mtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb trace under {trace_dir}")
    return files[-1]


def top_ops(trace_dir: str | epath.Path, n: int = 15) -> list[tuple[str, float, int]]:
    """The n operations with the most time in the newest trace: (name, milliseconds summed
    over every run and thread, number of runs)."""
    data = jax.profiler.ProfileData.from_serialized_xspace(latest_trace(trace_dir).read_bytes())
    total: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith(_OP_LINES):
                continue
            for event in line.events:
                if any(p in event.name for p in _ENCLOSING) or _CONTROL.match(event.name):
                    continue
                total[event.name] += event.duration_ns / 1e6
                calls[event.name] += 1
    return [(name, ms, calls[name]) for name, ms in total.most_common(n)]


def format_rows(rows: Sequence[tuple[str, float, int]], wall: float | None = None) -> str:
    """The rows as a table; with `wall` (seconds) also each one's share of it."""
    lines = [f"{'operation':<48} {'ms':>10} {'runs':>7}" + ("  share" if wall else "")]
    for name, ms, count in rows:
        share = f"  {ms / 1e3 / wall:5.1%}" if wall else ""
        lines.append(f"{name[:48]:<48} {ms:10.1f} {count:7d}{share}")
    return "\n".join(lines)
