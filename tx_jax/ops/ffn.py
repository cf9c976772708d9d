"""The paper's feed-forward block, max(0, x W1 + b1) W2 + b2, with its elementwise passes inside
Pallas matmuls (`model.ffn_impl='pallas'`).

XLA:GPU writes x W1, then adds b1 in a pass of its own (the ReLU going into the next product),
and in the backward pass writes dy W2^T, then masks it by the ReLU and sums it for b1's gradient
in another pass: two passes over the [N, F] hidden activations a layer (0.55 GB for base, 12
layers: 6.5 GB of its H100 plan). Here:

    forward   h = max(0, x W1 + b1) from one kernel (bias and ReLU applied to the float32
              accumulator before the one write); y = h W2 + b2 as XLA's product
    backward  dh = (dy W2^T) * (h > 0) from one kernel, which also writes its tile's float32
              column sums (b1's gradient); dW2 = h^T dy, dW1 = x^T dh, dx = dh W1^T as XLA's
              products

The ReLU's mask is read off h (h > 0 where x W1 + b1 > 0), so nothing beyond h is kept. Tiles of
128 x 128 over the output, 64 along the contraction; Triton on GPU. On a CPU or TPU the model
computes the XLA path instead (`resolve`), unless backend.pallas_interpreter() asks for the
kernels in Pallas' interpreter (correct, slow: tests/test_ffn.py). Same outputs and gradients as
the XLA path to float32 rounding; in bf16 the bias is added to the float32 product before it is
rounded, where XLA rounds the product first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tx_jax.ops import backend

Array = jax.Array
FFN_IMPLS = ("auto", "xla", "pallas")
BM, BN, BK = 128, 128, 64


def resolve(choice: str) -> str:
    """'auto' | 'xla' | 'pallas' -> 'xla' | 'pallas' ('auto': 'xla' until a GPU has timed it;
    'pallas' where backend.pallas_kernels(), else 'xla', the same function)."""
    if choice not in FFN_IMPLS:
        raise ValueError(f"model.ffn_impl={choice!r}; expected one of {FFN_IMPLS}")
    return "pallas" if choice == "pallas" and backend.pallas_kernels() else "xla"


def _matmul_kernel(a_ref, b_ref, c_ref, out_ref, *rest, trans_b, epilogue):
    """out = epilogue(a @ b) for one [BM, BN] tile. epilogue 'bias_relu': + c (a [N] bias)
    then max(0, .); 'mask': where(c > 0, ., 0) with c the tile of h, and the tile's column
    sums to rest[0]."""
    j = pl.program_id(1)
    depth = a_ref.shape[1]

    def step(k, acc):
        a = a_ref[:, pl.ds(k * BK, BK)]
        if trans_b:
            b = b_ref[pl.ds(j * BN, BN), pl.ds(k * BK, BK)]
        else:
            b = b_ref[pl.ds(k * BK, BK), pl.ds(j * BN, BN)]
        return acc + pl.dot(a, b, trans_b=trans_b)

    acc = lax.fori_loop(0, depth // BK, step, jnp.zeros((BM, BN), jnp.float32))
    if epilogue == "bias_relu":
        acc = jnp.maximum(acc + c_ref[pl.ds(j * BN, BN)].astype(jnp.float32)[None, :], 0.0)
    else:
        acc = jnp.where(c_ref[...] > 0, acc, 0.0)
        rest[0][...] = jnp.sum(acc, axis=0, keepdims=True)
    out_ref[...] = acc.astype(out_ref.dtype)


def _matmul(a, b, c, *, trans_b, epilogue, interpret):
    """[N, K] @ [K, F] (or [F, K]^T) with the epilogue; N a multiple of BM."""
    n, depth = a.shape
    features = b.shape[0] if trans_b else b.shape[1]
    grid = (n // BM, features // BN)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    tile = pl.BlockSpec((BM, BN), lambda i, j: (i, j))
    in_specs = [pl.BlockSpec((BM, depth), lambda i, j: (i, 0)), whole(b.shape)]
    outs = [jax.ShapeDtypeStruct((n, features), a.dtype)]
    out_specs = [tile]
    if epilogue == "bias_relu":
        in_specs.append(whole(c.shape))
    else:
        in_specs.append(tile)
        outs.append(jax.ShapeDtypeStruct((n // BM, features), jnp.float32))
        out_specs.append(pl.BlockSpec((1, BN), lambda i, j: (i, j)))
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=8, num_stages=3)
    return pl.pallas_call(
        functools.partial(_matmul_kernel, trans_b=trans_b, epilogue=epilogue),
        out_shape=outs,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=params,
        interpret=interpret,
        name=f"ffn_{epilogue}",
    )(a, b, c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ffn(x, w1, b1, w2, b2, interpret):
    return _ffn_fwd(x, w1, b1, w2, b2, interpret)[0]


def _ffn_fwd(x, w1, b1, w2, b2, interpret):
    (h,) = _matmul(x, w1, b1, trans_b=False, epilogue="bias_relu", interpret=interpret)
    y = jnp.einsum("nf,fm->nm", h, w2) + b2.astype(x.dtype)
    return y, (x, w1, w2, h)


def _ffn_bwd(interpret, residuals, dy):
    x, w1, w2, h = residuals
    dh, db1 = _matmul(dy, w2, h, trans_b=True, epilogue="mask", interpret=interpret)
    dw2 = jnp.einsum("nf,nm->fm", h, dy)
    db2 = dy.astype(jnp.float32).sum(0)
    dw1 = jnp.einsum("nm,nf->mf", x, dh)
    dx = jnp.einsum("nf,mf->nm", dh, w1)
    return dx, dw1, db1.sum(0), dw2, db2


_ffn.defvjp(_ffn_fwd, _ffn_bwd)


def relu_ffn(
    x: Array, w1: Array, b1: Array, w2: Array, b2: Array, *, interpret: bool | None = None
) -> Array:
    """max(0, x W1 + b1) W2 + b2: x [..., M] in the compute dtype, w1 [M, F], w2 [F, M] (cast
    to x's dtype), b1 [F], b2 [M]; M a multiple of 64, F of 128. Rows are padded to 128.
    interpret: Pallas' interpreter (default: unless compiling for a GPU; a ValueError for a
    TPU)."""
    width, features = w1.shape
    if x.shape[-1] != width or w2.shape != (features, width):
        raise ValueError(f"relu_ffn: x {x.shape}, w1 {w1.shape}, w2 {w2.shape} do not chain")
    if b1.shape != (features,) or b2.shape != (width,):
        raise ValueError(
            f"relu_ffn: b1 {b1.shape}, b2 {b2.shape}; expected ({features},), ({width},)"
        )
    if width % BK or features % BN:
        raise ValueError(
            f"model.ffn_impl='pallas' needs d_model a multiple of {BK} and d_ff of {BN}; "
            f"{width}, {features}"
        )
    interpret = backend.pallas_interpret(interpret, "model.ffn_impl='pallas'", "'xla'")
    dtype = x.dtype
    w1, w2 = w1.astype(dtype), w2.astype(dtype)

    def local(x, w1, b1, w2, b2):
        shape = x.shape
        n = int(np.prod(shape[:-1]))
        n_pad = -(-n // BM) * BM
        xf = jnp.pad(x.reshape(n, width), ((0, n_pad - n), (0, 0)))
        y = _ffn(xf, w1, b1.astype(jnp.float32), w2, b2.astype(jnp.float32), bool(interpret))
        return y[:n].reshape(shape)

    split = backend.batch_split(x.ndim)
    if split is None:
        return local(x, w1, b1, w2, b2)
    mesh, spec, _ = split
    rep = jax.sharding.PartitionSpec()
    return backend.shard_map_kernels(local, mesh, (spec, rep, rep, rep, rep), spec)(
        x, w1, b1, w2, b2
    )
