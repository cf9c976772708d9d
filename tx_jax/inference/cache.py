"""The decoding cache's layout, known here alone: the searches (search.py) treat a cache as
opaque and change it only through these functions (T5X's decoding.cache_map plays this part).

Shape letters: B batch (examples), N beams, R = B * N rows, T decode positions, S source
length. A logits function's cache is `of_model(model_cache, inputs)` (Flax's 'cache'
collection and the per-row arguments of the model) or `prefix(R, T)` (the no-cache
reference's tokens so far). Every array is laid out as its name says (`_LAYOUT`): per
hypothesis, row b * N + n of [R, ...]; in a beam-shared cache (`share_beams`), per example,
[B, ...] or [B, N, ...]; or a scalar, which belongs to no row. The operations:
share_beams, gather_beams (each hypothesis takes its source beam's history), grow (more
empty positions) and take_rows (some examples only: compaction).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
Cache = Any


class _Layout(NamedTuple):
    rows: str  # 'hypothesis': [R, ...]; 'example': [B, ...] or [B, N, ...]
    reorder: str  # what a beam step does: 'rows' takes the source beams' rows, 'beams' the
    # [B, N, ...] table's beams, '' leaves it (the same for every beam, or kept in its slot)
    positions: int | None  # the axis of its decode positions (grown), None: it has none


# MultiHeadAttention stores keys [R, K, T, Dk] and values [R, K, Dv, T] (heads-major: the
# operand layouts of attention's two products); cross-attention's hold S source positions,
# fixed, and are the same for every beam of an example, as are the model's arguments.
_LAYOUT = {
    "cached_key": _Layout("hypothesis", "rows", -2),
    "cached_value": _Layout("hypothesis", "rows", -1),
    "cross_key": _Layout("hypothesis", "", None),
    "cross_value": _Layout("hypothesis", "", None),
    "inputs": _Layout("hypothesis", "", None),
    "tokens": _Layout("hypothesis", "rows", -1),
}
# A beam-shared cache keeps self-attention keys [B, N, K, T, Dk] and values [B, N, K, Dv, T]
# in the slot that wrote them and reorders only 'beam_origin' [B, N, T], which slot wrote
# each position of each hypothesis (attention.beam_cache_attention); cross-attention keys
# and values are kept once per example (model/kv_cache.grouped_cross_attention).
_SHARED = {
    "cached_key": _Layout("example", "", -2),
    "cached_value": _Layout("example", "", -1),
    "beam_origin": _Layout("example", "beams", -1),
    "cross_key": _Layout("example", "", None),
    "cross_value": _Layout("example", "", None),
}


def of_model(model_cache: Any, inputs: tuple[Array, ...]) -> Cache:
    """The cache of a Flax model applied in decode mode: its 'cache' collection and the per-row
    arguments it is applied to (here, so that a search may move rows between batches)."""
    return {"model": model_cache, "inputs": inputs}


def model_parts(cache: Cache) -> tuple[Any, tuple[Array, ...]]:
    """of_model's inverse -> (the 'cache' collection, the per-row arguments)."""
    return cache["model"], cache["inputs"]


def prefix(rows: int, length: int) -> Cache:
    """The no-cache reference's state: no token yet, [rows, length] zeros."""
    return {"tokens": jnp.zeros((rows, length), jnp.int32), "index": jnp.array(0, jnp.int32)}


def extend_prefix(cache: Cache, tokens: Array) -> tuple[Array, Array, Cache]:
    """tokens [R, 1] written at the prefix's step -> (prefix [R, T], that step, new cache)."""
    i = cache["index"]
    tokens = jax.lax.dynamic_update_slice(cache["tokens"], tokens.astype(jnp.int32), (0, i))
    return tokens, i, {"tokens": tokens, "index": i + 1}


def _is_shared(cache: Cache) -> bool:
    if isinstance(cache, Mapping):
        return "beam_origin" in cache or any(_is_shared(x) for x in cache.values())
    return False


def _map(fn: Callable[[_Layout | None, Array], Array], cache: Cache) -> Cache:
    """fn(layout, x) on every array of the cache (layout None for a scalar: no row's)."""
    table = {**_LAYOUT, **_SHARED} if _is_shared(cache) else _LAYOUT

    def visit(name: str | None, node: Any) -> Any:
        if isinstance(node, Mapping):
            out = {k: visit(k, v) for k, v in node.items()}
            return out if type(node) is dict else type(node)(out)
        if isinstance(node, tuple | list):
            return type(node)(visit(name, x) for x in node)
        if jnp.ndim(node) == 0:
            return fn(None, node)
        if name not in table:
            raise ValueError(
                f"decoding cache entry {name!r} {jnp.shape(node)}: its layout is unknown "
                "(add it to tx_jax/inference/cache.py)"
            )
        return fn(table[name], node)

    return visit(None, cache)


def share_beams(cache: Cache, batch: int, beams: int, length: int) -> Cache:
    """A [batch * beams]-row cache -> the beam-shared one: self-attention keys and values
    viewed per example, [B, N, K, ...], with a 'beam_origin' [B, N, T] table of zeros;
    cross-attention keys and values kept once per example, [B, ...]."""

    def visit(node):
        if not isinstance(node, dict):
            return node
        out = {name: visit(x) for name, x in node.items()}
        if "cached_key" in node:
            for name in ("cached_key", "cached_value"):  # [B * N, K, ...] -> [B, N, K, ...]
                out[name] = node[name].reshape(batch, beams, *node[name].shape[1:])
            out["beam_origin"] = jnp.zeros((batch, beams, length), jnp.int32)
        for name in ("cross_key", "cross_value"):  # the same for an example's every beam
            if name in node:
                out[name] = node[name][::beams]
        return out

    return visit(cache)


def take_beams(x: Array, index: Array) -> Array:
    """x [B, N, ...], index [B, K] -> [B, K, ...]."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def gather_beams(cache: Cache, beam_index: Array) -> Cache:
    """Hypothesis n of example b continues beam beam_index[b, n] [B, N]: its entries take that
    beam's rows, but for those the same for every beam and a beam-shared cache's keys and
    values (only its origin table is reordered)."""
    B, N = beam_index.shape
    rows = (jnp.arange(B)[:, None] * N + beam_index).reshape(-1)

    def reorder(layout: _Layout | None, x: Array) -> Array:
        if layout is None or not layout.reorder:
            return x
        if layout.reorder == "beams":
            return take_beams(x, beam_index)
        return jnp.take(x, rows, axis=0)

    return _map(reorder, cache)


def grow(cache: Cache, *, old: int, new: int) -> Cache:
    """A cache of `old` decode positions -> the same with `new`: every positional entry padded
    with empty (zero) positions after its own."""

    def pad(layout: _Layout | None, x: Array) -> Array:
        if layout is None or layout.positions is None:
            return x
        axis = layout.positions
        if x.shape[axis] != old:
            raise ValueError(f"cache entry {x.shape}: expected {old} positions on axis {axis}")
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, new - old)
        return jnp.pad(x, widths)

    return _map(pad, cache)


def take_rows(cache: Cache, idx: Array, batch: int, beams: int = 1) -> Cache:
    """The examples idx [b] of a cache of `batch` examples with `beams` hypotheses each ->
    a cache of b examples."""

    def take(layout: _Layout | None, x: Array) -> Array:
        if layout is None:
            return x
        if layout.rows == "example" or beams == 1:
            return jnp.take(x, idx, axis=0)
        if x.shape[0] != batch * beams:
            raise ValueError(f"cache entry {x.shape}: expected {batch} x {beams} rows")
        per = x.reshape(batch, beams, *x.shape[1:])
        return jnp.take(per, idx, axis=0).reshape(-1, *x.shape[1:])

    return _map(take, cache)
