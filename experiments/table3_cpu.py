"""The paper's Table 3 rows at a size the 2-core CPU runs: experiments/table3.py's rows on a
base half as wide as configs/multi30k.py's `small`, for 600 steps.

    ./launch.sh sweep experiments/table3_cpu.py          -> runs/sweeps/table3_cpu/results.md

Base (BASE below): d_model 128, 4 heads (d_k = d_v = 32), d_ff 512, 3 + 3 layers, 600 steps
of 2,048 target tokens (about 3 epochs of Multi30k en->de), validation BLEU (greedy, all
1,014 sentences) and loss at the end. The rows scale as table3.rows(128, 4) says: A heads
1, 16, 32 (4 is the base); B d_k 8, 16 at d_v 32; C N 2, 4, 8, d_model 64, 256, d_ff 256,
1024; D dropout 0.0, 0.2, label smoothing 0.0, 0.2; E learned positions. Points run in the
order base, B, A, D, E, C (C's are the slowest), so an interrupted sweep has the cheap rows;
rerunning the command resumes it. At this size the runs are far from converged: the table
ranks how fast each variant learns in 600 steps, not where it ends.
"""

import json
import pathlib
import sys

from tx_jax.config import sibling_module
from tx_jax.launch import local, sweeps

table3 = sibling_module(__file__, "table3")

CONFIG = table3.CONFIG
NAME = "table3_cpu"
D_MODEL, NUM_HEADS = 128, 4
BASE = {
    "model.d_model": D_MODEL,
    "model.d_ff": 4 * D_MODEL,
    "model.num_heads": NUM_HEADS,
    "data.tokens_per_batch": 2048,
    "train.num_steps": 600,
    "train.warmup_steps": 300,
    "train.lr_scale": 0.5,  # peak 0.5 * 128^-0.5 * 300^-0.5 = 2.6e-3
    "train.log_every": 50,
    "eval.every": 600,
    "eval.score_test": False,  # validation only: the test set chooses nothing
    "checkpoint.every": 600,
    # as the 12 points run on 2026-11-23 trained, before configs/multi30k.py's 2026-11-26
    # recipe (bfloat16 compute, a cooldown): every point of the table has the same base
    "model.dtype": "float32",
    "train.cooldown_steps": 0,
}
ORDER = ("B", "A", "D", "E", "C")


def sweep() -> list[dict]:
    rows = table3.rows(D_MODEL, NUM_HEADS)
    points = [p for row in ORDER for p in rows[row]]
    return [{}] + [p for p in points if p != {"model.num_heads": NUM_HEADS}]


# The paper's Table 3 (newstest2013, EN-DE; perplexity per word piece, BLEU), by point.
PAPER = {
    "baseline": ("base: N 6, d_model 512, d_ff 2048, h 8, d_k = d_v 64", 4.92, 25.8),
    "model.head_dim=8,model.value_head_dim=32": ("B: d_k 16", 5.16, 25.1),
    "model.head_dim=16,model.value_head_dim=32": ("B: d_k 32", 5.01, 25.4),
    "model.num_heads=1": ("A: h 1, d_k = d_v 512", 5.29, 24.9),
    "model.num_heads=16": ("A: h 16, d_k = d_v 32", 4.91, 25.8),
    "model.num_heads=32": ("A: h 32, d_k = d_v 16", 5.01, 25.4),
    "model.dropout_rate=0.0": ("D: P_drop 0.0", 5.77, 24.6),
    "model.dropout_rate=0.2": ("D: P_drop 0.2", 4.95, 25.5),
    "train.label_smoothing=0.0": ("D: eps_ls 0.0", 4.67, 25.3),
    "train.label_smoothing=0.2": ("D: eps_ls 0.2", 5.47, 25.7),
    "model.positional=learned": ("E: learned positions", 4.92, 25.7),
    "model.num_encoder_layers=2,model.num_decoder_layers=2": ("C: N 2", 6.11, 23.7),
    "model.num_encoder_layers=4,model.num_decoder_layers=4": ("C: N 4", 5.19, 25.3),
    "model.num_encoder_layers=8,model.num_decoder_layers=8": ("C: N 8", 4.88, 25.5),
    "model.d_model=64": ("C: d_model 256", 5.75, 24.5),
    "model.d_model=256": ("C: d_model 1024", 4.66, 26.0),
    "model.d_ff=256": ("C: d_ff 1024", 5.12, 25.4),
    "model.d_ff=1024": ("C: d_ff 4096", 4.75, 26.2),
}


def table(root: str) -> str:
    """The table of docs/experiments.md "The paper's Table 3 at CPU scale" from a finished (or
    partly finished) sweep under `root`."""
    points = sweeps.expand(sweeps.load_sweep(__file__), root)
    lines = [
        "| point (here) | paper's row | paper PPL | paper BLEU | here: val PPL | here: val BLEU |",
        "|---|---|---|---|---|---|",
    ]
    for p in points:
        row, ppl, bleu = PAPER[p.name]
        metrics = p.workdir / "metrics.jsonl"
        done = (p.workdir / local.DONE_FILE).exists() and metrics.exists()
        here = "not run | not run"
        if done:
            records = [json.loads(x) for x in pathlib.Path(metrics).read_text().splitlines()]
            last = [r for r in records if r["split"] == "validation"][-1]
            here = f"{last['perplexity']:.2f} | {last['bleu']:.2f}"
        lines.append(f"| {p.name} | {row} | {ppl} | {bleu} | {here} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1] if len(sys.argv) > 1 else "runs/sweeps/table3_cpu"))
