"""A sweep's results: ROOT/results.csv and results.md (one row per point), ROOT/curves.png.

val_* are the last validation record of WORKDIR/metrics.jsonl; test_bleu the point's
--test_split_eval outcome, else the last test-split record (eval.score_test).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from tx_jax import paths
from tx_jax.config import upgrade_stored
from tx_jax.launch.sweeps import Point, jsonable

COLUMNS = (
    "index",
    "name",
    "status",
    "overrides",
    "steps",
    "wall_s",
    "val_bleu",
    "val_loss",
    "test_bleu",
    "workdir",
)


def _metrics(workdir: epath.Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(point: Point, outcome: Mapping[str, Any]) -> dict[str, Any]:
    """One results row from WORKDIR/metrics.jsonl and the run's outcome."""
    records = _metrics(point.workdir)
    last = {}
    for r in records:  # the last record of each split wins
        last[r.get("split", "train")] = r
    test_split = "test"
    if (point.workdir / "config.json").exists():
        stored = upgrade_stored(json.loads((point.workdir / "config.json").read_text()))
        test_split = stored["data"]["test_split"] if stored["eval"]["score_test"] else ""
    validation, test = last.get("validation", {}), last.get(test_split, {}) if test_split else {}
    test_bleu = (outcome.get("test_eval") or {}).get("bleu", test.get("bleu"))
    return {
        "index": point.index,
        "name": point.name,
        "status": outcome.get("status", ""),
        "overrides": json.dumps(jsonable(point.overrides)),
        "steps": max((r["step"] for r in records), default=None),
        "wall_s": outcome.get("wall_s"),
        "val_bleu": validation.get("bleu"),
        "val_loss": validation.get("loss"),
        "test_bleu": test_bleu,
        "workdir": str(point.workdir),
    }


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def write_results(root: epath.Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """ROOT/results.csv and ROOT/results.md (markdown; overrides as the config diff)."""
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows({k: ("" if row[k] is None else row[k]) for k in COLUMNS} for row in rows)
    paths.write_atomic(paths.Path(root) / "results.csv", table.getvalue())
    shown = [c for c in COLUMNS if c not in ("overrides", "workdir")]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for row in rows:
        cells = [_cell(row[c]).replace("|", "\\|") for c in shown]
        lines.append("| " + " | ".join(cells) + " |")
    (root / "results.md").write_text("\n".join(lines) + "\n")


def write_curves(root: epath.Path, points: Sequence[Point]) -> epath.Path | None:
    from tx_jax.analysis import visualize  # matplotlib: only when there is something to draw

    have = [p for p in points if (p.workdir / "metrics.jsonl").exists()]
    if not have:
        return None
    with paths.staged_dir(root) as local:  # matplotlib writes local files
        visualize.plot_curves(
            [p.workdir / "metrics.jsonl" for p in have],
            os.path.join(local, "curves.png"),
            labels=[p.name for p in have],
        )
    return paths.Path(root) / "curves.png"
