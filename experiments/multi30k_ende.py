"""Multi30k en->de end to end, one command: train, choose on validation, score the test set.

    python experiments/multi30k_ende.py [--root=runs/multi30k_ende] [--seeds=0,1]
        [--config=configs/multi30k.py:variant=small] [--override train.num_steps=3000 ...]
        [--budgets=60,150] [--beams=4,6 --length_penalties=0.6,1.0]
        [--manual_dir=../shared/data/multi30k] [--data_dir=TFDS_DIR] [--debug]

For every seed, in ROOT/seed<N>:
  1. train the config (`train_and_evaluate`; a rerun resumes, a finished run is reused);
  2. candidates: the checkpoint with the best validation BLEU logged during training (greedy),
     the last checkpoint, and the average of the last --average_last checkpoints;
  3. decode the validation split with each candidate (beam --beam_size, length penalty
     --length_penalty) and keep the one with the highest validation BLEU (ties: the earlier
     candidate in that order); with --beams / --length_penalties, decode validation with the
     kept one at each beam x length penalty and
     keep the best point;
  4. decode test_2016_flickr with the kept candidate alone and print its BLEU with the
     sacreBLEU signature.
--budgets=60,150 runs steps 2-4 once per budget, over the checkpoints saved within that many
minutes of training (the run's train_seconds, summed over its segments when it was stopped and
resumed, kept in each checkpoint): a time-to-quality result from one run, with the test split
decoded once per budget, after that budget's choice; no test score chooses anything.
ROOT/results.json and ROOT/RESULTS.md hold every seed's candidates, choice, test BLEU / chrF,
training minutes, segments (which CPU trained which steps) and the machine, and the mean and
spread over the seeds (per budget). A seed's result is kept in ROOT/seed<N>/seed_result.json:
rerunning with the same arguments reuses it, so seeds can be run one at a time and summarised
together (`--seeds=0`, then `--seeds=1`, then `--seeds=0,1` decodes nothing again).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python experiments/multi30k_ende.py` from anywhere
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402

from tx_jax.config import apply_overrides, load_config, parse_assignments  # noqa: E402
from tx_jax.inference import evaluation, locate  # noqa: E402
from tx_jax.runner.loop import train_and_evaluate  # noqa: E402
from tx_jax.training import logs  # noqa: E402

TEST_SPLIT = "test_2016_flickr"
SEED_RESULT = "seed_result.json"  # a seed's finished result, reused by a rerun


def protocol(spec: str, args, config) -> dict[str, Any]:
    """What a seed's result depends on: a rerun with the same reuses it (no second test
    decode), e.g. `--seeds=0,1` after `--seeds=0`."""
    return {
        "config": spec,
        "overrides": list(args.override),
        "num_steps": int(config.train.num_steps),
        "beam_size": args.beam_size,
        "length_penalty": args.length_penalty,
        "average_last": args.average_last,
        "budgets": _floats(args.budgets),
        "beams": _ints(args.beams),
        "length_penalties": _floats(args.length_penalties),
    }


def validation_best_step(workdir: pathlib.Path, kept: list[int]) -> int:
    """The kept checkpoint whose validation BLEU (logged during training) is highest."""
    bleu = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == "validation" and "bleu" in record and record["step"] in kept:
            bleu[record["step"]] = record["bleu"]
    if not bleu:
        return kept[-1]
    return max(sorted(bleu), key=lambda s: bleu[s])


def kept_minutes(workdir: pathlib.Path) -> dict[int, float | None]:
    """Every kept checkpoint -> the run's training minutes when it was saved (the sum of the
    segments, from its meta; None for a checkpoint saved before tx_jax kept that)."""
    ckpt = locate.open_checkpoints(workdir / locate.CHECKPOINTS_DIR)
    out = {}
    for step in ckpt.all_steps():
        seconds = ckpt.restore_meta(step).get("train_seconds")
        out[step] = None if seconds is None else seconds / 60
    ckpt.close()
    return out


def candidates(workdir: pathlib.Path, kept: list[int], average_last: int) -> list[dict[str, Any]]:
    """evaluate()'s arguments of each candidate among `kept`: best-by-validation, last, and
    the average of the last K up to the last."""
    out = [
        {"name": "best_validation", "step": validation_best_step(workdir, kept), "average_last": 0},
        {"name": "last", "step": kept[-1], "average_last": 0},
    ]
    if average_last > 1 and len(kept) >= average_last:
        out.append(
            {"name": f"average_last{average_last}", "step": kept[-1], "average_last": average_last}
        )
    return out


def within(minutes: dict[int, float | None], budget: float | None, workdir) -> list[int]:
    """The kept steps saved within `budget` training minutes (all for None)."""
    if budget is None:
        return sorted(minutes)
    unknown = [s for s, m in minutes.items() if m is None]
    if unknown:
        raise SystemExit(
            f"{workdir}: checkpoints {unknown} have no train_seconds (saved by an older "
            "tx_jax); --budgets needs them"
        )
    return sorted(s for s, m in minutes.items() if m <= budget)


def choose_and_test(workdir: pathlib.Path, kept: list[int], minutes, args) -> dict[str, Any]:
    """Decode validation with each candidate among `kept` (beam --beam_size, length penalty
    --length_penalty),
    keep the best; then each --beams x --length_penalties point of it on validation, keep the best;
    decode the test split once with what was kept."""
    decode = dict(beam_size=args.beam_size, length_penalty=args.length_penalty)
    scored, bleu = [], {}
    for c in candidates(workdir, kept, args.average_last):
        key = (c["step"], c["average_last"])  # best_validation is often the last: decode once
        if key not in bleu:
            where = {"step": c["step"], "average_last": c["average_last"]}
            bleu[key] = evaluation.evaluate(workdir, split="validation", **where, **decode)["bleu"]
        scored.append({**c, "validation_bleu": bleu[key]})
    chosen = max(scored, key=lambda c: c["validation_bleu"])  # first of equals: max is stable
    where = {"step": chosen["step"], "average_last": chosen["average_last"]}
    beams, length_penalties = (
        _ints(args.beams) or [args.beam_size],
        _floats(args.length_penalties) or [args.length_penalty],
    )
    grid = []
    if len(beams) * len(length_penalties) > 1:
        swept = evaluation.sweep(
            workdir, split="validation", beams=beams, length_penalties=length_penalties, **where
        )
        grid = [{k: p[k] for k in ("beam", "length_penalty", "bleu")} for p in swept["points"]]
        decode = dict(
            beam_size=swept["best"]["beam"], length_penalty=swept["best"]["length_penalty"] or 0.0
        )
    test = evaluation.evaluate(workdir, split=TEST_SPLIT, **where, **decode)
    return {
        "candidates": scored,
        "chosen": chosen["name"],
        "chosen_step": chosen["step"],
        "chosen_minutes": None
        if minutes[chosen["step"]] is None
        else round(minutes[chosen["step"]], 3),
        "decode_grid": grid,
        "decode": decode,
        "test_bleu": test["bleu"],
        "test_chrf": test["chrf"],
        "signature": test["signature"],
    }


def segments(workdir: pathlib.Path) -> list[dict[str, Any]]:
    """The run's processes from WORKDIR/segments.jsonl: the steps each trained, its training
    minutes and CPU (a run trained before tx_jax logged them has none)."""
    path = workdir / "segments.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    out = []
    for r in records:
        if r["event"] == "start":
            out.append({"from_step": r["step"], "cpu": r["cpu"], "started": r["time"]})
            out[-1]["minutes_before"] = round(r["train_seconds"] / 60, 2)
        elif out and "to_step" not in out[-1]:
            out[-1]["to_step"] = r["step"]
            out[-1]["minutes"] = round(r["train_seconds"] / 60 - out[-1]["minutes_before"], 2)
    return out


def _renamed(stored: Any) -> Any:
    """A seed's stored result with the length penalty under its name now (it was "alpha")."""
    if isinstance(stored, list):
        return [_renamed(x) for x in stored]
    if not isinstance(stored, dict):
        return stored
    names = {"alpha": "length_penalty", "alphas": "length_penalties"}
    return {names.get(k, k): _renamed(v) for k, v in stored.items()}


def run_seed(config, workdir: pathlib.Path, args) -> dict[str, Any]:
    start = time.time()
    final = train_and_evaluate(config, str(workdir))
    if "stopped_at" in final:
        raise SystemExit(f"{workdir}: stopped at step {int(final['stopped_at'])}; rerun to resume")
    train_s = time.time() - start
    minutes = kept_minutes(workdir)
    budgets = _floats(args.budgets) or [None]
    results = []
    for budget in budgets:
        kept = within(minutes, budget, workdir)
        if not kept:
            raise SystemExit(f"{workdir}: no checkpoint within {budget} training minutes")
        results.append({"budget_minutes": budget, **choose_and_test(workdir, kept, minutes, args)})
    last = max(minutes)
    return {
        "seed": int(config.seed),
        "workdir": str(workdir),
        **results[-1],  # the whole run's (or the largest budget's) result
        "budgets": results,
        "train_seconds": round(train_s, 1),  # this process's part
        "run_train_minutes": None if minutes[last] is None else round(minutes[last], 3),
        "total_seconds": round(time.time() - start, 1),
        "steps": int(config.train.num_steps),
        "segments": segments(workdir),
        "machine": machine(),  # where the choice and the test decode ran
    }


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, spread and range of the seeds' test BLEU: the whole run's, and per budget."""

    def stats(bleu: list[float]) -> dict[str, Any]:
        return {
            "test_bleu_mean": round(statistics.mean(bleu), 2),
            "test_bleu_std": round(statistics.stdev(bleu), 2) if len(bleu) > 1 else 0.0,
            "test_bleu_min": round(min(bleu), 2),
            "test_bleu_max": round(max(bleu), 2),
            "seeds": len(bleu),
        }

    out = stats([r["test_bleu"] for r in rows])
    budgets = [b["budget_minutes"] for b in rows[0]["budgets"] if b["budget_minutes"] is not None]
    if budgets:
        out["budgets"] = {
            str(budget): stats([r["budgets"][i]["test_bleu"] for r in rows])
            for i, budget in enumerate(budgets)
        }
    return out


def machine() -> str:
    devices = jax.devices()
    return f"{len(devices)} x {devices[0].device_kind} ({logs.cpu()}), jax {jax.__version__}"


def write_results(root: pathlib.Path, spec: str, rows: list[dict], args) -> pathlib.Path:
    decode = {"beam_size": args.beam_size, "length_penalty": args.length_penalty}
    result = {"config": spec, "overrides": args.override, "machine": machine(), "decode": decode}
    result.update(seeds=rows, summary=summary(rows))
    (root / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    s = result["summary"]
    lines = [
        f"# {spec} on {TEST_SPLIT}",
        "",
        f"Machine: {result['machine']}. Candidates scored with beam {args.beam_size}, length "
        f"penalty {args.length_penalty}. Test BLEU {s['test_bleu_mean']:.2f} +- "
        f"{s['test_bleu_std']:.2f} over {s['seeds']} seed(s) (min {s['test_bleu_min']:.2f}, "
        f"max {s['test_bleu_max']:.2f}).",
    ]
    for budget, b in s.get("budgets", {}).items():
        lines.append(
            f"Within {float(budget):g} training minutes: {b['test_bleu_mean']:.2f} +- "
            f"{b['test_bleu_std']:.2f} (min {b['test_bleu_min']:.2f}, "
            f"max {b['test_bleu_max']:.2f})."
        )
    lines += [
        "",
        "| seed | budget | chosen on validation (step, training minutes) | validation BLEU of "
        "the candidates | beam, length penalty | test BLEU | test chrF |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for b in r["budgets"]:
            cands = ", ".join(f"{c['name']} {c['validation_bleu']:.2f}" for c in b["candidates"])
            budget = "whole run" if b["budget_minutes"] is None else f"{b['budget_minutes']:g} min"
            when = f"{b['chosen_step']}" + (
                "" if b["chosen_minutes"] is None else f", {b['chosen_minutes']:.1f} min"
            )
            lines.append(
                f"| {r['seed']} | {budget} | {b['chosen']} ({when}) | {cands} | "
                f"{b['decode']['beam_size']}, {b['decode']['length_penalty']:g} | "
                f"{b['test_bleu']:.2f} | {b['test_chrf']:.2f} |"
            )
    trained = ", ".join(
        f"seed {r['seed']} {r['steps']} steps"
        + ("" if r["run_train_minutes"] is None else f" in {r['run_train_minutes']:.1f} min")
        for r in rows
    )
    lines += ["", f"Training: {trained}."]
    for r in rows:  # which CPU trained which steps: minutes compare only on the same kind
        parts = [
            f"{s['from_step']}-{s.get('to_step', '?')} on {s['cpu']}"
            + (f" ({s['minutes']:.1f} min)" if "minutes" in s else "")
            for s in r.get("segments", [])
        ]
        if parts:
            lines.append(f"Seed {r['seed']}'s segments: " + "; ".join(parts) + ".")
    lines += ["", f"Signature: {rows[0]['signature']}", ""]
    path = root / "RESULTS.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=str(REPO / "runs" / "multi30k_ende"))
    parser.add_argument(
        "--config", default=str(REPO / "configs" / "multi30k.py") + ":variant=small"
    )
    parser.add_argument("--seeds", default="0", help="comma-separated config seeds")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--beam_size", type=int, default=4)
    parser.add_argument("--length_penalty", type=float, default=0.6)
    parser.add_argument("--average_last", type=int, default=3, help="candidate: mean of last K")
    parser.add_argument(
        "--budgets",
        default="",
        help="training minutes, comma-separated: choose and test once within each (e.g. 60,150)",
    )
    parser.add_argument("--beams", default="", help="beam sizes tried on validation (e.g. 4,6)")
    parser.add_argument(
        "--length_penalties", default="", help="length penalties tried on validation (e.g. 0.6,1.0)"
    )
    parser.add_argument("--manual_dir", default=None, help="raw Multi30k files")
    parser.add_argument("--data_dir", default=None, help="TFDS data dir")
    parser.add_argument("--debug", action="store_true", help="configs/multi30k.py:debug (CI)")
    args = parser.parse_args(argv)
    spec = args.config.replace("variant=small", "variant=debug") if args.debug else args.config
    root = pathlib.Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        config = load_config(spec)
        config.seed = seed
        config.eval.score_test = False  # the test split is decoded once, after the choice
        paths = {"data.manual_dir": args.manual_dir, "data.data_dir": args.data_dir}
        apply_overrides(config, {k: v for k, v in paths.items() if v})
        apply_overrides(config, parse_assignments(args.override, "--override"), from_text=True)
        workdir = root / f"seed{seed}"
        done = workdir / SEED_RESULT
        wanted = protocol(spec, args, config)
        kept = _renamed(json.loads(done.read_text())) if done.exists() else {}
        if kept.get("protocol") == wanted:
            rows.append(kept["result"])  # its test split was decoded
            print(f"seed {seed}: done before with this protocol ({done})", flush=True)
        else:
            rows.append(run_seed(config, workdir, args))
            done.write_text(json.dumps({"protocol": wanted, "result": rows[-1]}, indent=1) + "\n")
        r = rows[-1]
        print(
            f"seed {seed}: chose {r['chosen']}; {TEST_SPLIT} BLEU {r['test_bleu']:.2f} "
            f"(beam {r['decode']['beam_size']}, length penalty "
            f"{r['decode']['length_penalty']:g})  {r['signature']}",
            flush=True,
        )
    report = write_results(root, spec, rows, args)
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
