"""Scaled dot-product attention (paper section 3.2.1) and multi-head attention (3.2.2).

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V        (eq. 1)

Shape letters used in this module (einsum subscripts use the lower-case letters):
    B batch          L query length      S key/value length
    H query heads    K key/value heads   G = H // K query heads per K/V head (grouped query)
    Dk query/key head dim (the paper's d_k)  Dv value head dim (d_v; default Dk)
    M model dim      C key block length of the 'chunked' implementation
(einsum subscripts write both head dims as d: no einsum has a Dk and a Dv operand at once).

Masks (masks.py) are boolean and broadcastable to [B, H, L, S]; True means "may attend". Two
structured masks are also accepted and built where they are needed, so that the 'chunked'
implementation never materialises an L x S array:
    is_causal:       query i attends to keys j <= i (positions counted from 0 on both sides)
    segment ids:     q_segment_ids [B, L], kv_segment_ids [B, S], int; 0 marks padding.
                     A query attends to a key of the same non-zero segment (packing, padding).
A query row that may attend to nothing returns zeros, never NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from tx_jax.model.flash import flash_attention, to_kg
from tx_jax.model.masks import causal_mask, combine_masks, dense_mask
from tx_jax.model.positional import apply_rope
from tx_jax.ops.kernels import dense, dropout

Array = jax.Array
Implementation = Literal["auto", "xla", "chunked", "cudnn"]
IMPLEMENTATIONS = ("auto", "xla", "chunked", "cudnn")
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
    implementation: Implementation = "auto",
    return_weights: bool = False,
    chunk_size: int = 512,
    precision: Any = None,
    kernels: str = "auto",
) -> Array | tuple[Array, Array]:
    """softmax(q k^T / sqrt(Dk) + bias) v over [B, L, H, Dk] queries, [B, S, K, Dk] keys and
    [B, S, K, Dv] values.

    Args:
      query: [B, L, H, Dk]. key: [B, S, K, Dk]; value: [B, S, K, Dv] with H % K == 0 (K < H is
        grouped-query attention, K == 1 multi-query). Dv may differ from Dk (the paper's d_v
        and d_k) for 'xla' and 'chunked'; 'cudnn' (jax.nn.dot_product_attention) needs Dv == Dk.
      mask: bool, broadcastable to [B, H, L, S]; True = may attend.
      bias: float, broadcastable to [B, H, L, S], added to the scaled scores.
      is_causal, q_segment_ids, kv_segment_ids: structured masks (module docstring).
      dropout_rate, dropout_rng, deterministic: dropout on the attention weights.
      implementation: 'xla' (einsum-softmax-einsum), 'chunked' (online softmax over key
        blocks of `chunk_size`: memory linear in S, same result), 'cudnn'
        (jax.nn.dot_product_attention on a GPU, bf16/fp16, Dv == Dk), or 'auto'.
      return_weights: also return the [B, H, L, S] weights ('xla' only).
      kernels: whose dropout masks, 'auto' | 'cpu' | 'generic' (tx_jax/ops/kernels.py).
    Returns:
      [B, L, H, Dv] in value's dtype, and the float32 weights if return_weights.
    """
    _check_shapes(query, key, value)
    dropout = dropout_rate > 0.0 and not deterministic
    if dropout and dropout_rng is None:
        raise ValueError("dropout_rate > 0 with deterministic=False needs a dropout_rng")
    impl = _choose(implementation, query, key, value, dropout, return_weights)
    if return_weights and impl != "xla":
        raise ValueError(f"return_weights=True needs implementation='xla', not {impl!r}")
    L, S = query.shape[1], key.shape[1]
    drop = (dropout_rate, dropout_rng, kernels) if dropout else None
    if impl == "chunked":
        return _attention_chunked(
            query,
            key,
            value,
            mask,
            bias,
            is_causal,
            q_segment_ids,
            kv_segment_ids,
            drop,
            chunk_size,
            precision,
        )
    full = dense_mask(
        L,
        S,
        mask=mask,
        is_causal=is_causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    if impl == "cudnn":
        return _attention_cudnn(query, key, value, full, bias)
    out, weights = _attention_xla(query, key, value, full, bias, drop, precision)
    return (out, weights) if return_weights else out


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


def _choose(impl: str, query: Array, key: Array, value: Array, dropout: bool, weights: bool):
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={impl!r}; expected one of {IMPLEMENTATIONS}")
    if impl != "auto":
        return impl
    if weights:
        return "xla"
    cudnn_ok = (
        jax.default_backend() == "gpu"
        and query.dtype in (jnp.bfloat16, jnp.float16)
        and not dropout
        and value.shape[-1] == key.shape[-1]  # jax.nn.dot_product_attention: same shapes
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 128
    )
    if cudnn_ok:
        return "cudnn"
    # Long keys: the L x S score matrix dominates memory; stream over key blocks instead.
    return "chunked" if key.shape[1] >= 2048 else "xla"


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


def _attention_chunked(query, key, value, mask, bias, is_causal, q_seg, kv_seg, drop, C, prec):
    """Blockwise attention, memory linear in L and S: flash.py's custom-VJP implementation
    (query and key blocks; the backward pass recomputes each block from the saved output and
    log-sum-exp), or with a bias the rematerialised scan below."""
    if bias is None:
        rate, rng, kernels = drop if drop is not None else (0.0, None, "auto")
        return flash_attention(
            query,
            key,
            value,
            mask=mask,
            is_causal=is_causal,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            dropout_rate=rate,
            dropout_rng=rng,
            chunk_size=C,
            precision=prec,
            kernels=kernels,
        )
    return _attention_chunked_scan(
        query, key, value, mask, bias, is_causal, q_seg, kv_seg, drop, C, prec
    )


def _attention_chunked_scan(query, key, value, mask, bias, is_causal, q_seg, kv_seg, drop, C, prec):
    """Online softmax over key blocks (Milakov & Gimelshein 2018; Rabe & Staats 2021).

    Keeps a running max m, normaliser l and unnormalised output o per query; each block
    rescales them by exp(m_old - m_new). Peak memory is O(B H L C), not O(B H L S). The scan
    body is rematerialised, so the backward pass stores only the per-block carries (and the
    [B, H, L, S] bias itself, which makes a custom VJP pointless here).
    """
    B, L, H, D = query.shape
    S, K = key.shape[1], key.shape[2]
    C = min(C, S)
    n = -(-S // C)
    pad = n * C - S
    q = _split_heads(query, K) * jnp.asarray(1.0 / math.sqrt(D), query.dtype)
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")

    def blocks(x: Array | None, axis: int, fill) -> Array | None:
        """Pad `axis` (length S, or 1 = broadcast) to n * C and move the blocks to axis 0."""
        if x is None or x.shape[axis] == 1:
            return None
        axis = axis % x.ndim
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths, constant_values=fill)
        x = x.reshape(x.shape[:axis] + (n, C) + x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    mask_kg, bias_kg = to_kg(mask, K), to_kg(bias, K)
    kv_valid = jnp.ones((S,), bool)  # padded to False by blocks(): padding never attends
    xs = {
        "k": blocks(key, 1, 0),
        "v": blocks(value, 1, 0),
        "valid": blocks(kv_valid, 0, False),
        "mask": blocks(mask_kg, -1, False),
        "bias": blocks(bias_kg, -1, 0.0),
        "kv_seg": blocks(kv_seg, 1, 0),
        "start": jnp.arange(n) * C,
    }
    xs = {k: v for k, v in xs.items() if v is not None}
    q_pos = jnp.arange(L)

    def body(carry, x):
        o, m, l = carry  # [B,L,K,G,Dv], [B,K,G,L], [B,K,G,L]; float32
        s = jnp.einsum("blkgd,bskd->bkgls", q, x["k"], precision=prec).astype(jnp.float32)
        if "bias" in x:
            s = s + x["bias"].astype(jnp.float32)
        elif bias_kg is not None:
            s = s + bias_kg.astype(jnp.float32)
        allowed = x["valid"][None, None, None, None, :]
        if "mask" in x:
            allowed = allowed & x["mask"]
        elif mask_kg is not None:
            allowed = allowed & mask_kg
        if is_causal:
            k_pos = x["start"] + jnp.arange(C)
            allowed = allowed & (k_pos[None, :] <= q_pos[:, None])
        if q_seg is not None:
            ks = x["kv_seg"][:, None, None, None, :]
            allowed = allowed & (q_seg[:, None, None, :, None] == ks) & (ks != 0)
        s = jnp.where(allowed, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l_new = l * corr + p.sum(-1)
        if drop is not None:
            rate, rng, kernels = drop
            p = dropout(p, rate, jax.random.fold_in(rng, x["start"]), kernels)
        pv = jnp.einsum("bkgls,bskd->blkgd", p.astype(value.dtype), x["v"], precision=prec)
        o_new = o * jnp.moveaxis(corr, 3, 1)[..., None] + pv.astype(jnp.float32)
        return (o_new, m_new, l_new), None

    G, Dv = H // K, value.shape[-1]
    init = (
        jnp.zeros((B, L, K, G, Dv), jnp.float32),
        jnp.full((B, K, G, L), _NEG, jnp.float32),
        jnp.zeros((B, K, G, L), jnp.float32),
    )
    (o, _, l), _ = lax.scan(jax.checkpoint(body, prevent_cse=False), init, xs)
    l = jnp.moveaxis(l, 3, 1)[..., None]  # [B, L, K, G, 1]
    out = o / jnp.where(l == 0.0, 1.0, l)  # fully masked rows: o == 0 -> zeros
    return out.reshape(B, L, H, Dv).astype(value.dtype)


def _attention_cudnn(query, key, value, mask, bias):
    # No check of jax.default_backend(): a CPU host with CUDA's jaxlib plugin can lower this
    # for 'cuda' (jax.export, tests/test_lowering.py). Without the plugin jax raises here.
    if value.shape[-1] != key.shape[-1]:
        raise ValueError(
            "implementation='cudnn' (jax.nn.dot_product_attention) needs the value head dim "
            f"equal to the key's; got key {key.shape}, value {value.shape}: use 'xla' or "
            "'chunked' for d_v != d_k"
        )
    B, L, H, _ = query.shape
    full = None if mask is None else jnp.broadcast_to(mask, (B, H, L, key.shape[1]))
    try:
        out = jax.nn.dot_product_attention(
            query, key, value, bias=bias, mask=full, implementation="cudnn"
        )
    except RuntimeError as e:  # no CUDA in jaxlib; or run eagerly on a CPU (no lowering rule)
        raise ValueError(
            f"implementation='cudnn' runs only on a GPU with cuDNN (jax: {e}); "
            "use 'auto', 'xla' or 'chunked'"
        ) from e
    if full is not None:  # cuDNN leaves fully masked rows undefined; ours are zeros
        out = jnp.where(jnp.moveaxis(full.any(-1), 1, 2)[..., None], out, 0)
    return out


# ------------------------------------------------------------------------- the module


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
    implementation: Implementation = "auto"
    rope_base: float | None = None
    decode: bool = False
    sow_weights: bool = False
    kernels: str = "auto"  # ModelConfig.kernels: projections' and dropout's implementations
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
        else:
            kv_in = inputs_kv if cross else inputs_q
            key = self._project("key", kv_in, K, D, "kv_heads")
            value = self._project("value", kv_in, K, Dv, "kv_heads")

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
            kernels=self.kernels,
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
        whole cache."""
        initialised = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialised:  # the init call: shapes only, attend as in training
            return key, value, None
        i = index.value
        if self.rope_base is not None:
            pos = i + jnp.arange(key.shape[1])[None, :]
            key = apply_rope(key, jnp.broadcast_to(pos, key.shape[:2]), self.rope_base)
        cached_key.value = lax.dynamic_update_slice(cached_key.value, key, (0, i, 0, 0))
        cached_value.value = lax.dynamic_update_slice(cached_value.value, value, (0, i, 0, 0))
        index.value = i + key.shape[1]
        return cached_key.value, cached_value.value, i

    def _cached_cross_kv(self, inputs_kv: Array, K: int, D: int, Dv: int) -> tuple[Array, Array]:
        """Project the encoder output on the first decode call only, then read the cache."""
        M = inputs_kv.shape[-1]
        key_fn = self._projection("key", M, K, D, "kv_heads")
        value_fn = self._projection("value", M, K, Dv, "kv_heads")
        initialised = self.has_variable("cache", "cross_key")
        if not initialised:  # the init call: create the cache with the right shapes
            key, value = key_fn(inputs_kv), value_fn(inputs_kv)
            self.variable("cache", "cross_key", jnp.zeros, key.shape, key.dtype)
            self.variable("cache", "cross_value", jnp.zeros, value.shape, value.dtype)
            self.variable("cache", "cross_filled", lambda: jnp.array(False))
            return key, value
        ck = self.variable("cache", "cross_key", None)
        cv = self.variable("cache", "cross_value", None)
        filled = self.variable("cache", "cross_filled", None)
        # The projections sit in the branch that runs only while the cache is empty.
        key, value = lax.cond(
            filled.value,
            lambda x: (ck.value, cv.value),
            lambda x: (key_fn(x).astype(ck.value.dtype), value_fn(x).astype(cv.value.dtype)),
            inputs_kv,
        )
        ck.value, cv.value, filled.value = key, value, jnp.array(True)
        return key, value

    def _rope_positions(self, bl, S, q_positions, kv_positions, cache_index):
        B, L = bl
        if q_positions is None:
            start = 0 if cache_index is None else cache_index
            q_positions = jnp.broadcast_to(start + jnp.arange(L)[None], (B, L))
        if kv_positions is None:
            kv_positions = jnp.broadcast_to(jnp.arange(S)[None], (B, S))
        return q_positions, kv_positions
