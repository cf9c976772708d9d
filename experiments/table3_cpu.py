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

from tx_jax.config import sibling_module

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
    "eval.test_split": "",  # validation only: the test set chooses nothing
    "checkpoint.every": 600,
}
ORDER = ("B", "A", "D", "E", "C")


def sweep() -> list[dict]:
    rows = table3.rows(D_MODEL, NUM_HEADS)
    points = [p for row in ORDER for p in rows[row]]
    return [{}] + [p for p in points if p != {"model.num_heads": NUM_HEADS}]
