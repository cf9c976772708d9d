"""The output layer and its loss with the logits never written to memory: Pallas kernels
recompute them tile by tile (`model.loss_impl='fused'`).

Shape letters: N tokens (B L), M d_model, V vocabulary; TN, TV, TK the kernels' tiles.

'blocked' (output_loss.py) scans over blocks of positions in XLA, which still writes each
block's logits to memory and reads them back: in the H100 plan it moves as much as the dense
path. Here each kernel computes a [TN, TV] tile of logits in registers from h and the table,
uses it and drops it, as fused linear cross-entropy kernels do (Liger's, MaxText's vocabulary
tiling without the loop in XLA):

    forward   grid over row tiles; a loop over the vocabulary keeps per row the running max,
              sum of exp, sum of logits and the target's logit -> lse, total, target, top [N]

and in the backward pass:

    dz        grid over (row tile, vocabulary tile); each program recomputes its logit tile and
              writes the loss's gradient there, dz [N, V] in h's dtype (as the dense path
              rounds it), and dz's float32 column sums for the bias
    dh, dE    XLA's products dz E and dz^T h, as in the dense path

A kernel accumulating dh or dE itself would hold a [64, M] or [128, M] float32 block across its
loop, more than a GPU's registers and shared memory take at M = 512-1024 (Triton asks 328 KB of
shared memory for base's): so dz is written once, where the dense path writes the logits, reads
them twice and writes dz. The forward pass writes no [N, V] array; the backward one, dz; the
logits are computed twice (one more product of the output layer's size). The arithmetic is
output_loss.py's: the logits rounded to h's dtype, then float32 plus the bias, dz in float32
and rounded to h's dtype for the products. Triton on GPU; on a CPU or TPU the training step
takes the platform's 'auto' loss instead (output_loss.resolve), unless
backend.pallas_interpreter() asks for the kernels in Pallas' interpreter (correct, slow: the
CPU tests). Same sums and gradients as the dense path to float32 rounding
(tests/test_fused_loss.py). On a mesh splitting the batch (backend.batch_split) each device
runs the kernels on its own tokens in a shard_map and the sums are added across it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tx_jax.ops import backend
from tx_jax.ops.output_loss import _smoothing, check_operands, token_sums

Array = jax.Array
TN, TV, TK = 64, 128, 64  # rows, vocabulary entries and model dims a tile takes


def _params(interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _logit_tile(h_ref, e_ref, b_ref, rows, j, vocab):
    """The [TN, TV] logits of row tile `rows` (a ref slice) and vocabulary tile j, float32,
    -inf past the vocabulary; and the tile's column ids."""
    width = e_ref.shape[1]

    def product(k, z):  # a loop, not unrolled: Triton pipelines one chunk's loads at a time
        hk = h_ref[rows, pl.ds(k * TK, TK)]
        ek = e_ref[pl.ds(j * TV, TV), pl.ds(k * TK, TK)]
        return z + pl.dot(hk, ek, trans_b=True)

    z = lax.fori_loop(0, width // TK, product, jnp.zeros((TN, TV), jnp.float32))
    cols = j * TV + lax.broadcasted_iota(jnp.int32, (TN, TV), 1)
    z = z.astype(h_ref.dtype).astype(jnp.float32) + b_ref[pl.ds(j * TV, TV)][None, :]
    return jnp.where(cols < vocab, z, -jnp.inf), cols


def _forward_kernel(h_ref, e_ref, b_ref, t_ref, lse_ref, total_ref, target_ref, top_ref, *, vocab):
    t = t_ref[...]
    rows = pl.ds(0, TN)

    def body(j, carry):
        top, sumexp, total, target = carry
        z, cols = _logit_tile(h_ref, e_ref, b_ref, rows, j, vocab)
        new_top = jnp.maximum(top, jnp.max(z, axis=1))
        sumexp = sumexp * jnp.exp(top - new_top) + jnp.sum(jnp.exp(z - new_top[:, None]), axis=1)
        valid = cols < vocab
        total = total + jnp.sum(jnp.where(valid, z, 0.0), axis=1)
        target = target + jnp.sum(jnp.where(cols == t[:, None], z, 0.0), axis=1)
        return new_top, sumexp, total, target

    zero = jnp.zeros((TN,), jnp.float32)
    init = (jnp.full((TN,), -jnp.inf, jnp.float32), zero, zero, zero)
    top, sumexp, total, target = lax.fori_loop(0, e_ref.shape[0] // TV, body, init)
    lse_ref[...] = top + jnp.log(sumexp)
    total_ref[...] = total
    target_ref[...] = target
    top_ref[...] = top


def _dz(z, cols, t, lse, w, g_ref, vocab, c, u):
    """d(g_loss loss + g_nll nll)/dz for one tile: (softmax - q) g_loss w + (softmax - onehot)
    g_nll w, zero past the vocabulary."""
    g_loss, g_nll = g_ref[0], g_ref[1]
    onehot = cols == t[:, None]
    p = jnp.exp(z - lse[:, None])
    q = jnp.where(onehot, c, jnp.where(cols < vocab, u, 0.0))
    wc = w[:, None]
    return p * ((g_loss + g_nll) * wc) - (q * g_loss + jnp.where(onehot, g_nll, 0.0)) * wc


def _dz_kernel(h_ref, e_ref, b_ref, t_ref, w_ref, lse_ref, g_ref, dz_ref, db_ref, *, vocab, c, u):
    j = pl.program_id(1)
    z, cols = _logit_tile(h_ref, e_ref, b_ref, pl.ds(0, TN), j, vocab)
    dz = _dz(z, cols, t_ref[...], lse_ref[...], w_ref[...], g_ref, vocab, c, u)
    dz_ref[...] = dz.astype(dz_ref.dtype)  # rounded as the dense path's cotangent is
    db_ref[...] = jnp.sum(dz, axis=0, keepdims=True)  # the bias's, from the float32 dz


def _row_spec(width=None):
    if width is None:
        return pl.BlockSpec((TN,), lambda i: (i,))
    return pl.BlockSpec((TN, width), lambda i: (i, 0))


def _whole(shape):
    return pl.BlockSpec(shape, lambda i: (0,) * len(shape))


def _stats(h, e, b, t, vocab, interpret):
    n, width = h.shape
    out = jax.ShapeDtypeStruct((n,), jnp.float32)
    return pl.pallas_call(
        functools.partial(_forward_kernel, vocab=vocab),
        out_shape=[out] * 4,
        grid=(n // TN,),
        in_specs=[_row_spec(width), _whole(e.shape), _whole(b.shape), _row_spec()],
        out_specs=[_row_spec()] * 4,
        compiler_params=_params(interpret),
        interpret=interpret,
        name="fused_loss_fwd",
    )(h, e, b, t)


def _grads(h, e, b, t, w, lse, g, vocab, label_smoothing, interpret):
    """dz [N, Vp] in h's dtype from one kernel (the logits recomputed tile by tile), then
    dh = dz E and dE = dz^T h as XLA's products; db from the kernel's float32 column sums."""
    n, width = h.shape
    v_pad = e.shape[0]
    c, u, _ = _smoothing(vocab, label_smoothing)
    rows = pl.BlockSpec((TN,), lambda i, j: (i,))
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    dz, db = pl.pallas_call(
        functools.partial(_dz_kernel, vocab=vocab, c=c, u=u),
        out_shape=[
            jax.ShapeDtypeStruct((n, v_pad), h.dtype),
            jax.ShapeDtypeStruct((n // TN, v_pad), jnp.float32),
        ],
        grid=(n // TN, v_pad // TV),
        in_specs=[
            pl.BlockSpec((TN, width), lambda i, j: (i, 0)),
            whole(e.shape),
            whole(b.shape),
            rows,
            rows,
            rows,
            whole(g.shape),
        ],
        out_specs=[
            pl.BlockSpec((TN, TV), lambda i, j: (i, j)),
            pl.BlockSpec((1, TV), lambda i, j: (i, j)),
        ],
        compiler_params=_params(interpret),
        interpret=interpret,
        name="fused_loss_dz",
    )(h, e, b, t, w, lse, g)
    dh = jnp.einsum("nv,vm->nm", dz, e)
    de = jnp.einsum("nv,nm->vm", dz, h)
    return dh, de, db.sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused(h, e, b, t, w, vocab, label_smoothing, has_bias, interpret):
    return _fused_fwd(h, e, b, t, w, vocab, label_smoothing, has_bias, interpret)[0]


def _fused_fwd(h, e, b, t, w, vocab, label_smoothing, has_bias, interpret):
    lse, total, target, top = _stats(h, e, b, t, vocab, interpret)
    sums, (tok_loss, tok_nll, hit) = token_sums(lse, target, total, top, w, vocab, label_smoothing)
    return sums, (h, e, b, t, w, lse, tok_loss, tok_nll, hit)


def _fused_bwd(vocab, label_smoothing, has_bias, interpret, residuals, g):
    h, e, b, t, w, lse, tok_loss, tok_nll, hit = residuals
    gs = jnp.stack([g["loss"], g["nll"]]).astype(jnp.float32)
    dh, de, db = _grads(h, e, b, t, w, lse, gs, vocab, label_smoothing, interpret)
    dw = g["loss"] * tok_loss + g["nll"] * tok_nll + g["correct"] * hit + g["weight"]
    db = db if has_bias else jnp.zeros_like(b)
    zero_t = np.zeros(t.shape, jax.dtypes.float0)
    return dh, de.astype(e.dtype), db.astype(b.dtype), zero_t, dw.astype(w.dtype)


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_output_loss(
    h: Array,
    table: Array,
    bias: Array | None,
    targets: Array,
    weights: Array,
    label_smoothing: float = 0.0,
    *,
    interpret: bool | None = None,
) -> dict[str, Array]:
    """output_loss.output_loss's sums ('loss', 'nll', 'correct', 'weight') without the
    [B, L, V] logits in memory: h [B, L, M], table E [V, M], bias [V] or None, targets and
    weights [B, L]. M must be a multiple of 64; N and V are padded to the tiles (rows of
    weight 0, vocabulary entries masked out). interpret: Pallas' interpreter (default: unless
    compiling for a GPU; a ValueError for a TPU, where the interpreter would be the step)."""
    check_operands("fused_output_loss", h, table, bias, targets, weights)
    width = h.shape[-1]
    if width % TK:
        raise ValueError(
            f"model.loss_impl='fused' needs d_model a multiple of {TK}; {width}: use 'auto'"
        )
    interpret = backend.pallas_interpret(interpret, "model.loss_impl='fused'", "'auto'")
    vocab = table.shape[0]

    def local(h, table, bias, targets, weights):
        n = h.shape[0] * h.shape[1]
        n_pad, v_pad = -(-n // TN) * TN, -(-vocab // TV) * TV
        hf = jnp.pad(h.reshape(n, width), ((0, n_pad - n), (0, 0)))
        tf = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, n_pad - n))
        wf = jnp.pad(weights.reshape(n).astype(jnp.float32), (0, n_pad - n))
        e = jnp.pad(table.astype(h.dtype), ((0, v_pad - vocab), (0, 0)))
        b = jnp.zeros((v_pad,), jnp.float32) if bias is None else bias.astype(jnp.float32)
        b = jnp.pad(b, (0, v_pad - b.shape[0]))
        has_bias = bias is not None
        return _fused(hf, e, b, tf, wf, vocab, float(label_smoothing), has_bias, bool(interpret))

    split = backend.batch_split(h.ndim)
    if split is None:
        return local(h, table, bias, targets, weights)
    # a mesh splitting the batch: each device's tokens in its own kernels, the sums added
    mesh, spec, axes = split
    rows, rep = jax.sharding.PartitionSpec(spec[0], None), jax.sharding.PartitionSpec()

    def sharded(h, table, bias, targets, weights):
        sums = local(h, table, bias, targets, weights)
        return {k: lax.psum(v, axes) for k, v in sums.items()}

    in_specs = (spec, rep, None if bias is None else rep, rows, rows)
    return backend.shard_map_kernels(sharded, mesh, in_specs, rep)(h, table, bias, targets, weights)
