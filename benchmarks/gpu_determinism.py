"""Which part of the train step breaks, or stays non-repeatable, under XLA:GPU's deterministic
mode: one process, the flag set before jax starts, one case at a time.

    XLA_FLAGS=--xla_gpu_deterministic_ops=true python benchmarks/gpu_determinism.py \
        --cases "small:bfloat16:xla/model.dropout_rate=0.0,small:bfloat16:cudnn,..."

A case is gpu_step.py's (VARIANT:DTYPE[:ATTENTION][/KEY=VALUE...] of configs/wmt14_ende.py,
its 104 x 256 packed batch). Each case is compiled for this device as the planner builds it,
then run twice from the same initial state for --steps steps: 'ok' with both runs' losses
(bit-identical or not), or the exception's type and first line where it fails. Prints one JSON
line per case and writes them all to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_step  # noqa: E402


def run_case(case: str, steps: int, device) -> dict:

    from tx_jax.data.tokenizer import BOS_ID
    from tx_jax.planning import programs
    from tx_jax.planning.targets import Target
    from tx_jax.runner.setup import build_model

    config = gpu_step.case_config(case)
    row: dict = {"case": case, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        chip_name, _ = gpu_step.chip_of(device)
        platform = device.platform
        target = Target(f"{platform}:{chip_name or platform}-1", platform, chip_name or "", 1)
        built = programs.build(config, target, [device])
        shapes = programs.train_batches(built)[-1]
        program = programs.compile_train(built, shapes)
        row["custom_calls"] = sorted(set(program.custom_calls))
        _, _, _, _, init_fn = build_model(
            config, config.data.vocab_size, BOS_ID, built.target.platform
        )
        s = built.strategy
        batch = gpu_step._packed_batch(shapes, config.data.vocab_size, 0, s.batch_sharding())
        runs = []
        with s.context():
            for _ in range(2):
                state = s.init_state(init_fn)
                losses = []
                for _ in range(steps):
                    state, metrics = program.executable(state, batch)
                    losses.append(float(metrics["loss"]))
                runs.append(losses)
        row.update(status="ok", losses=runs, repeatable=runs[0] == runs[1])
    except Exception as e:  # noqa: BLE001 - the finding is which case raises what
        lines = str(e).strip().splitlines()
        row.update(status="error", error=f"{type(e).__name__}: {lines[0] if lines else ''}")
        row["where"] = traceback.format_exc().strip().splitlines()[-3:]
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/gpu_determinism.json")
    args = p.parse_args(argv)
    import jax

    device = jax.devices()[0]
    rows = []
    for case in args.cases.split(","):
        rows.append(run_case(case, args.steps, device))
        print(json.dumps(rows[-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump({"device_kind": device.device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
