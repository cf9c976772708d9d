"""The training loss: token-weighted cross-entropy with label smoothing (paper section 5.4),
NLL and accuracy, over full logits (`loss_impl='dense'`) or fused with the output layer over
blocks of target positions (`'blocked'`, a memory lever).

Shapes: B batch, L length, T positions per block, M d_model, V vocabulary. `weights` [B, L]
are 1 on target tokens, 0 on padding; every function returns sums and the weight sum, so the
mean over a global batch is their ratio after summing over devices and micro-batches.

    loss_sums(logits, targets, weights, label_smoothing)                       the dense path
    output_loss(h, table, bias, targets, weights, label_smoothing, block)      the blocked path
        both -> {'loss', 'nll', 'correct', 'weight'} float32 sums, the same up to rounding

The dense path writes float32 logits [B, L, V], the step's largest array. The blocked path
scans blocks of T positions along L (B whole, so a sharding of B is untouched), keeps only
per-token statistics of each block's logits and recomputes them in the backward pass. The
output weight is a table E [V, M] (the tied embedding's layout; an untied W [M, V] is passed
as W.T, which XLA folds into the products).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array


def _smoothing(V: int, label_smoothing: float) -> tuple[float, float, float]:
    """(c, u, H(q)): q is c = 1 - eps on the target and u = eps / (V - 1) elsewhere; its
    entropy H(q) is subtracted so that a perfect prediction has loss 0 (as fairseq/flax
    report it)."""
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (V - 1) if V > 1 else 0.0
    entropy = -confidence * np.log(confidence) if confidence > 0 else 0.0
    if low > 0:
        entropy -= (V - 1) * low * np.log(low)
    return confidence, low, entropy


# ------------------------------------------------------------------ dense: full logits


def smoothed_cross_entropy(
    logits: Array, targets: Array, weights: Array, label_smoothing: float = 0.0
) -> tuple[Array, Array]:
    """Sum over tokens of CE(q, softmax(logits)) - H(q) (`_smoothing`): logits [B, L, V],
    targets [B, L] int, weights [B, L] -> (loss_sum, weight_sum), with no [B, L, V] one-hot."""
    loss = token_cross_entropy(logits.astype(jnp.float32), targets, float(label_smoothing))
    loss = (loss - _smoothing(logits.shape[-1], float(label_smoothing))[2]) * weights
    return loss.sum(), weights.sum()


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_cross_entropy(logits: Array, targets: Array, label_smoothing: float) -> Array:
    """[B, L, V] float32 logits z, [B, L] targets t -> [B, L] CE(q, softmax(z)).

    With sum_v q_v = 1: CE = -sum_v q_v (z_v - lse(z)) = lse(z) - (c - u) z_t - u sum_v z_v,
    and dCE/dz = softmax(z) - q, computed in one elementwise pass (autodiff would turn the
    gather of z_t into a scatter over a [B, L, V] array of zeros).
    """
    return _token_ce_fwd(logits, targets, label_smoothing)[0]


def _token_ce_fwd(logits, targets, label_smoothing):
    confidence, low, _ = _smoothing(logits.shape[-1], label_smoothing)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    loss = lse - (confidence - low) * target_logit
    if low > 0:
        loss = loss - low * logits.sum(-1)
    return loss, (logits, targets, lse)


def _token_ce_bwd(label_smoothing, residuals, g):
    logits, targets, lse = residuals
    confidence, low, _ = _smoothing(logits.shape[-1], label_smoothing)
    q = jnp.where(jnp.arange(logits.shape[-1]) == targets[..., None], confidence, low)
    d_logits = (jnp.exp(logits - lse[..., None]) - q) * g[..., None]
    return d_logits, None


token_cross_entropy.defvjp(_token_ce_fwd, _token_ce_bwd)


def loss_sums(
    logits: Array, targets: Array, weights: Array, label_smoothing: float = 0.0
) -> dict[str, Array]:
    """The train step's sums over full logits: {'loss' (smoothed_cross_entropy's), 'nll'
    (nll's), 'correct' (accuracy's), 'weight'}, float32 scalars; gradients flow through 'loss'
    and 'nll'."""
    loss, weight = smoothed_cross_entropy(logits, targets, weights, label_smoothing)
    nll_sum, _ = nll(logits, targets, weights)
    correct, _ = accuracy(logits, targets, weights)
    return {"loss": loss, "nll": nll_sum, "correct": correct, "weight": weight}


def nll(logits: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
    """Unsmoothed negative log-likelihood (for perplexity): (nll_sum, weight_sum)."""
    return smoothed_cross_entropy(logits, targets, weights, 0.0)


def accuracy(logits: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
    """(weighted number of positions whose target has the largest logit, ties a hit;
    weight_sum). Comparing with the max, which logsumexp computes anyway, saves an argmax."""
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = (target_logit >= logits.max(-1)).astype(jnp.float32) * weights
    return correct.sum(), weights.sum()


# ------------------------------------------- blocked: the output layer fused with the loss


def _check_operands(fn: str, h, table, bias, targets, weights) -> None:
    """A ValueError naming `fn` and the operand whose shape does not fit h [B, L, M],
    table [V, M], bias [V] or None, targets and weights [B, L]."""
    if h.ndim != 3 or targets.shape != h.shape[:2] or weights.shape != targets.shape:
        raise ValueError(
            f"{fn}: h {h.shape}, targets {targets.shape}, weights {weights.shape}; "
            "expected [B, L, M], [B, L], [B, L]"
        )
    if table.ndim != 2 or table.shape[1] != h.shape[-1]:
        raise ValueError(f"{fn}: table {table.shape}; expected [V, {h.shape[-1]}]")
    if bias is not None and bias.shape != table.shape[:1]:
        raise ValueError(f"{fn}: bias {bias.shape}; expected [{table.shape[0]}]")


def output_loss(
    h: Array,
    table: Array,
    bias: Array | None,
    targets: Array,
    weights: Array,
    label_smoothing: float = 0.0,
    block: int = 64,
) -> dict[str, Array]:
    """loss_sums' four float32 sums without the [B, L, V] logits = float32(h E^T) + bias.

    h [B, L, M] (compute dtype), table E [V, M] (cast to h's dtype), bias [V] or None, targets
    [B, L] int, weights [B, L]. `block` (static): positions per block, min(block, L); L is
    padded with weight-0 positions to a multiple of it.
    """
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"model.loss_block={block!r}; expected a positive int")
    _check_operands("output_loss", h, table, bias, targets, weights)
    return _output_loss(h, table, bias, targets, weights, float(label_smoothing), int(block))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _output_loss(h, table, bias, targets, weights, label_smoothing, block):
    return _fwd(h, table, bias, targets, weights, label_smoothing, block)[0]


def _token_sums(lse, target, total, top, weights, V: int, label_smoothing: float):
    """Per-token statistics of the logits (logsumexp, the target's logit, the sum over V, the
    max) -> the four sums, and the per-token (loss, nll, hit) the backward passes reuse."""
    c, u, entropy = _smoothing(V, label_smoothing)
    ce = lse - (c - u) * target
    if u > 0:
        ce = ce - u * total
    tok_loss, tok_nll = ce - entropy, lse - target
    hit = (target >= top).astype(jnp.float32)
    sums = {
        "loss": (tok_loss * weights).sum(),
        "nll": (tok_nll * weights).sum(),
        "correct": (hit * weights).sum(),
        "weight": weights.sum(),
    }
    return sums, (tok_loss, tok_nll, hit)


def _blocks(x: Array, T: int) -> Array:
    """[B, Lp, ...] -> [Lp / T, B, T, ...]: the scan's leading axis, B kept whole."""
    B, Lp = x.shape[:2]
    return jnp.moveaxis(x.reshape(B, Lp // T, T, *x.shape[2:]), 1, 0)


def _unblocks(x: Array) -> Array:
    """[n, B, T, ...] -> [B, n T, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _pad(x: Array, Lp: int) -> Array:
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, Lp - x.shape[1])
    return jnp.pad(x, pad) if Lp != x.shape[1] else x


def _logits(hb: Array, table_c: Array, bias: Array | None) -> Array:
    """hb [B, T, M] @ E^T in the compute dtype (as the dense path's product), then float32
    [B, T, V] + bias."""
    z = jnp.einsum("btm,vm->btv", hb, table_c).astype(jnp.float32)
    return z if bias is None else z + bias.astype(jnp.float32)


def _max_target_sum(z: Array, targets: Array) -> tuple[Array, Array, Array]:
    """z [B, T, V], targets [B, T] -> max, target logit and sum over V, [B, T] each, in one
    variadic reduction: one read of the block's logits where three reductions read it three
    times (XLA does not fuse them). The target's logit is a one-hot sum: exact, no gather."""
    onehot = jnp.arange(z.shape[-1]) == targets[..., None]
    zero = jnp.zeros((), z.dtype)

    def combine(a, b):
        return lax.max(a[0], b[0]), a[1] + b[1], a[2] + b[2]

    return lax.reduce(
        (z, jnp.where(onehot, z, zero), z),
        (jnp.array(-jnp.inf, z.dtype), zero, zero),
        combine,
        (z.ndim - 1,),
    )


def _fwd(h, table, bias, targets, weights, label_smoothing, block):
    B, L, _ = h.shape
    V = table.shape[0]
    T = min(block, L)
    Lp = -(-L // T) * T
    hp, tp = _pad(h, Lp), _pad(targets, Lp)
    table_c = table.astype(h.dtype)

    def stats(_, xs):
        hb, tb = xs
        z = _logits(hb, table_c, bias)  # [B, T, V]
        top, target, total = _max_target_sum(z, tb)
        # jax.nn.logsumexp's arithmetic, reusing the max above (XLA would reduce z for it again)
        shift = lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
        lse = jnp.log(jnp.exp(z - shift[..., None]).sum(-1)) + shift
        return None, (lse, target, total, top)

    _, out = lax.scan(stats, None, (_blocks(hp, T), _blocks(tp, T)))
    lse, target, total, top = (_unblocks(x)[:, :L] for x in out)  # [B, L] each
    sums, (tok_loss, tok_nll, hit) = _token_sums(
        lse, target, total, top, weights, V, label_smoothing
    )
    residuals = (hp, table, bias, targets, weights, lse, tok_loss, tok_nll, hit)
    return sums, residuals


def _bwd(label_smoothing, block, residuals, g):
    hp, table, bias, targets, weights, lse, tok_loss, tok_nll, hit = residuals
    B, L = targets.shape
    V = table.shape[0]
    c, u, _ = _smoothing(V, label_smoothing)
    T = min(block, L)
    Lp = hp.shape[1]
    g_loss, g_nll = g["loss"], g["nll"]
    table_c = table.astype(hp.dtype)
    # d loss / d z = (softmax - q) w and d nll / d z = (softmax - onehot) w, per token
    w_p = _pad(weights.astype(jnp.float32), Lp)
    xs = (_blocks(hp, T), _blocks(_pad(targets, Lp), T), _blocks(w_p, T), _blocks(_pad(lse, Lp), T))

    def step(carry, xs):
        d_table, d_bias = carry
        hb, tb, wb, lb = xs
        z = _logits(hb, table_c, bias)
        onehot = jnp.arange(V) == tb[..., None]
        p = jnp.exp(z - lb[..., None])
        q = jnp.where(onehot, c, u)
        w = wb[..., None]
        dz = p * ((g_loss + g_nll) * w) - (q * g_loss + jnp.where(onehot, g_nll, 0.0)) * w
        # the dense path's cotangent meets its product in the compute dtype
        dz_c = dz.astype(hp.dtype)
        dh = jnp.einsum("btv,vm->btm", dz_c, table_c)
        d_table = d_table + jnp.einsum("btv,btm->vm", dz_c, hb, preferred_element_type=jnp.float32)
        if d_bias is not None:
            d_bias = d_bias + dz.sum((0, 1))
        return (d_table, d_bias), dh

    init = (
        jnp.zeros(table.shape, jnp.float32),
        None if bias is None else jnp.zeros(bias.shape, jnp.float32),
    )
    (d_table, d_bias), dh = lax.scan(step, init, xs)
    dh = _unblocks(dh)[:, :L].astype(hp.dtype)
    d_weights = g_loss * tok_loss + g_nll * tok_nll + g["correct"] * hit + g["weight"]
    return (
        dh,
        d_table.astype(table.dtype),
        None if bias is None else d_bias.astype(bias.dtype),
        None,
        d_weights.astype(weights.dtype),
    )


_output_loss.defvjp(_fwd, _bwd)
