"""Token-weighted cross-entropy with label smoothing (paper section 5.4), and accuracy.

Shape letters: B batch, L length, V vocabulary. `weights` [B, L] are 1 on real target
tokens and 0 on padding; every function returns (sum, weight_sum) so that the mean over a
global batch is sum / weight_sum after summing over devices and micro-batches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array


def smoothed_cross_entropy(
    logits: Array, targets: Array, weights: Array, label_smoothing: float = 0.0
) -> tuple[Array, Array]:
    """Sum over tokens of CE(q, softmax(logits)), q = 1 - eps on the target and
    eps / (V - 1) elsewhere; minus q's entropy, so a perfect prediction has loss 0.

    logits [B, L, V] float32, targets [B, L] int, weights [B, L] -> (loss_sum, weight_sum).
    Never materialises the [B, L, V] one-hot (see `token_cross_entropy`).
    """
    loss = token_cross_entropy(logits.astype(jnp.float32), targets, float(label_smoothing))
    loss = (loss - _entropy(logits.shape[-1], float(label_smoothing))) * weights
    return loss.sum(), weights.sum()


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_cross_entropy(logits: Array, targets: Array, label_smoothing: float) -> Array:
    """[B, L, V] float32 logits z, [B, L] targets t -> [B, L] CE(q, softmax(z)).

    With sum_v q_v = 1: CE = -sum_v q_v (z_v - lse(z)) = lse(z) - (c - u) z_t - u sum_v z_v
    (c = 1 - eps, u = eps / (V - 1)), and dCE/dz = softmax(z) - q. The custom VJP computes
    that gradient in one elementwise pass over [B, L, V]; autodiff would differentiate the
    gather of z_t into a scatter over a [B, L, V] array of zeros (benchmarks/HISTORY.md,
    'Optimisations').
    """
    return _token_ce_fwd(logits, targets, label_smoothing)[0]


def _smoothing(V: int, label_smoothing: float) -> tuple[float, float]:
    low = label_smoothing / (V - 1) if V > 1 else 0.0
    return 1.0 - label_smoothing, low


def _entropy(V: int, label_smoothing: float) -> float:
    """The entropy of q, subtracted so that the minimum loss is 0 (as fairseq/flax report it)."""
    confidence, low = _smoothing(V, label_smoothing)
    entropy = -confidence * np.log(confidence) if confidence > 0 else 0.0
    if low > 0:
        entropy -= (V - 1) * low * np.log(low)
    return entropy


def _token_ce_fwd(logits, targets, label_smoothing):
    confidence, low = _smoothing(logits.shape[-1], label_smoothing)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    loss = lse - (confidence - low) * target_logit
    if low > 0:
        loss = loss - low * logits.sum(-1)
    return loss, (logits, targets, lse)


def _token_ce_bwd(label_smoothing, residuals, g):
    logits, targets, lse = residuals
    confidence, low = _smoothing(logits.shape[-1], label_smoothing)
    q = jnp.where(jnp.arange(logits.shape[-1]) == targets[..., None], confidence, low)
    d_logits = (jnp.exp(logits - lse[..., None]) - q) * g[..., None]
    return d_logits, None


token_cross_entropy.defvjp(_token_ce_fwd, _token_ce_bwd)


def loss_sums(
    logits: Array,
    targets: Array,
    weights: Array,
    label_smoothing: float = 0.0,
    one_pass: bool = False,
) -> dict[str, Array]:
    """The train step's sums: {'loss' (smoothed_cross_entropy's), 'nll' (nll's), 'correct'
    (accuracy's), 'weight'}, float32 scalars; gradients flow through 'loss' and 'nll'.

    The three functions above read [B, L, V] four times between them (max, sum of exp, sum,
    the target's logit: XLA fuses none into another). With `one_pass`, one variadic reduction
    computes all four with an online logsumexp (Milakov & Gimelshein, 2018): a quarter of the
    logits' reads on a GPU or TPU, but several times slower on XLA:CPU, which does not
    vectorise a variadic reduction (ops/output_loss.resolve picks per platform).
    """
    if not one_pass:
        loss, weight = smoothed_cross_entropy(logits, targets, weights, label_smoothing)
        nll_sum, _ = nll(logits, targets, weights)
        correct, _ = accuracy(logits, targets, weights)
        return {"loss": loss, "nll": nll_sum, "correct": correct, "weight": weight}
    entropy = _entropy(logits.shape[-1], float(label_smoothing))
    ce, tok_nll, hit = token_statistics(logits.astype(jnp.float32), targets, float(label_smoothing))
    w = weights.astype(jnp.float32)
    return {
        "loss": ((ce - entropy) * w).sum(),
        "nll": (tok_nll * w).sum(),
        "correct": (hit * w).sum(),
        "weight": w.sum(),
    }


def _online_stats(logits: Array, targets: Array) -> tuple[Array, Array, Array, Array]:
    """[B, L, V], [B, L] -> max, logsumexp, target logit, sum over V ([B, L] each): one
    reduction whose elements are (max m, sum of exp(z - m) s, target part, z)."""
    z = logits
    onehot = jnp.arange(z.shape[-1]) == targets[..., None]
    zero = jnp.zeros((), z.dtype)

    def combine(a, b):
        # (max, sum of exp(z - max)) pairs merge with one exp: the smaller max's sum rescaled
        a_high = a[0] >= b[0]
        m = jnp.where(a_high, a[0], b[0])
        low_m = jnp.where(a_high, b[0], a[0])
        high_s, low_s = jnp.where(a_high, a[1], b[1]), jnp.where(a_high, b[1], a[1])
        # equal maxima (both -inf included, where exp(-inf - -inf) is nan) add as they are
        scale = jnp.where(low_m == m, jnp.ones((), z.dtype), jnp.exp(low_m - m))
        return m, high_s + low_s * scale, a[2] + b[2], a[3] + b[3]

    top, total_exp, target, total = lax.reduce(
        (z, jnp.ones_like(z), jnp.where(onehot, z, zero), z),
        (jnp.array(-jnp.inf, z.dtype), zero, zero, zero),
        combine,
        (z.ndim - 1,),
    )
    return top, jnp.log(total_exp) + top, target, total


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_statistics(logits: Array, targets: Array, label_smoothing: float):
    """[B, L, V] float32 logits, [B, L] targets -> per token (CE(q, softmax(z)) as in
    token_cross_entropy, its unsmoothed NLL, 1.0 where the target's logit is the largest).
    The backward pass is one elementwise pass over [B, L, V]: softmax(z) - q per cotangent."""
    return _token_statistics_fwd(logits, targets, label_smoothing)[0]


def _token_statistics_fwd(logits, targets, label_smoothing):
    confidence, low = _smoothing(logits.shape[-1], label_smoothing)
    top, lse, target, total = _online_stats(logits, targets)
    ce = lse - (confidence - low) * target
    if low > 0:
        ce = ce - low * total
    hit = (target >= top).astype(jnp.float32)
    return (ce, lse - target, hit), (logits, targets, lse)


def _token_statistics_bwd(label_smoothing, residuals, g):
    logits, targets, lse = residuals
    g_ce, g_nll = g[0][..., None], g[1][..., None]
    confidence, low = _smoothing(logits.shape[-1], label_smoothing)
    onehot = jnp.arange(logits.shape[-1]) == targets[..., None]
    p = jnp.exp(logits - lse[..., None])
    # d ce / dz = p - q, d nll / dz = p - onehot
    q_term = jnp.where(onehot, confidence * g_ce + g_nll, low * g_ce)
    return p * (g_ce + g_nll) - q_term, None


token_statistics.defvjp(_token_statistics_fwd, _token_statistics_bwd)


def nll(logits: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
    """Unsmoothed negative log-likelihood (for perplexity): (nll_sum, weight_sum)."""
    return smoothed_cross_entropy(logits, targets, weights, 0.0)


def accuracy(logits: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
    """(weighted number of positions whose target has the largest logit, weight_sum).

    A position counts when its target's logit is the largest (a tie with another token
    counts as a hit, where argmax would pick the lower index). Comparing with the max, which
    the cross-entropy's logsumexp computes anyway, saves a variadic argmax reduction over the
    [B, L, V] logits (BENCHMARKS.md).
    """
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = (target_logit >= logits.max(-1)).astype(jnp.float32) * weights
    return correct.sum(), weights.sum()
