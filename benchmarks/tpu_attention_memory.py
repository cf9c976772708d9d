"""Attention implementations compiled for a TPU v5e chip from this CPU host: temporary memory.

    python benchmarks/tpu_attention_memory.py [--lengths 8192,32768] [--impls xla,chunked,splash]

Compile only (no TPU needed; libtpu's compiler runs here), nothing is timed. For each
implementation of tx_jax.model.attention.dot_product_attention, forward and backward of one
call (the gradient of sum(out * cotangent) with respect to q, k and v): causal
self-attention with segment ids (the last 1/8 padding), [B, L, H, D] = [1, L, 8, 64], bfloat16,
jitted for one v5e chip of a "v5e:2x2" topology. The figure is XLA's own for the compiled
executable: compiled.memory_analysis().temp_size_in_bytes (buffers other than arguments and
outputs). A compilation that fails (e.g. the program does not fit the chip's HBM) is recorded
with its error.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tx_jax.planning.targets import prepare_tpu_compiler  # noqa: E402

prepare_tpu_compiler()  # before libtpu initialises: no probing for a TPU that is not here
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def compile_temp(impl: str, L: int, args, device) -> dict:
    """Compile forward+backward for `device`; -> temp bytes, or the error."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tx_jax.model import attention

    def grad(q, k, v, cot, seg):
        def loss(q, k, v):
            out = attention.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                q_segment_ids=seg,
                kv_segment_ids=seg,
                implementation=impl,
                chunk_size=args.chunk_size,
            )
            return jnp.sum(out.astype(jnp.float32) * cot)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    B, H, D = args.batch, args.heads, args.head_dim
    x = jax.ShapeDtypeStruct((B, L, H, D), jnp.bfloat16)
    shapes = (x, x, x, jax.ShapeDtypeStruct((B, L, H, D), jnp.float32))
    shapes += (jax.ShapeDtypeStruct((B, L), jnp.int32),)
    mesh = jax.sharding.Mesh(np.array([device]), ("data",))
    rep = jax.sharding.NamedSharding(mesh, jax.P())
    row = {"impl": impl, "length": L}
    try:
        jitted = jax.jit(grad, in_shardings=(rep,) * 5, out_shardings=(rep,) * 3)
        compiled = jitted.lower(*shapes).compile()
    except Exception as e:  # noqa: BLE001 - the failure is the result to report
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(f"  {impl:8s} L={L:6d}  failed: {row['error']}", flush=True)
        return row
    mem = compiled.memory_analysis()
    row["temp_bytes"] = int(mem.temp_size_in_bytes)
    row["argument_bytes"] = int(mem.argument_size_in_bytes)
    row["output_bytes"] = int(mem.output_size_in_bytes)
    row["pallas_custom_calls"] = compiled.as_text().count("tpu_custom_call")
    print(f"  {impl:8s} L={L:6d}  temp {row['temp_bytes'] / 2**20:10.1f} MiB", flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--impls", default="xla,chunked,splash")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--topology", default="v5e:2x2")
    p.add_argument("--name", default="tpu_attention_memory")
    args = p.parse_args(argv)
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology_name=args.topology, platform="tpu").devices[0]
    print(f"compiling for {device.device_kind} ({args.topology}, one chip)")
    impls = args.impls.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = [compile_temp(impl, L, args, device) for L in lengths for impl in impls]
    by = {(r["impl"], r["length"]): r for r in rows}

    def cell(r: dict) -> str:
        if "error" in r:
            need = re.search(
                r"required for HLO temporaries \((\S+)\) exceeds available HBM \((\S+)\)",
                r["error"],
            )
            return f"does not fit: needs {need[1]} of {need[2]} HBM" if need else "does not compile"
        return f"{r['temp_bytes'] / 2**20:,.1f}"

    print(
        f"\nforward+backward temp MiB, [B, L, H, D] = [{args.batch}, L, {args.heads}, "
        f"{args.head_dim}] bf16, causal + segment ids, {device.device_kind}"
    )
    table = [[L] + [cell(by[(impl, L)]) for impl in impls] for L in lengths]
    print(_common.table(["L = S"] + impls, table))
    path = _common.write_json(
        args.name,
        {
            "target": {"topology": args.topology, "device_kind": device.device_kind},
            "shape": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim},
            "dtype": "bfloat16",
            "chunk_size": args.chunk_size,
            "rows": rows,
        },
    )
    print(f"wrote {_common.portable_path(path)}")


if __name__ == "__main__":
    main()
