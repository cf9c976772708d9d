"""Compaction on and off, in one process, alternating: the seconds to decode a run's split as
`evaluate` batches it (sorted by length, eval buckets, data.eval_batch_size sentences).

    python benchmarks/decode_compaction.py --workdir=runs/default [--split=test] [--step=N]
        [--beam 4] [--reps 5]

Both programs are compiled first; then the split is decoded --reps times with compact=1 and
compact=4 in turn (a slow spell of a shared VM hits both), reporting the fastest and the
median of each, and whether the two gave identical tokens. Writes
benchmarks/results/decode_compaction.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts this checkout first on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=os.path.join(_common.ROOT, "runs", "default"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    threads = _common.pin_threads(args.threads)

    import flax.linen as nn
    import jax
    import numpy as np

    from tx_jax.data import tasks
    from tx_jax.inference import decoding, restore

    loaded = restore.load(args.workdir, step=args.step)
    task = tasks.TranslationTask(loaded.config.data, loaded.tokenizer, loaded.config.seed)
    batches = [np.asarray(b["inputs"]) for b in task.eval_batches(args.split, 1, None)]
    params, cfg, eos = nn.meta.unbox(loaded.params), loaded.model_config, loaded.tokenizer.eos_id

    def run(compact: int) -> list[np.ndarray]:
        if args.beam == 1:
            outs = [
                decoding.translate_greedy(cfg, params, b, eos_id=eos, compact=compact)
                for b in batches
            ]
        else:
            outs = [
                decoding.translate_beam(
                    cfg, params, b, beam_size=args.beam, eos_id=eos, compact=compact
                )[0]
                for b in batches
            ]
        return [np.asarray(o) for o in jax.block_until_ready(outs)]

    ways = (1, decoding.COMPACT)
    first = {c: run(c) for c in ways}  # compilation
    identical = all((a == b).all() for a, b in zip(first[ways[0]], first[ways[1]]))
    times: dict[int, list[float]] = {c: [] for c in ways}
    for _ in range(args.reps):
        for c in ways:
            start = time.perf_counter()
            run(c)
            times[c].append(time.perf_counter() - start)
    rows = [
        [
            f"compact={c}",
            min(times[c]),
            _common.median(times[c]),
            " ".join(f"{t:.2f}" for t in times[c]),
        ]
        for c in ways
    ]
    print(_common.table(["decoding", "fastest s", "median s", "runs"], rows))
    print("identical tokens:", identical)
    payload = dict(
        workdir=_common.portable_path(str(loaded.workdir)),
        step=loaded.step,
        split=args.split,
        beam=args.beam,
        threads=threads,
        batches=len(batches),
        batch_size=loaded.config.data.eval_batch_size,
        identical=identical,
        seconds={str(c): [round(t, 3) for t in times[c]] for c in ways},
    )
    print("wrote", _common.write_json("decode_compaction", payload, args.out or None))


if __name__ == "__main__":
    main()
