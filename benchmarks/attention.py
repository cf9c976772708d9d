"""Attention implementations: time and compiled temporary memory against sequence length.

    python benchmarks/attention.py [--lengths 128,256,512,1024,2048,4096] [--reps 3]

For each implementation of tx_jax.model.attention.dot_product_attention ('xla', 'chunked'; 'cudnn'
only on a GPU), forward and forward+backward (the gradient of sum(out * cotangent) with respect
to q, k and v), causal self-attention with a padding mask given as segment ids, shapes
[B, L, H, D] = [1, L, 8, 64] (one head group of the paper's base model), float32 (--dtype:
bfloat16 on a GPU, where cuDNN's fused attention runs in bf16/fp16 only). Memory is
XLA's own figure for the compiled function:
jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes (buffers other than
arguments and outputs). Time is the median of --reps runs after a warm-up run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def _problem(L: int, B: int, H: int, D: int, dtype: str = "float32"):
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, cot = (jax.random.normal(kk, (B, L, H, D), dtype) for kk in ks)
    seg = jnp.ones((B, L), jnp.int32).at[:, L - L // 8 :].set(0)  # last 1/8 is padding
    return q, k, v, cot, seg


def _functions(impl: str, chunk_size: int):
    import jax
    import jax.numpy as jnp

    from tx_jax.model import attention

    def forward(q, k, v, cot, seg):
        return attention.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            q_segment_ids=seg,
            kv_segment_ids=seg,
            implementation=impl,
            chunk_size=chunk_size,
        )

    def backward(q, k, v, cot, seg):
        loss = lambda q, k, v: jnp.sum(forward(q, k, v, cot, seg) * cot)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return {"forward": forward, "forward+backward": backward}


def measure(impl: str, L: int, args) -> list[dict]:
    import jax

    q, k, v, cot, seg = _problem(L, args.batch, args.heads, args.head_dim, args.dtype)
    rows = []
    for mode, fn in _functions(impl, args.chunk_size).items():
        compiled = jax.jit(fn).lower(q, k, v, cot, seg).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        jax.block_until_ready(compiled(q, k, v, cot, seg))
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v, cot, seg))
            times.append(time.perf_counter() - start)
        rows.append(
            {
                "impl": impl,
                "mode": mode,
                "length": L,
                "temp_bytes": int(temp),
                "time_s": _common.median(times),
                "times": times,
            }
        )
        print(
            f"  {impl:8s} {mode:17s} L={L:5d}  {rows[-1]['time_s'] * 1e3:9.1f} ms  "
            f"temp {temp / 2**20:9.1f} MiB",
            flush=True,
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    p.add_argument("--impls", default="", help="default: xla,chunked (+cudnn on a GPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--name", default="attention")
    args = p.parse_args(argv)
    threads = _common.pin_threads(args.threads)
    import jax

    impls = args.impls.split(",") if args.impls else ["xla", "chunked"]
    if not args.impls and jax.default_backend() == "gpu" and args.dtype != "float32":
        impls.append("cudnn")
    print(f"{jax.default_backend()}, {threads} threads, load {_common.load_average():.2f}")
    rows = []
    for L in (int(x) for x in args.lengths.split(",")):
        for impl in impls:
            rows += measure(impl, L, args)
    by = {(r["impl"], r["mode"], r["length"]): r for r in rows}
    lengths = sorted({r["length"] for r in rows})
    for mode in ("forward", "forward+backward"):
        headers = ["L"]
        for impl in impls:
            headers += [f"{impl} ms", f"{impl} temp MiB"]
        if {"xla", "chunked"} <= set(impls):
            headers += ["chunked / xla memory"]
        table = []
        for L in lengths:
            row = [L]
            for impl in impls:
                r = by[(impl, mode, L)]
                row += [r["time_s"] * 1e3, r["temp_bytes"] / 2**20]
            if {"xla", "chunked"} <= set(impls):
                ratio = by[("chunked", mode, L)]["temp_bytes"] / by[("xla", mode, L)]["temp_bytes"]
                row.append(f"{ratio:.3f}")
            table.append(row)
        print(
            f"\n{mode}, [B, L, H, D] = [{args.batch}, L, {args.heads}, {args.head_dim}], "
            f"{args.dtype}, causal + padding, chunk {args.chunk_size}"
        )
        print(_common.table(headers, table))
    path = _common.write_json(
        args.name,
        {
            "threads": threads,
            "shape": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim},
            "chunk_size": args.chunk_size,
            "dtype": args.dtype,
            "reps": args.reps,
            "rows": rows,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
