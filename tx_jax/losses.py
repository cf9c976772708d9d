"""Token-weighted cross-entropy with label smoothing (paper section 5.4), and accuracy.

Shape letters: B batch, L length, V vocabulary. `weights` [B, L] are 1 on real target
tokens and 0 on padding; every function returns (sum, weight_sum) so that the mean over a
global batch is sum / weight_sum after summing over devices and micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def smoothed_cross_entropy(
    logits: Array, targets: Array, weights: Array, label_smoothing: float = 0.0
) -> tuple[Array, Array]:
    """Sum over tokens of CE(q, softmax(logits)), q = 1 - eps on the target and
    eps / (V - 1) elsewhere; minus q's entropy, so a perfect prediction has loss 0.

    logits [B, L, V] float32, targets [B, L] int, weights [B, L] -> (loss_sum, weight_sum).
    Never materialises the [B, L, V] one-hot: CE = -(c - u) log p_t - u sum_v log p_v.
    """
    V = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (V - 1) if V > 1 else 0.0
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp_target = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    loss = -(confidence - low) * logp_target
    if low > 0:
        loss = loss - low * logp.sum(-1)
    # the entropy of q, so that the minimum loss is 0 (as fairseq/flax report it)
    entropy = -confidence * np.log(confidence) if confidence > 0 else 0.0
    if low > 0:
        entropy -= (V - 1) * low * np.log(low)
    loss = (loss - entropy) * weights
    return loss.sum(), weights.sum()


def nll(logits: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
    """Unsmoothed negative log-likelihood (for perplexity): (nll_sum, weight_sum)."""
    return smoothed_cross_entropy(logits, targets, weights, 0.0)


def accuracy(logits: Array, targets: Array, weights: Array) -> tuple[Array, Array]:
    """(number of weighted positions where argmax == target, weight_sum)."""
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32) * weights
    return correct.sum(), weights.sum()
