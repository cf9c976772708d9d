"""Multi-head attention (paper section 3.2.2): h heads of `dot_product_attention` over
learned projections, concatenated and projected by W^O.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

Shape letters (attention.py's): B batch, L query length, S key/value length, H query heads,
K key/value heads (grouped-query attention when K < H), D query/key head dim (d_k), E value
head dim (d_v), M model dim. Parameters carry logical axis names for sharding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from tx_jax.model.attention import beam_cache_attention, dot_product_attention
from tx_jax.model.positional import apply_rope
from tx_jax.ops.kernels import dense
from tx_jax.ops.masks import causal_mask, combine_masks

Array = jax.Array


def _proj_init(fan_in_axes: tuple[int, ...], fan_out_axes: tuple[int, ...]) -> Callable:
    """Glorot-uniform over a multi-axis kernel, as a 2-D [in, out] matrix would have it."""
    return nn.initializers.variance_scaling(
        1.0, "fan_avg", "uniform", in_axis=fan_in_axes, out_axis=fan_out_axes
    )


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W^O, head_i = Attention(Q W_i^Q, ...).

    Self-attention when `inputs_kv` is None, cross-attention otherwise. With `decode=True`
    it keeps a KV cache in the 'cache' collection, as Flax's own attention does: initialise
    with a full-length input (that fixes the cache length), then call with one or more new
    positions at a time. Cross-attention keys/values are projected once, on the first
    decode call, and reused.

    Attributes:
      num_heads: H. head_dim: Dk (default M // H). num_kv_heads: K (default H).
      value_head_dim: Dv (default Dk): W^V is [M, K, Dv] and W^O [H * Dv, M], as the paper's
        W_i^V in R^{d_model x d_v} and W^O in R^{h d_v x d_model}.
      out_features: output width (default the input width M).
      rope_base: apply rotary position embeddings to q and k with this base (self-attention).
      sow_weights: store the [B, H, L, S] weights in the 'intermediates' collection.
    """

    num_heads: int
    head_dim: int | None = None
    num_kv_heads: int | None = None
    value_head_dim: int | None = None
    out_features: int | None = None
    use_bias: bool = False
    dropout_rate: float = 0.0
    implementation: str = "xla"  # ModelConfig.attention_impl, concrete
    rope_base: float | None = None
    decode: bool = False
    sow_weights: bool = False
    kernels: str = "generic"  # ModelConfig.kernels: the projections' implementation
    dropout_bits: str = "bernoulli"  # ModelConfig.dropout_bits: the weights' dropout bits
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    def _projection(self, name: str, M: int, heads: int, head_dim: int, axis: str):
        """The [M, heads, D] kernel (and [heads, D] bias) of one projection, and its apply fn."""
        kernel = self.param(
            f"{name}_kernel",
            nn.with_logical_partitioning(_proj_init((0,), (1, 2)), ("embed", axis, "kv")),
            (M, heads, head_dim),
            self.param_dtype,
        )
        bias = None
        if self.use_bias:
            bias = self.param(
                f"{name}_bias",
                nn.with_logical_partitioning(nn.initializers.zeros_init(), (axis, "kv")),
                (heads, head_dim),
                self.param_dtype,
            )

        def apply(x: Array) -> Array:  # [B, T, M] -> [B, T, heads, D]: 'btm,mhd->bthd'
            dtype = self.dtype or x.dtype
            w = kernel.astype(dtype).reshape(M, heads * head_dim)
            y = dense(x.astype(dtype), w, self.precision, self.kernels)
            y = y.reshape(*x.shape[:-1], heads, head_dim)
            return y if bias is None else y + bias.astype(dtype)

        return apply

    def _project(self, name: str, x: Array, heads: int, head_dim: int, axis: str) -> Array:
        return self._projection(name, x.shape[-1], heads, head_dim, axis)(x)

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array | None = None,
        *,
        mask: Array | None = None,
        bias: Array | None = None,
        is_causal: bool = False,
        q_segment_ids: Array | None = None,
        kv_segment_ids: Array | None = None,
        q_positions: Array | None = None,
        kv_positions: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """inputs_q [B, L, M], inputs_kv [B, S, M] or None -> [B, L, out_features or M].

        q_positions [B, L] / kv_positions [B, S]: token positions for RoPE (default
        0..L-1, or the cache index onwards when decoding).
        """
        M = inputs_q.shape[-1]
        H = self.num_heads
        K = self.num_kv_heads or H
        D = self.head_dim or M // H
        Dv = self.value_head_dim or D
        cross = inputs_kv is not None
        query = self._project("query", inputs_q, H, D, "heads")
        if cross and self.decode:
            key, value = self._cached_cross_kv(inputs_kv, K, D, Dv)
            if key.shape[0] != query.shape[0]:  # beam search: N hypotheses per cached source
                return self._grouped_cross(query, key, value, q_segment_ids, kv_segment_ids, M)
        else:
            kv_in = inputs_kv if cross else inputs_q
            key = self._project("key", kv_in, K, D, "kv_heads")
            value = self._project("value", kv_in, K, Dv, "kv_heads")

        if self.decode and not cross and self.has_variable("cache", "beam_origin"):
            out = self._beam_attention(query, key, value, mask, q_positions)
            return self._output(out, self.out_features or M)
        cache_index = None
        if self.decode and not cross:
            key, value, cache_index = self._update_self_cache(key, value)
        if self.rope_base is not None and not cross:
            q_positions, kv_positions = self._rope_positions(
                inputs_q.shape[:2], key.shape[1], q_positions, kv_positions, cache_index
            )
            query = apply_rope(query, q_positions, self.rope_base)
            if cache_index is None:
                key = apply_rope(key, kv_positions, self.rope_base)
        if cache_index is not None:
            # Query t of this call sits at position cache_index + t; keys past it are empty.
            mask = combine_masks(mask, causal_mask(query.shape[1], key.shape[1], cache_index))
            is_causal, q_segment_ids, kv_segment_ids = False, None, None

        query = nn.with_logical_constraint(query, ("batch", "length", "heads", "kv"))
        dropout_rng = None
        if self.dropout_rate > 0.0 and not deterministic:
            dropout_rng = self.make_rng("dropout")
        result = dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            is_causal=is_causal,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            dropout_rate=self.dropout_rate,
            dropout_rng=dropout_rng,
            deterministic=deterministic,
            implementation=self.implementation,
            return_weights=self.sow_weights,
            precision=self.precision,
            dropout_bits=self.dropout_bits,
        )
        if self.sow_weights:
            result, weights = result
            self.sow("intermediates", "attention_weights", weights)
        return self._output(result, self.out_features or M)

    def _output(self, x: Array, features: int) -> Array:
        """W^O: [B, L, H, Dv] -> [B, L, features]; concatenating heads is folded into the einsum."""
        _, _, H, D = x.shape  # D = Dv
        kernel = self.param(
            "out_kernel",
            nn.with_logical_partitioning(_proj_init((0, 1), (2,)), ("heads", "kv", "embed")),
            (H, D, features),
            self.param_dtype,
        )
        B, L = x.shape[:2]  # 'blhd,hdm->blm' as one [B, L, H*D] @ [H*D, features] matmul
        w = kernel.astype(x.dtype).reshape(H * D, features)
        y = dense(x.reshape(B, L, H * D), w, self.precision, self.kernels)
        if self.use_bias:
            b = self.param(
                "out_bias",
                nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
                (features,),
                self.param_dtype,
            )
            y = y + b.astype(x.dtype)
        return y

    def _update_self_cache(self, key: Array, value: Array) -> tuple[Array, Array, Array | None]:
        """Write the new [B, T, K, Dk] keys / [B, T, K, Dv] values at cache_index; return the
        whole cache as [B, T_max, K, D] views.

        The cache is stored heads-major, keys [B, K, T_max, Dk] and values [B, K, Dv, T_max]:
        the operand layouts of the two attention products, so the views cancel against the
        products' own transposes (XLA:CPU otherwise copies the whole cache every step)."""
        initialised = self.has_variable("cache", "cached_key")
        B, T, K, Dk = key.shape
        Dv = value.shape[-1]
        cached_key = self.variable("cache", "cached_key", jnp.zeros, (B, K, T, Dk), key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, (B, K, Dv, T), value.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialised:  # the init call: shapes only, attend as in training
            return key, value, None
        i = index.value
        if self.rope_base is not None:
            pos = i + jnp.arange(T)[None, :]
            key = apply_rope(key, jnp.broadcast_to(pos, key.shape[:2]), self.rope_base)
        new_key = jnp.transpose(key, (0, 2, 1, 3))  # [B, K, T, Dk]
        new_value = jnp.transpose(value, (0, 2, 3, 1))  # [B, K, Dv, T]
        cached_key.value = lax.dynamic_update_slice(cached_key.value, new_key, (0, 0, i, 0))
        cached_value.value = lax.dynamic_update_slice(cached_value.value, new_value, (0, 0, 0, i))
        index.value = i + T
        return _key_view(cached_key.value), _value_view(cached_value.value), i

    def _grouped_cross(self, query, key, value, q_segment_ids, kv_segment_ids, M) -> Array:
        """Cross-attention of [B * N, L] hypotheses over the [B, S] sources they share
        (cache.share_beams keeps one cross cache row per example): an example's N
        hypotheses attend as N * L queries of one row, reading its keys once, not N times."""
        BN, L, H, D = query.shape
        B = key.shape[0]
        N = BN // B
        if q_segment_ids is not None:
            q_segment_ids = q_segment_ids.reshape(B, N * L)
        if kv_segment_ids is not None:
            kv_segment_ids = kv_segment_ids[::N]
        out = dot_product_attention(
            query.reshape(B, N * L, H, D),
            key,
            value,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            implementation=self.implementation,
            precision=self.precision,
        )
        return self._output(out.reshape(BN, L, H, -1), self.out_features or M)

    def _beam_attention(
        self, query: Array, key: Array, value: Array, mask: Array | None, q_positions
    ) -> Array:
        """One step of beam search's self-attention over a cache it does not reorder.

        inference/cache.py (share_beams) gives the cache for beam search a 'beam_origin'
        [B, N, T] table, the slot that wrote each position of each hypothesis, and stores
        keys [B, N, K, T, Dk] and values [B, N, K, Dv, T] per example; the search reorders
        only the table (attention.beam_cache_attention)."""
        if mask is not None or self.sow_weights:
            raise ValueError("a beam-shared KV cache supports neither a mask nor sow_weights")
        cached_key = self.variable("cache", "cached_key", None)
        cached_value = self.variable("cache", "cached_value", None)
        origin = self.variable("cache", "beam_origin", None)
        index = self.variable("cache", "cache_index", None)
        B, N, K = cached_key.value.shape[:3]
        i = index.value
        if self.rope_base is not None:
            if q_positions is None:
                q_positions = jnp.broadcast_to(
                    i + jnp.arange(query.shape[1])[None], query.shape[:2]
                )
            query = apply_rope(query, q_positions, self.rope_base)
            key = apply_rope(key, q_positions, self.rope_base)
        slots = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[None, :, None], (B, N, 1))
        origin.value = lax.dynamic_update_slice(origin.value, slots, (0, 0, i))
        new_key = key.reshape(B, N, K, 1, key.shape[-1])
        new_value = value.reshape(B, N, K, value.shape[-1], 1)
        cached_key.value = lax.dynamic_update_slice(cached_key.value, new_key, (0, 0, 0, i, 0))
        cached_value.value = lax.dynamic_update_slice(
            cached_value.value, new_value, (0, 0, 0, 0, i)
        )
        index.value = i + 1
        return beam_cache_attention(
            query, cached_key.value, cached_value.value, origin.value, i, precision=self.precision
        )

    def _cached_cross_kv(self, inputs_kv: Array, K: int, D: int, Dv: int) -> tuple[Array, Array]:
        """Project the encoder output once, then read the cache.

        The call that creates the cache projects it there when it runs with real parameters
        (`apply`, as decoding.py does): later calls only read it, so a decoding loop carries
        it unchanged (no per-step copy). A cache made by `init` starts empty (cross_filled
        False) and is filled by the first call after it. Stored heads-major, keys
        [B, K, S, Dk] and values [B, K, Dv, S], as the self-attention cache (there: why).
        """
        M = inputs_kv.shape[-1]
        key_fn = self._projection("key", M, K, D, "kv_heads")
        value_fn = self._projection("value", M, K, Dv, "kv_heads")
        to_key = lambda x: jnp.transpose(key_fn(x), (0, 2, 1, 3))  # noqa: E731
        to_value = lambda x: jnp.transpose(value_fn(x), (0, 2, 3, 1))  # noqa: E731
        if not self.has_variable("cache", "cross_key"):
            key, value = to_key(inputs_kv), to_value(inputs_kv)
            if self.is_initializing():  # init's parameters are not the ones decoding uses
                self.variable("cache", "cross_key", jnp.zeros, key.shape, key.dtype)
                self.variable("cache", "cross_value", jnp.zeros, value.shape, value.dtype)
                self.variable("cache", "cross_filled", lambda: jnp.array(False))
            else:
                self.variable("cache", "cross_key", lambda: key)
                self.variable("cache", "cross_value", lambda: value)
            return _key_view(key), _value_view(value)
        ck = self.variable("cache", "cross_key", None)
        cv = self.variable("cache", "cross_value", None)
        if not self.has_variable("cache", "cross_filled"):  # filled when it was created
            return _key_view(ck.value), _value_view(cv.value)
        filled = self.variable("cache", "cross_filled", None)
        # The projections sit in the branch that runs only while the cache is empty.
        key, value = lax.cond(
            filled.value,
            lambda x: (ck.value, cv.value),
            lambda x: (to_key(x).astype(ck.value.dtype), to_value(x).astype(cv.value.dtype)),
            inputs_kv,
        )
        ck.value, cv.value, filled.value = key, value, jnp.array(True)
        return _key_view(key), _value_view(value)

    def _rope_positions(self, bl, S, q_positions, kv_positions, cache_index):
        B, L = bl
        if q_positions is None:
            start = 0 if cache_index is None else cache_index
            q_positions = jnp.broadcast_to(start + jnp.arange(L)[None], (B, L))
        if kv_positions is None:
            kv_positions = jnp.broadcast_to(jnp.arange(S)[None], (B, S))
        return q_positions, kv_positions


def _key_view(cache: Array) -> Array:
    """A heads-major key cache [B, K, T, Dk] as attention's [B, T, K, Dk]."""
    return jnp.transpose(cache, (0, 2, 1, 3))


def _value_view(cache: Array) -> Array:
    """A heads-major value cache [B, K, Dv, T] as attention's [B, T, K, Dv]."""
    return jnp.transpose(cache, (0, 3, 1, 2))
