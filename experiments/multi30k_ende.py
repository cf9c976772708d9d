"""Multi30k en->de end to end, one command: train, choose on validation, score the test set.

    python experiments/multi30k_ende.py [--root=runs/multi30k_ende] [--seeds=0,1]
        [--config=configs/multi30k.py:variant=small] [--override train.num_steps=3000 ...]
        [--manual_dir=../shared/data/multi30k] [--data_dir=TFDS_DIR] [--debug]

For every seed, in ROOT/seed<N>:
  1. train the config (`train_and_evaluate`; a rerun resumes, a finished run is reused);
  2. candidates: the checkpoint with the best validation BLEU logged during training (greedy),
     the last checkpoint, and the average of the last --average_last checkpoints;
  3. decode the validation split with each candidate (beam --beam_size, alpha --alpha) and
     keep the one with the highest validation BLEU (ties: the earlier candidate in that order);
  4. decode test_2016_flickr with the kept candidate alone and print its BLEU with the
     sacreBLEU signature.
The test split is decoded once per seed, after the choice: no test score chooses anything.
ROOT/results.json and ROOT/RESULTS.md hold every seed's candidates, choice, test BLEU / chrF,
wall times and the machine, and the mean and spread over the seeds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python experiments/multi30k_ende.py` from anywhere
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402

from tx_jax.config import apply_overrides, load_config, parse_assignments  # noqa: E402
from tx_jax.experiment.loop import train_and_evaluate  # noqa: E402
from tx_jax.inference import evaluation, locate  # noqa: E402

TEST_SPLIT = "test_2016_flickr"


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


def candidates(workdir: pathlib.Path, average_last: int) -> list[dict[str, Any]]:
    """evaluate()'s arguments of each candidate: best-by-validation, last, average of last K."""
    ckpt = locate.open_checkpoints(workdir / locate.CHECKPOINTS_DIR)
    kept = ckpt.all_steps()
    ckpt.close()
    out = [
        {"name": "best_validation", "step": validation_best_step(workdir, kept), "average_last": 0},
        {"name": "last", "step": kept[-1], "average_last": 0},
    ]
    if average_last > 1 and len(kept) >= average_last:
        out.append(
            {"name": f"average_last{average_last}", "step": None, "average_last": average_last}
        )
    return out


def run_seed(config, workdir: pathlib.Path, args) -> dict[str, Any]:
    start = time.time()
    final = train_and_evaluate(config, str(workdir))
    if "stopped_at" in final:
        raise SystemExit(f"{workdir}: stopped at step {int(final['stopped_at'])}; rerun to resume")
    train_s = time.time() - start
    decode = dict(beam_size=args.beam_size, alpha=args.alpha)
    scored = []
    for c in candidates(workdir, args.average_last):
        where = {"step": c["step"], "average_last": c["average_last"]}
        record = evaluation.evaluate(workdir, split="validation", **where, **decode)
        scored.append({**c, "validation_bleu": record["bleu"], "step": record["step"]})
    chosen = max(scored, key=lambda c: c["validation_bleu"])  # first of equals: max is stable
    # (an average's step is its last one: averaging the last K up to it is the same average)
    where = {"step": chosen["step"], "average_last": chosen["average_last"]}
    test = evaluation.evaluate(workdir, split=TEST_SPLIT, **where, **decode)
    return {
        "seed": int(config.seed),
        "workdir": str(workdir),
        "candidates": scored,
        "chosen": chosen["name"],
        "test_bleu": test["bleu"],
        "test_chrf": test["chrf"],
        "signature": test["signature"],
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - start, 1),
        "steps": int(config.train.num_steps),
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    bleu = [r["test_bleu"] for r in rows]
    return {
        "test_bleu_mean": round(statistics.mean(bleu), 2),
        "test_bleu_std": round(statistics.stdev(bleu), 2) if len(bleu) > 1 else 0.0,
        "test_bleu_min": round(min(bleu), 2),
        "test_bleu_max": round(max(bleu), 2),
        "seeds": len(rows),
    }


def machine() -> str:
    devices = jax.devices()
    return (
        f"{len(devices)} x {devices[0].device_kind} ({platform.machine()}), jax {jax.__version__}"
    )


def write_results(root: pathlib.Path, spec: str, rows: list[dict], args) -> pathlib.Path:
    decode = {"beam_size": args.beam_size, "alpha": args.alpha}
    result = {"config": spec, "overrides": args.override, "machine": machine(), "decode": decode}
    result.update(seeds=rows, summary=summary(rows))
    (root / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    s = result["summary"]
    lines = [
        f"# {spec} on {TEST_SPLIT}",
        "",
        f"Machine: {result['machine']}. Beam {args.beam_size}, alpha {args.alpha}. "
        f"Test BLEU {s['test_bleu_mean']:.2f} +- {s['test_bleu_std']:.2f} over {s['seeds']} "
        f"seed(s) (min {s['test_bleu_min']:.2f}, max {s['test_bleu_max']:.2f}).",
        "",
        "| seed | steps | chosen on validation | validation BLEU of the candidates | test BLEU | "
        "test chrF | train wall |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cands = ", ".join(f"{c['name']} {c['validation_bleu']:.2f}" for c in r["candidates"])
        lines.append(
            f"| {r['seed']} | {r['steps']} | {r['chosen']} | {cands} | {r['test_bleu']:.2f} | "
            f"{r['test_chrf']:.2f} | {r['train_seconds'] / 60:.1f} min |"
        )
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
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--average_last", type=int, default=3, help="candidate: mean of last K")
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
        config.eval.test_split = ""  # the test split is decoded once, after the choice
        paths = {"data.manual_dir": args.manual_dir, "data.data_dir": args.data_dir}
        apply_overrides(config, {k: v for k, v in paths.items() if v})
        apply_overrides(config, parse_assignments(args.override, "--override"), from_text=True)
        rows.append(run_seed(config, root / f"seed{seed}", args))
        r = rows[-1]
        print(
            f"seed {seed}: chose {r['chosen']}; {TEST_SPLIT} BLEU {r['test_bleu']:.2f} "
            f"(beam {args.beam_size})  {r['signature']}",
            flush=True,
        )
    report = write_results(root, spec, rows, args)
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
