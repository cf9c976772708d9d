"""Run a sweep: every point of an experiments/*.py file in its own workdir, then one table.

    tx_jax sweep experiments/table3.py --root=runs/sweeps/table3 [--parallel=2]
        [--dry_run] [--only=0,3] [--test_split_eval] [--override=train.num_steps=100 ...]
    ./launch.sh sweep experiments/table3.py [--parallel 2] [...]     (the same, via the venv)

A sweep file defines `sweep() -> list[dict]` of dotted config overrides, `CONFIG =
"configs/<file>.py:<arg>"` (the base config) and optionally `NAME` (the default root is
runs/sweeps/NAME, else the file's stem) and `BASE` (overrides under every point: a smaller
base model, fewer steps; a point's own overrides win, and only they name it). Every override
key of every point is checked against the base config before anything runs: a typo is an
error naming the key and point.

Point i runs as its own process, `tx_jax train --config=... --workdir=ROOT/<i>_<slug>
--config.k=v ...`, N at a time (--parallel); its stdout/stderr go to WORKDIR/sweep.log and
the exact command to WORKDIR/sweep_command.sh (with N > 1, the first point to run goes
alone, preparing the shared TFDS data, then the rest N at a time). Values that absl's config
flags cannot parse (lists, None, dicts) go through a generated WORKDIR/sweep_config.py
instead (the base config plus those overrides). After a successful run the runner writes
WORKDIR/sweep_done.json (overrides, wall time, command, test BLEU of --test_split_eval); a
rerun skips the points that have it, and resumes the others from their checkpoints. At the end:

    ROOT/results.csv, ROOT/results.md   one row per point: index, name, status, overrides,
                                        steps, wall_s, val_bleu, val_loss, test_bleu
    ROOT/curves.png                     loss and BLEU curves of every run, labelled by name

val_* are the last validation record of WORKDIR/metrics.jsonl; test_bleu the last record of
the test split (written at the end of training when eval.score_test is set) or, with
--test_split_eval, `tx_jax evaluate --split=test --beam_size=B` on the final
checkpoint. A failed point is reported (status 'failed (rc N)') and the others go on; the
exit status is 1 if any point failed (2 for a bad sweep file or override). ROOT may be a
gs:// path (tx_jax/paths.py): a point's log is then copied there when its process ends, and a
generated config is loaded from a local copy.
"""

from __future__ import annotations

import concurrent.futures
import copy
import csv
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from tx_jax import paths
from tx_jax.config import (
    apply_overrides,
    convert_text,
    load_config,
    load_module,
    parse_assignments,
    upgrade_stored,
)

DONE_FILE = "sweep_done.json"
LOG_FILE = "sweep.log"
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
# Types that `--config.k=v` parses (absl config_flags); the rest go through sweep_config.py.
_FLAG_TYPES = (bool, int, float, str)


# ---------------------------------------------------------------------- loading, expansion


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    config: str  # 'configs/x.py:arg', the base config
    points: list[dict[str, Any]]  # dotted overrides, one dict per point
    base: dict[str, Any] = dataclasses.field(default_factory=dict)  # under every point


@dataclasses.dataclass(frozen=True)
class Point:
    index: int
    name: str  # 'model.num_heads=16,model.d_model=256' ('baseline' for no overrides)
    overrides: dict[str, Any]
    workdir: epath.Path  # local or gs://


def load_sweep(path: str | os.PathLike) -> Sweep:
    """An experiments/*.py file -> Sweep (its NAME, CONFIG, BASE and sweep())."""
    path = pathlib.Path(path)
    module = load_module(path, f"tx_jax_sweep_{path.stem}")
    for attr in ("CONFIG", "sweep"):
        if not hasattr(module, attr):
            raise ValueError(f"{path}: a sweep file defines {attr}")
    points = [dict(p) for p in module.sweep()]
    base = getattr(module, "BASE", {})
    if not isinstance(base, Mapping):
        raise ValueError(f"{path}: BASE is a dict of dotted overrides, not {type(base).__name__}")
    return Sweep(getattr(module, "NAME", path.stem), module.CONFIG, points, dict(base))


def point_name(overrides: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={_flag_value(v)}" for k, v in overrides.items()) or "baseline"


def _slug(name: str, limit: int = 80) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", name)[:limit].strip("_") or "point"


def expand(
    sweep: Sweep, root: str | os.PathLike, extra: Mapping[str, Any] | None = None
) -> list[Point]:
    """The sweep's points (each with `extra` overrides added), validated against the base
    config: an unknown key or a value of the wrong type raises ValueError naming both."""
    base = load_config(sweep.config)
    points = []
    for i, overrides in enumerate(sweep.points):
        name = point_name(overrides)
        full = {**sweep.base, **overrides, **(extra or {})}
        try:
            apply_overrides(copy.deepcopy(base), full)
        except (KeyError, TypeError, ValueError) as e:
            message = e.args[0] if e.args else e
            raise ValueError(f"sweep point {i} ({name}): {message}") from None
        workdir = paths.Path(root) / f"{i:02d}_{_slug(name)}"
        points.append(Point(i, name, full, workdir))
    return points


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """['a.b=3', 'c=/x y'] -> {'a.b': 3, 'c': '/x y'} (Python literals, else strings)."""
    return {k: convert_text(v, None) for k, v in parse_assignments(items, "--override").items()}


# ---------------------------------------------------------------------- commands


def _flag_value(value: Any) -> str:
    return repr(value) if isinstance(value, (list, tuple, dict)) else str(value)


def command(point: Point, config: str, python: str = sys.executable) -> tuple[list[str], str]:
    """(argv of one point, text of WORKDIR/sweep_config.py or '' when every value is a flag)."""
    flag_items = {k: v for k, v in point.overrides.items() if isinstance(v, _FLAG_TYPES)}
    other = {k: v for k, v in point.overrides.items() if k not in flag_items}
    wrapper = ""
    if other:
        path, _, arg = config.partition(":")
        base = os.path.abspath(path) + (f":{arg}" if arg else "")
        wrapper = (
            '"""Generated by tx_jax sweep: the base config plus overrides flags cannot carry."""\n'
            "from tx_jax.config import apply_overrides, load_config\n\n\n"
            "def get_config():\n"
            f"    config = load_config({base!r})\n"
            f"    apply_overrides(config, {other!r})\n"
            "    return config\n"
        )
        config = _config_file(point)
    argv = [python, "-m", "tx_jax.main", f"--config={config}", f"--workdir={point.workdir}"]
    return argv + [f"--config.{k}={_flag_value(v)}" for k, v in flag_items.items()], wrapper


def _config_file(point: Point) -> str:
    """Where the point's generated config is loaded from: its workdir, or, for a gs:// one, a
    local copy (a config is Python, imported from a file); the workdir keeps a copy too."""
    if not paths.is_remote(point.workdir):
        return str(point.workdir / "sweep_config.py")
    key = hashlib.sha256(str(point.workdir).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "tx_jax_sweeps", key, "sweep_config.py")


def _env(parallel: int) -> dict[str, str]:
    env = dict(os.environ)
    if parallel > 1:  # N processes share one accelerator: no process takes 75% of its memory
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / parallel:.3f}")
    return env


def _done(point: Point) -> dict | None:
    path = point.workdir / DONE_FILE
    if not path.exists():
        return None
    done = json.loads(path.read_text())
    return done if done.get("overrides") == _jsonable(point.overrides) else None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def run_point(
    point: Point,
    config: str,
    *,
    parallel: int = 1,
    test_split_eval: bool = False,
    beam_size: int = 4,
) -> dict[str, Any]:
    """Run one point (unless already done) -> {'status', 'wall_s', ...} (the DONE record)."""
    if (done := _done(point)) is not None:
        return {**done, "status": "skipped (done)"}
    argv, wrapper = command(point, config)
    point.workdir.mkdir(parents=True, exist_ok=True)
    if wrapper:
        (point.workdir / "sweep_config.py").write_text(wrapper)
        local = _config_file(point)
        if paths.is_remote(point.workdir):
            os.makedirs(os.path.dirname(local), exist_ok=True)
            pathlib.Path(local).write_text(wrapper)
    (point.workdir / "sweep_command.sh").write_text(shlex.join(argv) + "\n")
    start = time.time()
    rc = _run_logged(argv, point, parallel)
    record = {
        "overrides": _jsonable(point.overrides),
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


def _run_logged(argv: list[str], point: Point, parallel: int) -> int:
    """Run `argv` with its output appended to the point's log (command line first); a gs://
    workdir's log gets the output when the process ends (it is written locally meanwhile)."""
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
    """`tx_jax evaluate` on the test split in a subprocess (the runner never holds a device)."""
    argv = [
        sys.executable,
        "-m",
        "tx_jax",
        "evaluate",
        f"--workdir={point.workdir}",
        "--split=test",
        f"--beam_size={beam_size}",
    ]
    rc = _run_logged(argv, point, parallel)
    results = point.workdir / "eval_results.jsonl"
    if rc != 0 or not results.exists():
        return None
    record = json.loads(results.read_text().splitlines()[-1])
    return {k: record.get(k) for k in ("bleu", "step", "split", "beam", "length_penalty")}


# ---------------------------------------------------------------------- results


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
        "overrides": json.dumps(_jsonable(point.overrides)),
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
    points = expand(sweep, root, overrides)
    if only is not None:
        unknown = sorted(set(only) - {p.index for p in points})
        if unknown:
            raise ValueError(f"--only: no points {unknown} (the sweep has {len(points)})")
        points = [p for p in points if p.index in set(only)]
    if dry_run:
        for p in points:
            state = "done, skipped" if _done(p) else "to run"
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
    pending = [p for p in points if _done(p) is None]
    first = {pending[0].index: one(pending[0])} if parallel > 1 and len(pending) > 1 else {}
    with concurrent.futures.ThreadPoolExecutor(max(1, parallel)) as pool:
        rest = [p for p in points if p.index not in first]
        outcomes = {p.index: o for p, o in zip(rest, pool.map(one, rest), strict=True)}
    outcomes = [{**first, **outcomes}[p.index] for p in points]
    rows = [summarize(p, o) for p, o in zip(points, outcomes, strict=True)]
    write_results(root, rows)
    write_curves(root, points)
    echo((root / "results.md").read_text())
    return rows
