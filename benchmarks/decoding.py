"""Decoding speed: generated tokens/s for greedy and beam search, with and without the KV cache.

    python benchmarks/decoding.py [--lengths 16,32,64,128] [--batch 8] [--repeats 3]

The model is configs/default.py's (d_model 128, 2+2 layers, vocabulary 512) with random
weights; EOS is disabled (eos_id=-1) so every row decodes exactly T tokens. 'no cache'
recomputes the whole prefix with the full model at every step (decoding's reference path).
Times are the median of `--repeats` runs after compilation; tokens/s counts B * T for greedy
and B * T for beam search (the returned best hypotheses, not the N beams' work).
Prints a markdown table and writes benchmarks/results/decoding.json (--out to change).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts this checkout first on sys.path)

sys.path.insert(0, os.path.join(_common.ROOT, "configs"))
import default  # noqa: E402

from tx_jax.inference import decoding  # noqa: E402
from tx_jax.model.config import ModelConfig
from tx_jax.model.transformer import EncoderDecoder


def timed(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="16,32,64,128")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--source_len", type=int, default=80)  # T <= S + 50
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default="", help="default benchmarks/results/decoding.json")
    args = parser.parse_args()
    threads = _common.pin_threads(args.threads)
    cfg = ModelConfig.of_run(
        default.get_config(), jax.default_backend(), vocab_size=512, dropout_rate=0.0
    )
    model = EncoderDecoder(cfg)
    B = args.batch
    src = jnp.asarray(np.random.default_rng(0).integers(4, 512, (B, args.source_len)), jnp.int32)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), src, src)["params"])
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        for search in ("greedy", "beam4"):
            row = {"T": T, "search": search, "batch": B}
            for cache in (True, False):
                if search == "greedy":
                    fn = lambda c=cache, T=T: decoding.translate_greedy(  # noqa: E731
                        cfg, params, src, max_decode_len=T, eos_id=-1, use_cache=c
                    )
                else:
                    fn = lambda c=cache, T=T: decoding.translate_beam(  # noqa: E731
                        cfg, params, src, beam_size=4, max_decode_len=T, eos_id=-1, use_cache=c
                    )[0]
                seconds = timed(fn, args.repeats)
                row["cache_tok_s" if cache else "nocache_tok_s"] = B * T / seconds
            row["speedup"] = row["cache_tok_s"] / row["nocache_tok_s"]
            rows.append(row)
            print(
                f"T={T:>4} {search:>6}: cache {row['cache_tok_s']:>9,.0f} tok/s   no cache "
                f"{row['nocache_tok_s']:>8,.0f} tok/s   x{row['speedup']:.1f}",
                flush=True,
            )
    headers = [
        "T",
        "greedy, cache (tok/s)",
        "greedy, no cache",
        "speed-up",
        "beam 4, cache",
        "beam 4, no cache",
        "speed-up",
    ]
    by = {(r["T"], r["search"]): r for r in rows}
    table = []
    for T in sorted({r["T"] for r in rows}):
        g, b = by[(T, "greedy")], by[(T, "beam4")]
        table.append(
            [
                T,
                g["cache_tok_s"],
                g["nocache_tok_s"],
                f"{g['speedup']:.1f}x",
                b["cache_tok_s"],
                b["nocache_tok_s"],
                f"{b['speedup']:.1f}x",
            ]
        )
    print(f"\nbatch {B}, source length {args.source_len}, {threads} threads")
    print(_common.table(headers, table))
    path = _common.write_json(
        "decoding",
        {
            "device": str(jax.devices()[0]),
            "threads": threads,
            "batch": B,
            "source_len": args.source_len,
            "repeats": args.repeats,
            "rows": rows,
        },
        path=args.out or None,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
