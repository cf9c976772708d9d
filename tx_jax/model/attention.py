"""Scaled dot-product attention (paper section 3.2.1), the pure function; multihead.py wraps it
in learned projections (3.2.2).

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

The 'splash' implementation is JAX's Pallas TPU kernel (splash attention: block-sparse flash
attention); it takes the structured masks only, and pads L and S to multiples of its block.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from tx_jax.model import cudnn_masks
from tx_jax.model.flash import flash_attention, to_kg
from tx_jax.model.masks import dense_mask
from tx_jax.ops import backend
from tx_jax.ops.kernels import dropout

Array = jax.Array
Implementation = Literal[
    "auto", "xla", "chunked", "cudnn", "cudnn_broadcast", "cudnn_native", "cudnn_jax", "splash"
]
IMPLEMENTATIONS = (
    "auto", "xla", "chunked", "cudnn", "cudnn_broadcast", "cudnn_native", "cudnn_jax", "splash"
)  # fmt: skip
_CUDNN = ("cudnn", "cudnn_broadcast", "cudnn_native", "cudnn_jax")
_NEG = -1e30  # finite "minus infinity": exp(_NEG - m) == 0 without inf - inf = NaN.
_LANES = 128  # splash's block lengths are multiples of the TPU's 128 lanes
# Pallas interpret mode for 'splash', so that tests run the TPU kernel on a CPU; tests set it
# (monkeypatch), nothing else does: on a TPU the kernel must compile to Mosaic.
_SPLASH_INTERPRET = False


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
    dropout_bits: str = "auto",
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
        (cuDNN's fused attention on a GPU, bf16/fp16, Dv == Dk; the masks as a dense bias,
        whose gradient cuDNN's backward is not asked for: cudnn_masks.masked_attention),
        'cudnn_jax' (the same through jax.nn.dot_product_attention, which asks for it: the
        reference 'cudnn' is measured against, and the way back should jax's private call move),
        'cudnn_native' (the same with is_causal and segment ids in cuDNN's own form,
        cudnn_masks.py: no bias, but 1.7x slower on an H100 in the paper's packed base step,
        BENCHMARKS.md; opt-in until a cuDNN makes it pay), 'cudnn_broadcast' (the dense
        mask kept [B, 1, L, S] where it has no head axis, cuDNN broadcasting it over heads:
        an eighth of the bias reads and bias-gradient writes, if cuDNN takes it; opt-in until
        a GPU says so: benchmarks/cudnn_bias.py), 'splash' (the
        Pallas TPU kernel: is_causal and segment ids only; no mask, bias, dropout or weights), or
        'auto' (by backend.current(): 'splash' on a TPU where it applies).
      return_weights: also return the [B, H, L, S] weights ('xla' only).
      kernels: whose dropout masks, 'auto' | 'cpu' | 'generic' (tx_jax/ops/kernels.py).
      dropout_bits: where the weights' dropout bits come from (ModelConfig.dropout_bits).
    Returns:
      [B, L, H, Dv] in value's dtype, and the float32 weights if return_weights.
    """
    _check_shapes(query, key, value)
    dropout = dropout_rate > 0.0 and not deterministic
    if dropout and dropout_rng is None:
        raise ValueError("dropout_rate > 0 with deterministic=False needs a dropout_rng")
    dense = mask is not None or bias is not None
    impl = _choose(implementation, query, key, value, dropout, return_weights, dense)
    if return_weights and impl != "xla":
        raise ValueError(f"return_weights=True needs implementation='xla', not {impl!r}")
    L, S = query.shape[1], key.shape[1]
    drop = (dropout_rate, dropout_rng, kernels, dropout_bits) if dropout else None
    if impl == "splash":
        unsupported = {"mask": mask is not None, "bias": bias is not None, "dropout": dropout}
        named = [name for name, given in unsupported.items() if given]
        if named:
            raise ValueError(
                f"implementation='splash' (the Pallas TPU kernel) does not support "
                f"{', '.join(named)}: use is_causal/segment ids, or 'xla' or 'chunked'"
            )
        return _attention_splash(query, key, value, is_causal, q_segment_ids, kv_segment_ids)
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
    if impl == "cudnn_native" and mask is None and bias is None:
        # The structured masks in cuDNN's own form (cudnn_masks.py): no [B, H, L, S] bias.
        out = _attention_cudnn(
            query, key, value, None, None, (is_causal, q_segment_ids, kv_segment_ids)
        )
        if out is not None:
            return out
    full = dense_mask(
        L,
        S,
        mask=mask,
        is_causal=is_causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    if impl in _CUDNN:
        return _attention_cudnn(
            query, key, value, full, bias, heads=impl != "cudnn_broadcast", own=impl != "cudnn_jax"
        )
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


def _choose(
    impl: str,
    query: Array,
    key: Array,
    value: Array,
    dropout: bool,
    weights: bool,
    dense: bool = False,
):
    """The implementation for `impl`; `dense`: a mask or bias array is given."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={impl!r}; expected one of {IMPLEMENTATIONS}")
    if impl in _CUDNN and backend.deterministic_ops():
        raise ValueError(
            f"implementation={impl!r}: cuDNN's fused attention fails under XLA_FLAGS="
            f"{backend.DETERMINISTIC_FLAG} (train.deterministic); use 'auto' or 'xla'"
        )
    if impl != "auto":
        return impl
    if weights:
        return "xla"
    splash_ok = (
        backend.current() == "tpu"
        and not dropout
        and not dense
        # Shorter lengths would be padded to a whole block: mostly wasted work.
        and query.shape[1] >= _LANES
        and key.shape[1] >= _LANES
        # Only under a mesh being traced for (the mesh strategy's steps), where _per_device
        # can place the kernel: outside one (decoding a sharded model) XLA would have to
        # partition it, which it cannot do for a Mosaic kernel.
        and not jax.sharding.get_abstract_mesh().empty
    )
    if splash_ok:
        return "splash"
    cudnn_ok = (
        backend.current() == "gpu"
        and not backend.deterministic_ops()  # cuDNN's attention fails in that mode
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
        rate, rng, kernels, bits = drop if drop is not None else (0.0, None, "auto", "auto")
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
            dropout_bits=bits,
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
            rate, rng, kernels, bits = drop
            p = dropout(p, rate, jax.random.fold_in(rng, x["start"]), kernels, bits)
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


def _attention_cudnn(query, key, value, mask, bias, structure=None, heads=True, own=True):
    """cuDNN's fused attention with a dense mask/bias (broadcast to every head, or with
    `heads` False left [B, 1, L, S] where it has no head axis; a mask alone, with `own`, through
    cudnn_masks.masked_attention: no bias gradient), or, given `structure`
    (is_causal, q_segment_ids, kv_segment_ids), with those in cuDNN's native form; None where
    the native form does not apply (the caller falls back to the dense mask)."""
    # No check of jax.default_backend(): a CPU host with CUDA's jaxlib plugin can lower this
    # for 'cuda' (jax.export, tests/test_lowering.py). Without the plugin jax raises here.
    if value.shape[-1] != key.shape[-1]:
        raise ValueError(
            "implementation='cudnn' (jax.nn.dot_product_attention) needs the value head dim "
            f"equal to the key's; got key {key.shape}, value {value.shape}: use 'xla' or "
            "'chunked' for d_v != d_k"
        )
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"implementation='cudnn' (cuDNN's fused attention) needs bfloat16 or float16 "
            f"inputs; got {query.dtype}: set model.dtype=bfloat16, or use 'auto' or 'xla'"
        )
    B, L, H, _ = query.shape
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        mask = jnp.broadcast_to(mask, (B, H if heads else mask.shape[1], L, key.shape[1]))
    full = mask
    try:
        if structure is not None:
            return cudnn_masks.attention(query, key, value, *structure)
        out = None
        if own and bias is None and full is not None:  # a mask alone: no gradient to compute
            out = cudnn_masks.masked_attention(query, key, value, full)
        if out is None:
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


def _attention_splash(query, key, value, is_causal, q_seg, kv_seg):
    """JAX's splash attention kernel (Pallas, TPU) over [B, L, H, Dk] queries.

    Splash masks a key when the static mask (causal) or the segment ids differ; a query it
    lets attend to nothing gets an average of masked values rather than zeros, so padding
    keys take id -1 (never a query's) and rows without a key are zeroed here. L and S are
    padded to whole blocks: padded queries get id 0 (zeroed), padded keys id -1.
    """
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    B, L, H, D = query.shape
    S = key.shape[1]
    Lp, Sp = -(-L // _LANES) * _LANES, -(-S // _LANES) * _LANES
    # Eq. 1's 1/sqrt(d_k): the kernel does not scale its scores.
    q = query * jnp.asarray(1.0 / math.sqrt(D), query.dtype)
    q = jnp.swapaxes(_pad_axis(q, 1, Lp, 0), 1, 2)  # [B, H, Lp, Dk]
    k = jnp.swapaxes(_pad_axis(key, 1, Sp, 0), 1, 2)  # [B, K, Sp, Dk]
    v = jnp.swapaxes(_pad_axis(value, 1, Sp, 0), 1, 2)  # [B, K, Sp, Dv]
    segmented = q_seg is not None
    ids = None
    if segmented or (Lp, Sp) != (L, S):
        if not segmented:  # only the block padding to mask
            q_seg, kv_seg = jnp.ones((B, L), jnp.int32), jnp.ones((B, S), jnp.int32)
        q_ids = _pad_axis(q_seg.astype(jnp.int32), 1, Lp, 0)
        kv_ids = _pad_axis(jnp.where(kv_seg == 0, -1, kv_seg).astype(jnp.int32), 1, Sp, -1)
        ids = (q_ids, kv_ids)
    out = _per_device(functools.partial(_splash_call, is_causal=is_causal), q, k, v, ids)
    out = jnp.swapaxes(out, 1, 2)[:, :L]  # [B, L, H, Dv]
    if segmented:  # without segment ids every query sees key 0
        has_key = _has_key(q_seg, kv_seg, is_causal)
        out = jnp.where(has_key[:, :, None, None], out, 0)
    return out.astype(value.dtype)


def _splash_call(q, k, v, ids, *, is_causal: bool) -> Array:
    """[B, H, Lp, Dk], [B, K, Sp, Dk], [B, K, Sp, Dv], ids ([B, Lp], [B, Sp]) or None
    -> [B, H, Lp, Dv]: the kernel vmapped over the batch (it takes one example)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    H, Lp, Sp = q.shape[1], q.shape[2], k.shape[2]

    def block(n: int) -> int:  # larger blocks amortise the per-step overhead
        return next(b for b in (512, 256, 128) if n % b == 0)

    bq, bk = block(Lp), block(Sp)
    sizes = splash.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    static = splash.CausalMask((Lp, Sp)) if is_causal else splash.FullMask((Lp, Sp))
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([static] * H),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=_SPLASH_INTERPRET,
    )
    if ids is None:
        return jax.vmap(kernel)(q, k, v)
    return jax.vmap(kernel)(q, k, v, splash.SegmentIds(*ids))


def _per_device(fn, q, k, v, ids):
    """fn(q, k, v, ids) on each device's part of the batch and heads under the mesh being
    traced for (training sets one), since XLA cannot partition a Mosaic kernel: batch over the
    mesh axes the logical rules give 'batch', heads over those of 'heads' (where they divide).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(q, k, v, ids)
    rules = nn.logical_to_mesh_axes(("batch", "heads")) or (None, None)

    def axes(logical, *sizes):
        names = () if logical is None else (logical,) if isinstance(logical, str) else logical
        names = tuple(a for a in names if a in mesh.axis_names)
        n = math.prod(mesh.shape[a] for a in names)
        return names if names and all(size % n == 0 for size in sizes) else None

    batch = axes(rules[0], q.shape[0])
    heads = axes(rules[1], q.shape[1], k.shape[1])
    qkv = jax.P(batch, heads, None, None)
    id_specs = None if ids is None else (jax.P(batch, None),) * 2
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(qkv, qkv, qkv, id_specs), out_specs=qkv, check_vma=False
    )(q, k, v, ids)


def _pad_axis(x: Array, axis: int, length: int, fill) -> Array:
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=fill)


def _has_key(q_seg: Array, kv_seg: Array, is_causal: bool) -> Array:
    """[B, L] bool: query i has a key j of its own non-zero segment (and j <= i if causal).

    Sorting the key ids finds each segment's first key in O(S log S), never an [L, S] mask.
    """
    order = jnp.argsort(kv_seg, axis=1, stable=True)  # [B, S]: a segment's first key first
    ids = jnp.take_along_axis(kv_seg, order, axis=1)
    at = jax.vmap(jnp.searchsorted)(ids, q_seg)  # [B, L]: where q's id would start
    at = jnp.minimum(at, kv_seg.shape[1] - 1)
    found = (jnp.take_along_axis(ids, at, axis=1) == q_seg) & (q_seg != 0)
    if is_causal:
        first = jnp.take_along_axis(order, at, axis=1)
        found = found & (first <= jnp.arange(q_seg.shape[1])[None, :])
    return found
