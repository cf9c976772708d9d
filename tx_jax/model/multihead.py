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

from tx_jax.model import kv_cache
from tx_jax.model import lora as lora_lib
from tx_jax.model.attention import dot_product_attention
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
    it keeps its caches in the 'cache' collection (kv_cache.py), as Flax's own attention
    does: the call that creates them with the real parameters (a full-length input fixes the
    cache length) projects the encoder output once; later calls decode one or more new
    positions at a time. With `beams=N` it decodes over the beam-shared cache of N hypotheses
    per example that inference/cache.share_beams makes of it.

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
    beams: int = 0  # > 0: decoding with the beam-shared cache of that many hypotheses
    sow_weights: bool = False
    kernels: str = "generic"  # ModelConfig.kernels: the projections' implementation
    dropout_bits: str = "bernoulli"  # ModelConfig.dropout_bits: the weights' dropout bits
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    lora: lora_lib.LoRA = lora_lib.LoRA()  # low-rank adapters on the projections (lora.py)

    def _projection(self, name: str, M: int, heads: int, head_dim: int, axis: str, det: bool):
        """The [M, heads, D] kernel (and [heads, D] bias) of one projection (its adapter with
        LoRA), and its apply fn."""
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
            x = x.astype(dtype)
            y = self._adapt(name, x, dense(x, w, self.precision, self.kernels), det)
            y = y.reshape(*x.shape[:-1], heads, head_dim)
            return y if bias is None else y + bias.astype(dtype)

        return apply

    def _project(self, name: str, x: Array, heads: int, head_dim: int, axis: str, det: bool):
        return self._projection(name, x.shape[-1], heads, head_dim, axis, det)(x)

    def _adapt(self, name: str, x: Array, y: Array, det: bool) -> Array:
        return lora_lib.adapt(
            self, name, x, y, self.lora, deterministic=det, kernels=self.kernels,
            dropout_bits=self.dropout_bits, precision=self.precision,
        )  # fmt: skip

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
        features = self.out_features or M
        cross = inputs_kv is not None
        query = self._project("query", inputs_q, H, D, "heads", deterministic)
        if cross:  # the encoder output's keys and values: no RoPE, no causal cache
            to_key = self._projection("key", inputs_kv.shape[-1], K, D, "kv_heads", deterministic)
            to_value = self._projection(
                "value", inputs_kv.shape[-1], K, Dv, "kv_heads", deterministic
            )
            if self.decode:
                key, value = kv_cache.cross_cache(self, inputs_kv, to_key, to_value)
            else:
                key, value = to_key(inputs_kv), to_value(inputs_kv)
            if self.beams:
                out = kv_cache.grouped_cross_attention(
                    query, key, value, q_segment_ids, kv_segment_ids, self.beams, **self._attend()
                )
                return self._output(out, features, deterministic)
            return self._attention(
                query, key, value, features, deterministic, mask=mask, bias=bias,
                is_causal=is_causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            )  # fmt: skip
        key = self._project("key", inputs_q, K, D, "kv_heads", deterministic)
        value = self._project("value", inputs_q, K, Dv, "kv_heads", deterministic)
        if self.beams:  # one step of beam search over the beam-shared cache
            if mask is not None or self.sow_weights:
                raise ValueError("a beam-shared KV cache supports neither a mask nor sow_weights")
            out = kv_cache.beam_self_attention(self, query, key, value, q_positions)
            return self._output(out, features, deterministic)
        cache_index = None
        if self.decode:
            key, value, cache_index = kv_cache.self_cache(self, key, value)
        if self.rope_base is not None:
            q_positions, kv_positions = self._rope_positions(
                inputs_q.shape[:2], key.shape[1], q_positions, kv_positions, cache_index
            )
            query = apply_rope(query, q_positions, self.rope_base)
            if cache_index is None:  # cached keys were rotated when they were written
                key = apply_rope(key, kv_positions, self.rope_base)
        if cache_index is not None:
            # Query t of this call sits at position cache_index + t; keys past it are empty.
            mask = combine_masks(mask, causal_mask(query.shape[1], key.shape[1], cache_index))
            is_causal, q_segment_ids, kv_segment_ids = False, None, None
        return self._attention(
            query, key, value, features, deterministic, mask=mask, bias=bias,
            is_causal=is_causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        )  # fmt: skip

    def _attend(self) -> dict:
        """dot_product_attention's arguments that this module's attributes fix."""
        return {"implementation": self.implementation, "precision": self.precision}

    def _attention(self, query, key, value, features, deterministic, **masks) -> Array:
        """Attention over the projected [B, L, H, Dk] queries and [B, S, K, D] keys and values,
        then W^O -> [B, L, features] (the weights sown when sow_weights)."""
        query = nn.with_logical_constraint(query, ("batch", "length", "heads", "kv"))
        dropout_rng = None
        if self.dropout_rate > 0.0 and not deterministic:
            dropout_rng = self.make_rng("dropout")
        result = dot_product_attention(
            query,
            key,
            value,
            dropout_rate=self.dropout_rate,
            dropout_rng=dropout_rng,
            deterministic=deterministic,
            return_weights=self.sow_weights,
            dropout_bits=self.dropout_bits,
            **self._attend(),
            **masks,
        )
        if self.sow_weights:
            result, weights = result
            self.sow("intermediates", "attention_weights", weights)
        return self._output(result, features, deterministic)

    def _output(self, x: Array, features: int, det: bool) -> Array:
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
        y = self._adapt("out", x.reshape(B, L, H * D), y, det)
        if self.use_bias:
            b = self.param(
                "out_bias",
                nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
                (features,),
                self.param_dtype,
            )
            y = y + b.astype(x.dtype)
        return y

    def _rope_positions(self, bl, S, q_positions, kv_positions, cache_index):
        B, L = bl
        if q_positions is None:
            start = 0 if cache_index is None else cache_index
            q_positions = jnp.broadcast_to(start + jnp.arange(L)[None], (B, L))
        if kv_positions is None:
            kv_positions = jnp.broadcast_to(jnp.arange(S)[None], (B, S))
        return q_positions, kv_positions
