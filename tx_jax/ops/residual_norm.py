"""The post-LN sub-layer's tail, LayerNorm(x + Dropout(y)) * g + b, in one kernel each way
(`ModelConfig.residual_norm`).

    'xla'     flax's LayerNorm after `kernels.dropout` and the residual add, differentiated by
              autodiff: XLA fuses it as it can (the reference every other choice is tested
              against).
    'pallas'  one Pallas kernel for the forward pass (reads x and y, writes the output) and one
              for the backward pass (reads the output's gradient, x and y; writes dx, dy and
              each block's partial dg, db), with the dropout mask hashed inside both from the
              key's two words exactly as `kernels.dropout(..., bits='hash')` hashes it: the
              row statistics, z = x + dropout(y) and the mask are recomputed, never stored.
              Triton on GPU. On a CPU or TPU the model computes 'xla' instead (the same
              function and masks: the config asks for dropout_bits='hash' with it), unless
              `backend.pallas_interpreter()` asks for the kernels in Pallas' interpreter
              (correct and slow: the CPU tests run them so). Rows are whole blocks of the
              model width, so the width must be a power of two (Triton's blocks are).
    'auto'    'xla' (until a GPU has timed 'pallas': BENCHMARKS.md, "Implementation
              choices").

The arithmetic follows the reference's dtypes: dropout's scale and the residual add in the
activations' dtype, the statistics and normalisation in float32, the output cast back; the
variance is the two-pass one (flax's LayerNorm uses E[z^2] - E[z]^2), so outputs and gradients
agree to float32 rounding (tests/test_residual_norm.py).

Under a multi-device jit whose logical rules (flax's, as the trainer sets them) split the
activations' batch axis alone, the kernels run in a shard_map on each device's rows, each
shard hashing its mask from its own first row's place in the whole, so the masks do not depend
on the mesh (tests/test_residual_norm.py, 8 CPU devices). Any other layout leaves the custom
call to XLA, which gathers its operands onto every device (correct, slow).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tx_jax.ops import backend, kernels

Array = jax.Array
RESIDUAL_NORMS = ("auto", "xla", "pallas")


def resolve(choice: str) -> str:
    """'auto' | 'xla' | 'pallas' -> 'xla' | 'pallas' ('pallas' where backend.pallas_kernels():
    a GPU, or the interpreter asked for; else 'xla', the same function)."""
    if choice not in RESIDUAL_NORMS:
        raise ValueError(f"model.residual_norm={choice!r}; expected one of {RESIDUAL_NORMS}")
    return "pallas" if choice == "pallas" and backend.pallas_kernels() else "xla"


def _block_rows(rows: int, width: int) -> int:
    """Rows a program takes: a power of two dividing `rows`, at most 8K elements a block (the
    Triton kernel keeps the block's float32 copy in registers)."""
    block = 1
    while block * 2 * width <= 8192 and rows % (block * 2) == 0:
        block *= 2
    return block


def _keep(words_ref, row0: Array, block_rows: int, width: int, threshold: int) -> Array:
    """The block's dropout mask: kernels._hash_keep's bits for elements row0*width + ...,
    row0 counted from this shard's first row, words[2] (the shard's offset in the whole)."""
    first = row0.astype(jnp.uint32) + words_ref[2]
    rows = lax.broadcasted_iota(jnp.uint32, (block_rows, width), 0) + first
    cols = lax.broadcasted_iota(jnp.uint32, (block_rows, width), 1)
    index = rows * np.uint32(width) + cols
    bits = kernels._mix32(kernels._mix32(index ^ words_ref[0]) + words_ref[1])
    return bits >= np.uint32(threshold)


def _residual(x_ref, y_ref, words_ref, threshold, scale, block_rows, width):
    """z = x + dropout(y) in the activations' dtype, and the mask (None without dropout)."""
    x, y = x_ref[...], y_ref[...]
    if threshold == 0:
        return x + y, None
    row0 = pl.program_id(0) * block_rows
    keep = _keep(words_ref, row0, block_rows, width, threshold)
    dropped = jnp.where(keep, y * jnp.asarray(scale, y.dtype), jnp.zeros((), y.dtype))
    return x + dropped, keep


def _stats(z: Array, eps: float):
    zf = z.astype(jnp.float32)
    mean = jnp.mean(zf, axis=-1, keepdims=True)
    centred = zf - mean
    rstd = lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return centred * rstd, rstd


def _forward_kernel(x_ref, y_ref, g_ref, b_ref, words_ref, out_ref, *, threshold, scale, eps):
    block_rows, width = x_ref.shape
    z, _ = _residual(x_ref, y_ref, words_ref, threshold, scale, block_rows, width)
    xhat, _ = _stats(z, eps)
    g = g_ref[...].astype(jnp.float32)[None, :]
    b = b_ref[...].astype(jnp.float32)[None, :]
    out_ref[...] = (xhat * g + b).astype(out_ref.dtype)


def _backward_kernel(
    dout_ref,
    x_ref,
    y_ref,
    g_ref,
    words_ref,
    dx_ref,
    dy_ref,
    dg_ref,
    db_ref,
    *,
    threshold,
    scale,
    eps,
):
    block_rows, width = x_ref.shape
    z, keep = _residual(x_ref, y_ref, words_ref, threshold, scale, block_rows, width)
    xhat, rstd = _stats(z, eps)
    d = dout_ref[...].astype(jnp.float32)
    dxhat = d * g_ref[...].astype(jnp.float32)[None, :]
    dz = rstd * (
        dxhat
        - jnp.mean(dxhat, axis=-1, keepdims=True)
        - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True)
    )
    dz = dz.astype(dx_ref.dtype)  # the cotangent of z, in z's dtype as autodiff has it
    dx_ref[...] = dz
    if keep is None:
        dy_ref[...] = dz
    else:
        zero = jnp.zeros((), dz.dtype)
        dy_ref[...] = jnp.where(keep, dz * jnp.asarray(scale, dz.dtype), zero)
    dg_ref[...] = jnp.sum(d * xhat, axis=0, keepdims=True)
    db_ref[...] = jnp.sum(d, axis=0, keepdims=True)


def _call(kernel, inputs, outputs, rows, width, block_rows, interpret, name):
    def row_spec(shape):
        if len(shape) == 1:  # g, b and the key's words: whole
            return pl.BlockSpec(shape, lambda i: (0,))
        return pl.BlockSpec((block_rows, width), lambda i: (i, 0))

    in_specs = [row_spec(a.shape) for a in inputs]
    out_specs = [
        pl.BlockSpec((1, width), lambda i: (i, 0))
        if o.shape[0] != rows
        else pl.BlockSpec((block_rows, width), lambda i: (i, 0))
        for o in outputs
    ]
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    return pl.pallas_call(
        kernel,
        out_shape=outputs,
        grid=(rows // block_rows,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=params,
        interpret=interpret,
        name=name,
    )(*inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused(x, y, g, b, words, threshold, scale, eps, interpret):
    return _fused_fwd(x, y, g, b, words, threshold, scale, eps, interpret)[0]


def _fused_fwd(x, y, g, b, words, threshold, scale, eps, interpret):
    rows, width = x.shape
    block_rows = _block_rows(rows, width)
    kernel = functools.partial(_forward_kernel, threshold=threshold, scale=scale, eps=eps)
    (out,) = _call(
        kernel,
        (x, y, g, b, words),
        [jax.ShapeDtypeStruct(x.shape, x.dtype)],
        rows,
        width,
        block_rows,
        interpret,
        "residual_norm_fwd",
    )
    return out, (x, y, g, b, words)


def _fused_bwd(threshold, scale, eps, interpret, residuals, dout):
    x, y, g, b, words = residuals
    rows, width = x.shape
    block_rows = _block_rows(rows, width)
    blocks = rows // block_rows
    kernel = functools.partial(_backward_kernel, threshold=threshold, scale=scale, eps=eps)
    dx, dy, dg, db = _call(
        kernel,
        (dout, x, y, g, words),
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(y.shape, y.dtype),
            jax.ShapeDtypeStruct((blocks, width), jnp.float32),
            jax.ShapeDtypeStruct((blocks, width), jnp.float32),
        ],
        rows,
        width,
        block_rows,
        interpret,
        "residual_norm_bwd",
    )
    dg = dg.sum(0).astype(g.dtype)
    db = db.sum(0).astype(b.dtype)
    return dx, dy, dg, db, np.zeros(words.shape, jax.dtypes.float0)


_fused.defvjp(_fused_fwd, _fused_bwd)


def post_norm(
    x: Array,
    y: Array,
    scale: Array,
    bias: Array,
    rate: float,
    rng: Array | None,
    *,
    eps: float,
    interpret: bool | None = None,
) -> Array:
    """LayerNorm(x + Dropout(y)) * scale + bias over the last axis, as one Pallas kernel each
    way. x, y [..., M] of one dtype; scale, bias [M]; rng the dropout key (None or rate 0: no
    dropout). The mask is `kernels.dropout(y, rate, rng, bits='hash')`'s. interpret: run Pallas'
    interpreter (default: unless compiling for a GPU; a ValueError for a TPU)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ValueError(
            f"residual_norm: x {x.shape} {x.dtype} and y {y.shape} {y.dtype} must match"
        )
    width = x.shape[-1]
    if width & (width - 1):
        raise ValueError(
            f"model.residual_norm='pallas' needs a power-of-two model width (Triton's blocks); "
            f"d_model={width}: use residual_norm='xla'"
        )
    if scale.shape != (width,) or bias.shape != (width,):
        raise ValueError(
            f"residual_norm: scale {scale.shape} and bias {bias.shape} must be ({width},)"
        )
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate} must be in [0, 1)")
    interpret = backend.pallas_interpret(interpret, "model.residual_norm='pallas'", "'xla'")
    threshold = kernels._hash_threshold(rate) if (rate > 0.0 and rng is not None) else 0
    rows = int(np.prod(x.shape[:-1]))
    if rows * width >= 2**32:
        raise ValueError(f"residual_norm numbers elements in 32 bits; {x.shape} has more")
    if threshold:
        words = kernels._hash_words(rng)
        scale_drop = 1.0 / (1.0 - threshold / 2**32)
    else:
        words, scale_drop = jnp.zeros((2,), jnp.uint32), 1.0

    def local(x, y, scale, bias, words, offset):
        # words: the key's two, this shard's first row in the whole, and a pad (Triton's
        # blocks are powers of two)
        words = jnp.concatenate([words, jnp.stack([offset, jnp.zeros((), jnp.uint32)])])
        shape = x.shape
        rows = int(np.prod(shape[:-1]))
        args = (x.reshape(rows, width), y.reshape(rows, width), scale, bias, words)
        out = _fused(*args, threshold, scale_drop, float(eps), bool(interpret))
        return out.reshape(shape)

    split = backend.batch_split(x.ndim)
    if split is None:
        return local(x, y, scale, bias, words, jnp.zeros((), jnp.uint32))
    mesh, spec, axes = split
    rows_per_shard = x.size // width // int(np.prod([mesh.shape[a] for a in axes]))

    def sharded(x, y, scale, bias, words):
        offset = lax.axis_index(axes).astype(jnp.uint32) * np.uint32(rows_per_shard)
        return local(x, y, scale, bias, words, offset)

    rep = jax.sharding.PartitionSpec()
    return backend.shard_map_kernels(sharded, mesh, (spec, spec, rep, rep, rep), spec)(
        x, y, scale, bias, words
    )
