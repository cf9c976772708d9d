"""Attention masks: boolean, broadcastable to [B, H, L, S], True meaning "may attend".

Shape letters: B batch, H heads, L query length, S key/value length. Segment ids are int
[B, L] / [B, S] with 0 marking padding (model/attention.py describes how they combine).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array


def padding_mask(query_valid: Array, key_valid: Array) -> Array:
    """[B, L] bool, [B, S] bool -> [B, 1, L, S]: both positions are real tokens."""
    return query_valid[:, None, :, None] & key_valid[:, None, None, :]


def causal_mask(query_length: int, key_length: int | None = None, offset: int = 0) -> Array:
    """-> [1, 1, L, S]: query i attends to key j iff j <= i + offset."""
    key_length = query_length if key_length is None else key_length
    q = jnp.arange(query_length)[:, None] + offset
    k = jnp.arange(key_length)[None, :]
    return (k <= q)[None, None]


def segment_mask(q_segment_ids: Array, kv_segment_ids: Array) -> Array:
    """[B, L], [B, S] int -> [B, 1, L, S]: same segment, and the key is not padding (0)."""
    q, k = q_segment_ids[:, None, :, None], kv_segment_ids[:, None, None, :]
    return (q == k) & (k != 0)


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of the given masks (None entries are ignored); None if all are None."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    return functools.reduce(jnp.logical_and, present)


def dense_mask(
    query_length: int,
    key_length: int,
    *,
    mask: Array | None = None,
    is_causal: bool = False,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
) -> Array | None:
    """Materialise the structured masks and combine them with `mask` -> [B|1, H|1, L, S]."""
    seg = None
    if q_segment_ids is not None or kv_segment_ids is not None:
        if q_segment_ids is None or kv_segment_ids is None:
            raise ValueError("q_segment_ids and kv_segment_ids must be given together")
        seg = segment_mask(q_segment_ids, kv_segment_ids)
    causal = causal_mask(query_length, key_length) if is_causal else None
    return combine_masks(mask, seg, causal)
