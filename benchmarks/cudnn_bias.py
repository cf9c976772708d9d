"""cuDNN attention given its mask as [B, 1, L, S] (one per row, broadcast over heads) against
[B, H, L, S] (what model/attention.py passes today): same outputs and gradients? how fast?

    python benchmarks/cudnn_bias.py --out OUT.json                     # on a GPU host
    python benchmarks/cudnn_bias.py --dbias-probe    # does this jax skip a boolean mask's dbias?
    JAX_PLATFORMS=cpu python benchmarks/cudnn_bias.py --shape 2,16,2,8 --out /tmp/b.json  # XLA's

The paper's base step reads its dense mask bias in each of 36 cuDNN calls (forward and
backward of 18 attentions), [104, 8, 256, 256] bf16 each time: ~3.9 GB a step
(benchmarks/HISTORY.md, "The logits read once"). A bias broadcast over heads would be an
eighth of that, if cuDNN takes it. Packed rows (4 segments each, as gpu_step.py's batch),
self-attention with the causal mask and without; jit(value_and_grad) of sum(out * g) in q, k,
v; medians of --reps synchronised calls. The compiled HLO's custom-call operands are
recorded, to show the bias cuDNN receives.

--dbias-probe prints one line: whether the installed jax's cuDNN backward writes the gradient
of the bias a boolean mask becomes (jax 0.10 asks for it whatever the bias; jax's change "Skip
cudnn attention dbias computation for constant boolean masks", merged 2026-07-30, asks only for
a differentiable one). Where it does not, model.attention_impl='cudnn_nodbias' (jax's private
call, for that one gradient) has nothing left to save. It lowers for 'cuda': a GPU host, or a
CPU host with jax's CUDA plugin.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

# A cuDNN call in compiled HLO: its target and its operands' layouts.
_CUDNN_CALL = r'custom_call_target="(__cudnn[^"]+)", operand_layout_constraints=(\{[^=]*\})'


def _masks(B: int, L: int, causal: bool):
    """[B, 1, L, L] bool: 4 packed segments a row (the last one padding-free), causal or not."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    seg = np.zeros((B, L), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, L), 3, replace=False))
        seg[b] = np.searchsorted(cuts, np.arange(L), side="right") + 1
    mask = seg[:, :, None] == seg[:, None, :]
    if causal:
        mask &= np.tril(np.ones((L, L), bool))[None]
    return jnp.asarray(mask[:, None])


def dbias_probe() -> str:
    """One line: does jax.nn.dot_product_attention's cuDNN backward, lowered for 'cuda' with a
    boolean mask, write a bias gradient (a result of the bias's shape beside dq, dk, dv)?"""
    import jax
    import jax.numpy as jnp

    B, L, H, D = 1, 128, 2, 64  # L != D: no other operand has the bias's type
    qkv = jax.ShapeDtypeStruct((B, L, H, D), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((B, H, L, L), jnp.bool_)

    def loss(q, k, v, mask):
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
        return out.astype(jnp.float32).sum()

    try:
        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(qkv, qkv, qkv, mask)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001 - no CUDA in this jaxlib: say so, one line
        return f"jax {jax.__version__}: cannot lower cuDNN attention here ({type(e).__name__})"
    (bwd,) = [c for c in text.splitlines() if "__cudnn$fmha" in c and "Backward(" in c]
    writes = f"tensor<{B}x{H}x{L}x{L}xbf16>" in bwd.rsplit("->", 1)[1]
    verdict = (
        "yes ('cudnn_nodbias' would skip it)"
        if writes
        else "no (jax gates it on a differentiable bias: 'cudnn_nodbias' is unnecessary)"
    )
    return (
        f"jax {jax.__version__}: cuDNN's backward writes a boolean mask's bias gradient: {verdict}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="104,256,8,64", help="B,L,H,D")
    parser.add_argument("--impl", choices=["cudnn", "xla"], help="default: cudnn on a GPU")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out")
    parser.add_argument("--dbias-probe", action="store_true", help="only print dbias_probe()")
    args = parser.parse_args(argv)
    if args.dbias_probe:
        print(dbias_probe(), flush=True)
        return
    if not args.out:
        parser.error("--out is required")

    import jax
    import jax.numpy as jnp
    import numpy as np

    if args.impl is None:
        args.impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    B, L, H, D = (int(x) for x in args.shape.split(","))
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(kk, (B, L, H, D), dtype) for kk in keys)

    def attend(mask, q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=args.impl)
        return (out.astype(jnp.float32) * g.astype(jnp.float32)).sum(), out

    grad = jax.jit(jax.value_and_grad(attend, argnums=(1, 2, 3), has_aux=True))
    rows, cases = [], []
    for causal in (False, True):
        head1 = _masks(B, L, causal)
        full = jnp.broadcast_to(head1, (B, H, L, L))
        results, times, hlo = {}, {}, {}
        for name, mask in (("B,H,L,S", full), ("B,1,L,S", head1)):
            compiled = grad.lower(mask, q, k, v).compile()
            # each cuDNN call's operands, the mask's bias last or next to last
            hlo[name] = sorted(set(re.findall(_CUDNN_CALL, compiled.as_text())))
            results[name] = jax.block_until_ready(compiled(mask, q, k, v))
            times[name] = [
                _common.time_once(functools.partial(compiled, mask, q, k, v), jax.block_until_ready)
                for _ in range(args.reps)
            ]
        (_, out_full), grads_full = results["B,H,L,S"]
        (_, out_head1), grads_head1 = results["B,1,L,S"]
        diff = max(
            float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
            for a, b in zip((out_full, *grads_full), (out_head1, *grads_head1), strict=True)
        )
        ms = {name: 1e3 * _common.median(t) for name, t in times.items()}
        rows.append(("causal" if causal else "bidirectional", ms["B,H,L,S"], ms["B,1,L,S"], diff))
        cases.append(
            {"causal": causal, "seconds": times, "max_abs_diff": diff, "custom_calls": hlo}
        )
        print(f"{'causal' if causal else 'bidirectional'}: kernels {hlo}", flush=True)
        if not np.isfinite(diff):
            raise SystemExit("non-finite difference between the two mask forms")
    print(
        _common.table(
            ["self-attention", "[B,H,L,S] mask ms", "[B,1,L,S] mask ms", "max |diff| out+grads"],
            rows,
        )
    )
    print(f"{args.impl}, shape B,L,H,D = {B},{L},{H},{D}, bf16, {jax.devices()[0].device_kind}")
    _common.write_json(
        "cudnn_bias", {"impl": args.impl, "shape": [B, L, H, D], "cases": cases}, args.out
    )


if __name__ == "__main__":
    main()
