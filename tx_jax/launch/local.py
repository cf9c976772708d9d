"""Run a sweep on this host: each point its own process in ROOT/<i>_<slug>, N at a time.

A point's log is WORKDIR/sweep.log, its command WORKDIR/sweep_command.sh; a finished point
writes WORKDIR/sweep_done.json, which a rerun skips (the others resume from checkpoints).
Exit status 1 if any point failed, 2 for a bad sweep file or override (docs/experiments.md).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tx_jax import paths
from tx_jax.launch import results
from tx_jax.launch.sweeps import (
    Point,
    command,
    config_file,
    expand,
    jsonable,
    load_sweep,
    select,
)

DONE_FILE = "sweep_done.json"
LOG_FILE = "sweep.log"


def _env(parallel: int) -> dict[str, str]:
    env = dict(os.environ)
    if parallel > 1:  # N processes share one accelerator: no process takes 75% of its memory
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / parallel:.3f}")
    return env


def done_record(point: Point) -> dict | None:
    """The point's WORKDIR/sweep_done.json if it finished with these overrides, else None."""
    path = point.workdir / DONE_FILE
    if not path.exists():
        return None
    done = json.loads(path.read_text())
    return done if done.get("overrides") == jsonable(point.overrides) else None


def run_point(
    point: Point,
    config: str,
    *,
    parallel: int = 1,
    test_split_eval: bool = False,
    beam_size: int = 4,
) -> dict[str, Any]:
    """Run one point (unless already done) -> {'status', 'wall_s', ...} (the DONE record)."""
    if (done := done_record(point)) is not None:
        return {**done, "status": "skipped (done)"}
    argv, wrapper = command(point, config)
    point.workdir.mkdir(parents=True, exist_ok=True)
    if wrapper:
        (point.workdir / "sweep_config.py").write_text(wrapper)
        local = config_file(point)
        if paths.is_remote(point.workdir):
            os.makedirs(os.path.dirname(local), exist_ok=True)
            pathlib.Path(local).write_text(wrapper)
    (point.workdir / "sweep_command.sh").write_text(shlex.join(argv) + "\n")
    start = time.time()
    rc = run_logged(argv, point, parallel)
    record = {
        "overrides": jsonable(point.overrides),
        "command": shlex.join(argv),
        "wall_s": round(time.time() - start, 2),
    }
    if rc != 0:
        return {**record, "status": f"failed (rc {rc})"}
    if test_split_eval:
        test = _evaluate_test(point, beam_size, parallel)
        if test is None:
            return {**record, "status": "failed (test eval)"}
        record["test_eval"] = test
    (point.workdir / DONE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return {**record, "status": "ok"}


# how a point's processes run (subprocess.run's interface): the tests fork them from a zygote
run_process = subprocess.run


def run_logged(argv: list[str], point: Point, parallel: int) -> int:
    """Run `argv`, its command line and output appended to the point's log (on gs://, when
    the process ends)."""
    log_path = point.workdir / LOG_FILE
    remote = paths.is_remote(log_path)
    with tempfile.TemporaryFile("w+") if remote else open(log_path, "a") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        rc = run_process(argv, stdout=log, stderr=subprocess.STDOUT, env=_env(parallel))
        if remote:
            log.seek(0)
            paths.append_text(log_path, log.read())
    return rc.returncode


def _evaluate_test(point: Point, beam_size: int, parallel: int) -> dict | None:
    """`tx_jax evaluate` on the test split in a subprocess (the sweep never holds a device)."""
    argv = [
        sys.executable,
        "-m",
        "tx_jax",
        "evaluate",
        f"--workdir={point.workdir}",
        "--split=test",
        f"--beam_size={beam_size}",
    ]
    rc = run_logged(argv, point, parallel)
    path = point.workdir / "eval_results.jsonl"
    if rc != 0 or not path.exists():
        return None
    record = json.loads(path.read_text().splitlines()[-1])
    return {k: record.get(k) for k in ("bleu", "step", "split", "beam", "length_penalty")}


def run_sweep(
    path: str | os.PathLike,
    root: str | os.PathLike | None = None,
    *,
    parallel: int = 1,
    only: Sequence[int] | None = None,
    dry_run: bool = False,
    test_split_eval: bool = False,
    beam_size: int = 4,
    overrides: Mapping[str, Any] | None = None,
    echo=print,
) -> list[dict[str, Any]]:
    """Validate, run (or with dry_run print) every point, write the results -> the rows."""
    sweep = load_sweep(path)
    root = paths.Path(root or pathlib.Path("runs/sweeps") / sweep.name)
    points = select(expand(sweep, root, overrides), only)
    if dry_run:
        for p in points:
            state = "done, skipped" if done_record(p) else "to run"
            argv, wrapper = command(p, sweep.config)
            echo(f"[{p.index}] {p.name} ({state})\n    {shlex.join(argv)}")
            if wrapper:
                echo(f"    (sweep_config.py: {sweep.config} + {wrapper.splitlines()[-2].strip()})")
        return []
    root.mkdir(parents=True, exist_ok=True)

    def one(point: Point) -> dict[str, Any]:
        outcome = run_point(
            point,
            sweep.config,
            parallel=parallel,
            test_split_eval=test_split_eval,
            beam_size=beam_size,
        )
        echo(f"[{point.index}] {point.name}: {outcome['status']} ({outcome.get('wall_s')} s)")
        return outcome

    # With --parallel, the first point to run goes alone: it prepares the TFDS data that the
    # others share (concurrent preparations of one dataset collide) and fills the compilation
    # cache; the rest then run N at a time.
    pending = [p for p in points if done_record(p) is None]
    first = {pending[0].index: one(pending[0])} if parallel > 1 and len(pending) > 1 else {}
    with concurrent.futures.ThreadPoolExecutor(max(1, parallel)) as pool:
        rest = [p for p in points if p.index not in first]
        outcomes = {p.index: o for p, o in zip(rest, pool.map(one, rest), strict=True)}
    outcomes = [{**first, **outcomes}[p.index] for p in points]
    rows = [results.summarize(p, o) for p, o in zip(points, outcomes, strict=True)]
    results.write_results(root, rows)
    results.write_curves(root, points)
    echo((root / "results.md").read_text())
    return rows
