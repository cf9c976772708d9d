"""Post-LN sublayers, x = LayerNorm(x + Dropout(x W)), compiled for a GPU on this CPU: how much
HBM traffic XLA:GPU gives flax's LayerNorm under autodiff against a hand-written custom VJP of
the residual add, hashed dropout and layer norm together (the "one pass per sublayer" lever of
issue 38, as far as jax alone can write it) and against model.residual_norm='pallas'
(tx_jax/ops/residual_norm.py: one Pallas kernel each way).

    python benchmarks/norm_plan.py [--target gpu:h100-1] [--layers 4] [--shape 104x256x512]

Each variant is the gradient of sum(out * w) through --layers such sublayers (bf16
activations, float32 statistics, the paper's dropout 0.1 with model.dropout_bits=hash), compiled
for the target's compile-only device (tx_jax.planning); traffic is counted as the planner counts
it (hlo.hbm_traffic) and by the compiler, in units of one [B, L, M] bf16 activation. The custom
VJP keeps z = x + dropout(y) in bf16 and the float32 row statistics, and recomputes the mask and
the normalised z in the backward pass; the Pallas kernels store nothing and recompute z from x
and y. The compiler's count includes the custom calls' operands and results (programs._cost).
-> benchmarks/results/norm_plan.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

EPS = 1e-6
RATE = 0.1
VARIANTS = ("flax", "custom_vjp", "pallas")


def _custom_sublayer():
    """z = x + dropout(y); LayerNorm(z) * g + b, with a VJP that stores z and its statistics."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from tx_jax.ops import kernels

    threshold = kernels._hash_threshold(RATE)
    scale = 1.0 / (1.0 - threshold / 2**32)

    def drop(v, words):
        keep = kernels._hash_keep(words, threshold, v.shape)
        return jnp.where(keep, v * jnp.asarray(scale, v.dtype), jnp.zeros((), v.dtype))

    def forward(x, y, g, b, words):
        z = x + drop(y, words)
        zf = z.astype(jnp.float32)
        mean = zf.mean(-1, keepdims=True)
        rstd = lax.rsqrt(jnp.square(zf - mean).mean(-1, keepdims=True) + EPS)
        return ((zf - mean) * rstd * g + b).astype(x.dtype), (z, mean, rstd, g, words)

    @jax.custom_vjp
    def sublayer(x, y, g, b, words):
        return forward(x, y, g, b, words)[0]

    def backward(res, dout):
        z, mean, rstd, g, words = res
        xhat = (z.astype(jnp.float32) - mean) * rstd
        d = dout.astype(jnp.float32)
        dxhat = d * g
        dz = rstd * (
            dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True)
        )
        rows = tuple(range(d.ndim - 1))
        dz = dz.astype(z.dtype)
        words_ = lax.optimization_barrier(words)  # not CSE'd with the forward's mask
        zero = np.zeros(words.shape, jax.dtypes.float0)
        return dz, drop(dz, words_), (d * xhat).sum(rows), d.sum(rows), zero

    sublayer.defvjp(forward, backward)
    return sublayer


def grad_fn(variant: str):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from tx_jax.ops import kernels, residual_norm

    custom = _custom_sublayer()

    def flax_sublayer(x, y, g, b, key):
        z = x + kernels.dropout(y, RATE, key, kernels="generic", bits="hash")
        ln = nn.LayerNorm(epsilon=EPS, dtype=jnp.bfloat16)
        return ln.apply({"params": {"scale": g, "bias": b}}, z)

    def loss(params, x, key, w):
        for i, (kernel, g, b) in enumerate(params):
            y = jnp.einsum("blm,mn->bln", x, kernel)
            k = jax.random.fold_in(key, i)
            if variant == "flax":
                x = flax_sublayer(x, y, g, b, k)
            elif variant == "pallas":
                x = residual_norm.post_norm(x, y, g, b, RATE, k, eps=EPS)
            else:
                x = custom(x, y, g, b, kernels._hash_words(k))
        return jnp.sum(x.astype(jnp.float32) * w)

    return jax.grad(loss, argnums=(0, 1))


def measure(target_spec: str, variant: str, layers: int, shape: tuple[int, int, int]) -> dict:
    import jax
    import jax.numpy as jnp

    from tx_jax.ops import backend
    from tx_jax.planning import hlo, programs, targets

    target = targets.parse(target_spec)
    sharding = jax.sharding.SingleDeviceSharding(target.devices()[0])
    B, L, M = shape

    def spec(s, dtype):
        return jax.ShapeDtypeStruct(s, dtype, sharding=sharding)

    params = [(spec((M, M), jnp.bfloat16), spec((M,), jnp.float32), spec((M,), jnp.float32))]
    args = (
        params * layers,
        spec((B, L, M), jnp.bfloat16),
        spec((), jax.random.key(0).dtype),
        spec((B, L, M), jnp.float32),
    )
    with programs._optimized(), backend.target(target.platform):
        compiled = jax.jit(grad_fn(variant)).lower(*args).compile()
    module = hlo.parse(compiled.as_text())
    planner = hlo.hbm_traffic(module)
    compiler = float(programs._cost(compiled).get("bytes accessed", 0.0))
    unit = B * L * M * 2  # one bf16 activation
    entry = module.computations[module.entry]
    return {
        "variant": variant,
        "planner_bytes": planner,
        "compiler_bytes": compiler,
        "planner_activations": planner / unit,
        "compiler_activations": compiler / unit,
        "kernels": sum(1 for i in entry if i.opcode in ("fusion", "custom-call")),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="gpu:h100-1")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shape", default="104x256x512", help="BxLxM")
    parser.add_argument("--name", default="norm_plan")
    parser.add_argument("--out", default=None, help="JSON path (default results/NAME.json)")
    args = parser.parse_args(argv)
    shape = tuple(int(n) for n in args.shape.split("x"))
    rows = [measure(args.target, v, args.layers, shape) for v in VARIANTS]
    print(
        _common.table(
            ["variant", "planner (activations)", "compiler (activations)", "kernels"],
            [
                [
                    r["variant"],
                    f"{r['planner_activations']:.2f}",
                    f"{r['compiler_activations']:.2f}",
                    r["kernels"],
                ]
                for r in rows
            ],
        )
    )
    payload = {"target": args.target, "layers": args.layers, "shape": shape, "rows": rows}
    payload["machine"] = _common.machine()
    print(_common.write_json(args.name, payload, args.out))


if __name__ == "__main__":
    main()
