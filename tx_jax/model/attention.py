"""Scaled dot-product attention (paper section 3.2.1), the pure function; multihead.py wraps it
in learned projections (3.2.2).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V        (eq. 1)

Shape letters used in this module (einsum subscripts use the lower-case letters):
    B batch          L query length      S key/value length
    H query heads    K key/value heads   G = H // K query heads per K/V head (grouped query)
    Dk query/key head dim (the paper's d_k)  Dv value head dim (d_v; default Dk)
(einsum subscripts write both head dims as d: no einsum has a Dk and a Dv operand at once).

Masks (ops/masks.py) are boolean and broadcastable to [B, H, L, S]; True means "may attend".
Two structured masks are also accepted and built only where an implementation needs them, so
that blockwise kernels never materialise an L x S array:
    is_causal:       query i attends to keys j <= i (positions counted from 0 on both sides)
    segment ids:     q_segment_ids [B, L], kv_segment_ids [B, S], int; 0 marks padding.
                     A query attends to a key of the same non-zero segment (packing, padding).
A query row that may attend to nothing returns zeros, never NaN.

This module computes 'xla', eq. 1 as written: the reference. Every other implementation is a
kernel in ops/attention_kernels.py, named by a concrete `implementation` (ModelConfig.resolved
picks it per platform when a run is built), so the model reads the same on every backend.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from tx_jax.ops import attention_kernels
from tx_jax.ops.flash import to_kg
from tx_jax.ops.kernels import dropout
from tx_jax.ops.masks import dense_mask

Array = jax.Array
_NEG = -1e30  # finite "minus infinity": exp(_NEG - m) == 0 without inf - inf = NaN.


# ---------------------------------------------------------------- the pure function


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    is_causal: bool = False,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    implementation: str = "xla",
    return_weights: bool = False,
    chunk_size: int = 512,
    precision: Any = None,
    dropout_bits: str = "bernoulli",
) -> Array | tuple[Array, Array]:
    """softmax(q k^T / sqrt(Dk) + bias) v over [B, L, H, Dk] queries, [B, S, K, Dk] keys and
    [B, S, K, Dv] values.

    Args:
      query: [B, L, H, Dk]. key: [B, S, K, Dk]; value: [B, S, K, Dv] with H % K == 0 (K < H is
        grouped-query attention, K == 1 multi-query). Dv may differ from Dk (the paper's d_v
        and d_k) except for the cuDNN implementations.
      mask: bool, broadcastable to [B, H, L, S]; True = may attend.
      bias: float, broadcastable to [B, H, L, S], added to the scaled scores ('xla', cuDNN).
      is_causal, q_segment_ids, kv_segment_ids: structured masks (module docstring).
      dropout_rate, dropout_rng, deterministic: dropout on the attention weights.
      implementation: one of ops.attention_kernels.IMPLEMENTATIONS ('xla', 'chunked' with
        blocks of `chunk_size`, 'cudnn', 'splash'): what each computes and what it refuses
        is in that module's docstring.
      return_weights: also return the [B, H, L, S] weights ('xla' only).
      dropout_bits: where the weights' dropout bits come from (ModelConfig.dropout_bits).
    Returns:
      [B, L, H, Dv] in value's dtype, and the float32 weights if return_weights.
    """
    _check_shapes(query, key, value)
    dropping = dropout_rate > 0.0 and not deterministic
    if dropping and dropout_rng is None:
        raise ValueError("dropout_rate > 0 with deterministic=False needs a dropout_rng")
    impl = implementation
    if impl not in attention_kernels.IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={impl!r}; expected one of {attention_kernels.IMPLEMENTATIONS} "
            "('auto' is resolved when a run is built: ModelConfig.resolved)"
        )
    if return_weights and impl != "xla":
        raise ValueError(f"return_weights=True needs implementation='xla', not {impl!r}")
    drop = (dropout_rate, dropout_rng, dropout_bits) if dropping else None
    structure = {
        "is_causal": is_causal,
        "q_segment_ids": q_segment_ids,
        "kv_segment_ids": kv_segment_ids,
    }
    if impl != "xla":
        return attention_kernels.attend(
            impl,
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            drop=drop,
            chunk_size=chunk_size,
            precision=precision,
            **structure,
        )
    full = dense_mask(query.shape[1], key.shape[1], mask=mask, **structure)
    out, weights = _attention_xla(query, key, value, full, bias, drop, precision)
    return (out, weights) if return_weights else out


def beam_cache_attention(
    query: Array,
    key_cache: Array,
    value_cache: Array,
    origin: Array,
    index: Array,
    *,
    precision: Any = None,
) -> Array:
    """One decoding step of self-attention over a KV cache that beam search never reorders.

    Beam search moves hypotheses between beam slots every step; instead of copying every
    slot's cache to follow them, each hypothesis keeps `origin`, the slot that wrote each of
    its positions, and attends over all N slots of its example, masked to its own history:
    one read of the cache per step instead of a gather (read + write) and a read.

    Args:
      query: [B * N, 1, H, Dk]; row b * N + n is hypothesis n of example b.
      key_cache: [B, N, K, T, Dk], value_cache: [B, N, K, Dv, T]: what slot n of example b
        wrote at each position, 0 .. index included.
      origin: [B, N, T] int32: origin[b, n, t] is the slot holding position t of hypothesis n.
      index: the position being decoded.
    Returns:
      [B * N, 1, H, Dv] in value's dtype: softmax over the hypothesis' own positions 0 ..
      index, as `dot_product_attention` with a causal mask over a reordered cache gives it.
    """
    BN, L, H, D = query.shape
    B, N, T = origin.shape
    K, Dv = key_cache.shape[2], value_cache.shape[3]
    G = H // K
    if L != 1 or BN != B * N:
        raise ValueError(f"query {query.shape}: one position of {B} x {N} hypotheses expected")
    q = query.reshape(B, N, K, G, D) * jnp.asarray(1.0 / math.sqrt(D), query.dtype)
    # Every slot m of the example sees every hypothesis' query: batch dims (b, m, k) are the
    # caches' leading axes, so the products read them where the step wrote them (another
    # layout costs XLA:CPU a copy of the cache per step).
    q = jnp.broadcast_to(jnp.transpose(q, (0, 2, 1, 3, 4))[:, None], (B, N, K, N, G, D))
    q = q.reshape(B, N, K, N * G, D)
    logits = jnp.einsum("bmkqd,bmktd->bmkqt", q, key_cache, precision=precision)
    logits = logits.astype(jnp.float32).reshape(B, N, K, N, G, T)
    slots = jnp.arange(N, dtype=origin.dtype)
    # valid[b, m, n, t]: slot m wrote position t <= index of hypothesis n
    valid = (origin[:, None] == slots[None, :, None, None]) & (jnp.arange(T) <= index)
    valid = valid[:, :, None, :, None, :]  # [B, M, 1, N, 1, T]
    logits = jnp.where(valid, logits, _NEG)
    top = jnp.max(logits, axis=(1, 5), keepdims=True)
    e = jnp.where(valid, jnp.exp(logits - top), 0.0)
    weights = (e / jnp.sum(e, axis=(1, 5), keepdims=True)).reshape(B, N, K, N * G, T)
    out = jnp.einsum(
        "bmkqt,bmkvt->bmkqv", weights.astype(value_cache.dtype), value_cache, precision=precision
    ).sum(axis=1)  # [B, K, N * G, Dv]
    out = jnp.transpose(out.reshape(B, K, N, G, Dv), (0, 2, 1, 3, 4))
    return out.reshape(BN, 1, H, Dv)


def _check_shapes(query: Array, key: Array, value: Array) -> None:
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            "query/key/value must be [batch, length, heads, head_dim]; got shapes "
            f"{query.shape}, {key.shape}, {value.shape}"
        )
    if key.shape[:3] != value.shape[:3]:  # the head dims may differ: d_k vs d_v
        raise ValueError(
            f"key {key.shape} and value {value.shape}: batch, length or kv heads differ"
        )
    if query.shape[0] != key.shape[0] or query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query {query.shape} and key {key.shape}: batch or head_dim differ")
    if query.shape[2] % key.shape[2]:
        raise ValueError(f"query heads {query.shape[2]} not divisible by kv heads {key.shape[2]}")


def _split_heads(query: Array, num_kv_heads: int) -> Array:
    """[B, L, H, Dk] -> [B, L, K, G, Dk], query head h = k * G + g."""
    B, L, H, D = query.shape
    return query.reshape(B, L, num_kv_heads, H // num_kv_heads, D)


def _attention_xla(query, key, value, mask, bias, drop, precision):
    B, L, H, D = query.shape
    K = key.shape[2]
    # Eq. 1's 1/sqrt(d_k), applied to q rather than to the [L, S] scores: fewer multiplies.
    q = _split_heads(query, K) * jnp.asarray(1.0 / math.sqrt(D), query.dtype)
    # Scores in float32 whatever the compute dtype: softmax is where bf16 loses accuracy.
    logits = jnp.einsum("blkgd,bskd->bkgls", q, key, precision=precision)
    logits = logits.astype(jnp.float32)
    if bias is not None:
        logits = logits + to_kg(bias, K).astype(jnp.float32)
    mask = to_kg(mask, K)
    if mask is not None:
        logits = jnp.where(mask, logits, _NEG)
    weights = jax.nn.softmax(logits, axis=-1)
    if mask is not None:  # a fully masked row gives zeros, not a uniform average
        weights = jnp.where(mask, weights, 0.0)
    used = weights
    if drop is not None:
        used = dropout(weights, *drop)
    out = jnp.einsum("bkgls,bskd->blkgd", used.astype(value.dtype), value, precision=precision)
    return out.reshape(B, L, H, value.shape[-1]), weights.reshape(B, H, L, -1)
