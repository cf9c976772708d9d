"""What starting from a trained model costs: peak host memory and seconds of a run's start
(`size_from_data`, `build_run`, `restore_or_init`) with train.init_from, for full fine-tuning
and for LoRA.

    python benchmarks/init_from_memory.py --base=runs/init_base [--strategy=mesh]

On a CPU the devices' memory is the process's, so the peak resident memory of the start is
what an accelerator's memory would hold at its peak, plus the host's own buffers (Orbax's
reads). The base is made first when --base does not exist: configs/default.py's synthetic
pair with a model of --d_model (6 + 6 layers, d_ff 4 x d_model), trained one step. Each mode
runs in a process of its own (peak RSS is per process); printed as a table and written to
benchmarks/results/init_from_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

MODES = {  # name: train overrides
    "full fine-tuning": {},
    "LoRA r16": {"lora.rank": 16},
    "LoRA r16, base in bfloat16": {"lora.rank": 16, "frozen_dtype": "bfloat16"},
}


def _model(d_model: int) -> dict:
    return dict(
        d_model=d_model,
        num_heads=d_model // 64,
        d_ff=4 * d_model,
        num_encoder_layers=6,
        num_decoder_layers=6,
    )


def make_base(base: str, d_model: int, data_dir: str) -> None:
    flags = [f"--config.model.{k}={v}" for k, v in _model(d_model).items()]
    flags += ["--config.train.num_steps=1", "--config.data.tokens_per_batch=512"]
    flags += ["--config.eval.every=1000", "--config.eval.bleu_examples=0"]
    flags += ["--config.eval.score_test=False", f"--config.data.data_dir={data_dir}"]
    argv = [sys.executable, "-m", "tx_jax.main", "--config=configs/default.py"]
    subprocess.run([*argv, f"--workdir={base}", *flags], cwd=_common.ROOT, check=True)


def measure(args) -> None:
    """One mode, in this process: prints one JSON line."""
    import resource
    import time

    import jax

    from tx_jax.config import load_config
    from tx_jax.runner.setup import build_run, restore_or_init, size_from_data
    from tx_jax.training.checkpoint import Checkpointer

    c = load_config("configs/default.py")
    c.model.update(_model(args.d_model))
    c.data.data_dir = args.data_dir
    c.parallel.strategy = args.strategy
    c.train.init_from = args.base
    for key, value in MODES[args.measure].items():
        section, _, name = key.rpartition(".")
        (c.train[section] if section else c.train)[name] = value
    with tempfile.TemporaryDirectory() as workdir:
        run = build_run(size_from_data(c, workdir))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        start = time.perf_counter()
        state, _ = restore_or_init(run, Checkpointer(os.path.join(workdir, "checkpoints")))
        jax.block_until_ready(state)
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    state_mib = sum(x.nbytes for x in jax.tree_util.tree_leaves(state)) / 2**20
    print(json.dumps(dict(mode=args.measure, state_mib=state_mib, start_s=seconds,
                          peak_before_mib=before, peak_mib=peak)))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default="runs/init_base")
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--data_dir", default="tfds")
    p.add_argument("--strategy", default="mesh", choices=("mesh", "pmap"))
    p.add_argument("--measure", help=argparse.SUPPRESS)  # one mode (the child processes)
    args = p.parse_args()
    if args.measure:
        return measure(args)
    if not os.path.isdir(args.base):
        make_base(args.base, args.d_model, args.data_dir)
    rows = []
    for mode in MODES:
        argv = [sys.executable, __file__, f"--measure={mode}", *sys.argv[1:]]
        out = subprocess.run(argv, cwd=_common.ROOT, check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        _common.table(
            ["mode", "state MiB", "peak RSS added by the start, MiB", "start s"],
            [
                [
                    r["mode"],
                    f"{r['state_mib']:,.0f}",
                    f"{r['peak_mib'] - r['peak_before_mib']:,.0f}",
                ]
                + [f"{r['start_s']:.1f}"]
                for r in rows
            ],
        )
    )
    _common.write_json(
        "init_from_memory",
        {"d_model": args.d_model, "strategy": args.strategy, "rows": rows},
    )


if __name__ == "__main__":
    main()
