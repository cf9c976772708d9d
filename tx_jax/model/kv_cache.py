"""The decoding caches of one attention layer: what MultiHeadAttention keeps between decoding
steps (flax's decode=True pattern: variables in the 'cache' collection, created by the call
that makes the cache), and none of attention's math.

Shape letters (attention.py's): B batch (examples), N hypotheses per example (beam search),
T decode positions, S source length, K key/value heads, Dk/Dv head dims.

    self_cache(mha, key, value)              one row per hypothesis: keys [B, K, T, Dk], values
                                             [B, K, Dv, T] (heads-major, the operand layouts of
                                             attention's two products, so that the views cancel
                                             against the products' own transposes: XLA:CPU
                                             otherwise copies the whole cache every step)
    beam_self_attention(mha, query, ...)     the beam-shared cache (inference/cache.share_beams):
                                             keys and values stay in the slot that wrote them,
                                             'beam_origin' [B, N, T] says which slot wrote what
    cross_cache(mha, inputs_kv, to_key, to_value)
                                             the encoder output's keys and values, projected once
                                             when the cache is created, read on every step
    grouped_cross_attention(query, ...)      beam search's cross-attention: an example's N
                                             hypotheses attend as one row of N * L queries over
                                             the source keys they share, read once

`mha` is the MultiHeadAttention module whose variables these are (they live in its scope).
Which cache a layer keeps is explicit in its attributes (`decode`, `beams`), never probed.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from tx_jax.model.attention import beam_cache_attention, dot_product_attention
from tx_jax.model.positional import apply_rope

Array = jax.Array


def self_cache(mha: nn.Module, key: Array, value: Array) -> tuple[Array, Array, Array | None]:
    """Write the new [B, T, K, Dk] keys / [B, T, K, Dv] values at the cache index -> the
    whole cache as [B, T_max, K, D] views and the index they were written at. The call that
    creates the cache (its input's length fixes T_max) returns its inputs and None: it
    attends as in training."""
    created = not mha.has_variable("cache", "cached_key")
    B, T, K, Dk = key.shape
    Dv = value.shape[-1]
    cached_key = mha.variable("cache", "cached_key", jnp.zeros, (B, K, T, Dk), key.dtype)
    cached_value = mha.variable("cache", "cached_value", jnp.zeros, (B, K, Dv, T), value.dtype)
    index = mha.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if created:
        return key, value, None
    i = index.value
    if mha.rope_base is not None:
        pos = i + jnp.arange(T)[None, :]
        key = apply_rope(key, jnp.broadcast_to(pos, key.shape[:2]), mha.rope_base)
    new_key = jnp.transpose(key, (0, 2, 1, 3))  # [B, K, T, Dk]
    new_value = jnp.transpose(value, (0, 2, 3, 1))  # [B, K, Dv, T]
    cached_key.value = lax.dynamic_update_slice(cached_key.value, new_key, (0, 0, i, 0))
    cached_value.value = lax.dynamic_update_slice(cached_value.value, new_value, (0, 0, 0, i))
    index.value = i + T
    return key_view(cached_key.value), value_view(cached_value.value), i


def beam_self_attention(
    mha: nn.Module, query: Array, key: Array, value: Array, q_positions: Array | None
) -> Array:
    """One step of beam search's self-attention over the beam-shared cache: query [B * N, 1,
    H, Dk], key/value [B * N, 1, K, D] -> [B * N, 1, H, Dv]. The search reorders only the
    origin table; this writes the step's keys and values in their own slot and attends over
    each hypothesis' history (attention.beam_cache_attention)."""
    cached_key = mha.variable("cache", "cached_key", None)
    cached_value = mha.variable("cache", "cached_value", None)
    origin = mha.variable("cache", "beam_origin", None)
    index = mha.variable("cache", "cache_index", None)
    B, N, K = cached_key.value.shape[:3]
    i = index.value
    if mha.rope_base is not None:
        if q_positions is None:
            q_positions = jnp.broadcast_to(i + jnp.arange(query.shape[1])[None], query.shape[:2])
        query = apply_rope(query, q_positions, mha.rope_base)
        key = apply_rope(key, q_positions, mha.rope_base)
    slots = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[None, :, None], (B, N, 1))
    origin.value = lax.dynamic_update_slice(origin.value, slots, (0, 0, i))
    new_key = key.reshape(B, N, K, 1, key.shape[-1])
    new_value = value.reshape(B, N, K, value.shape[-1], 1)
    cached_key.value = lax.dynamic_update_slice(cached_key.value, new_key, (0, 0, 0, i, 0))
    cached_value.value = lax.dynamic_update_slice(cached_value.value, new_value, (0, 0, 0, 0, i))
    index.value = i + 1
    return beam_cache_attention(
        query, cached_key.value, cached_value.value, origin.value, i, precision=mha.precision
    )


def cross_cache(
    mha: nn.Module,
    inputs_kv: Array,
    to_key: Callable[[Array], Array],
    to_value: Callable[[Array], Array],
) -> tuple[Array, Array]:
    """The encoder output [B, S, M]'s keys [B, S, K, Dk] and values [B, S, K, Dv]: projected
    by the call that creates the cache, which must run with the parameters decoding uses
    (`apply(..., mutable=['cache'])`, as inference/decoding.py does), then read: a decoding
    loop carries them unchanged (no per-step copy). Stored heads-major, keys [B, K, S, Dk] and
    values [B, K, Dv, S], as the self-attention cache."""
    if mha.has_variable("cache", "cross_key"):
        key = mha.variable("cache", "cross_key", None).value
        value = mha.variable("cache", "cross_value", None).value
        return key_view(key), value_view(value)
    if mha.is_initializing():
        raise ValueError(
            "a decoding cache holds the encoder output projected with the parameters decoding "
            "uses: create it with model.apply(variables, ..., mutable=['cache']), not init"
        )
    key = jnp.transpose(to_key(inputs_kv), (0, 2, 1, 3))
    value = jnp.transpose(to_value(inputs_kv), (0, 2, 3, 1))
    mha.variable("cache", "cross_key", lambda: key)
    mha.variable("cache", "cross_value", lambda: value)
    return key_view(key), value_view(value)


def grouped_cross_attention(
    query: Array,
    key: Array,
    value: Array,
    q_segment_ids: Array | None,
    kv_segment_ids: Array | None,
    beams: int,
    **attend,
) -> Array:
    """query [B * N, L, H, Dk] of N hypotheses per example over the [B, S] sources they share
    (inference/cache.share_beams keeps one cross cache row per example) -> [B * N, L, H, Dv]:
    each example's hypotheses attend as N * L queries of one row. `attend`:
    dot_product_attention's other arguments."""
    BN, L, H, D = query.shape
    B = BN // beams
    if q_segment_ids is not None:
        q_segment_ids = q_segment_ids.reshape(B, beams * L)
    if kv_segment_ids is not None:
        kv_segment_ids = kv_segment_ids[::beams]
    out = dot_product_attention(
        query.reshape(B, beams * L, H, D),
        key,
        value,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        **attend,
    )
    return out.reshape(BN, L, H, -1)


def key_view(cache: Array) -> Array:
    """A heads-major key cache [B, K, T, Dk] as attention's [B, T, K, Dk]."""
    return jnp.transpose(cache, (0, 2, 1, 3))


def value_view(cache: Array) -> Array:
    """A heads-major value cache [B, K, Dv, T] as attention's [B, T, K, Dv]."""
    return jnp.transpose(cache, (0, 3, 1, 2))
