"""cuDNN's fused attention (`model.attention_impl` 'cudnn' and its candidates): the masks as a
dense additive bias, bf16/fp16 only, equal key and value head dims.

Shape letters (model/attention.py's): B batch, L query length, S key/value length, H query
heads, K key/value heads, D head dim.

    'cudnn'            jax.nn.dot_product_attention(implementation='cudnn') with the mask
                       broadcast to [B, H, L, S]: the call tests/test_gpu.py checked on a GPU and
                       a GPU timed, so the one 'auto' picks there. jax's backward also writes the
                       gradient of the bias the mask becomes (which the step drops).
    'cudnn_broadcast'  the same call with the mask left [B, 1, L, S] where it has no head axis:
                       cuDNN would broadcast it over heads (an eighth of the bias reads at 8
                       heads). A candidate until a GPU has run its tests and timed it.
    'cudnn_nodbias'    the mask's bias through jax's private cuDNN call asked for no bias
                       gradient (`masked_attention`). A candidate as well: a jax whose public call
                       skips that gradient for a boolean mask makes it unnecessary
                       (benchmarks/cudnn_bias.py --dbias-probe asks the installed jax).

cuDNN leaves a query row with no key to attend to undefined; `attention` returns zeros there,
as every other implementation does.
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp

Array = jax.Array
CALLS = ("cudnn", "cudnn_broadcast", "cudnn_nodbias")


def applies(query: Array, key: Array, value: Array) -> bool:
    """Whether cuDNN's kernel takes these operands: bf16/fp16, value and key head dims equal
    (jax.nn.dot_product_attention's contract), a head dim that is a multiple of 8 up to 128."""
    D = query.shape[-1]
    return (
        query.dtype in (jnp.bfloat16, jnp.float16)
        and value.shape[-1] == key.shape[-1]
        and D % 8 == 0
        and D <= 128
    )


def attention(
    query: Array, key: Array, value: Array, mask: Array | None, bias: Array | None, call: str
) -> Array:
    """query [B, L, H, D], key/value [B, S, K, D] (bf16/fp16), mask bool broadcastable to
    [B, H, L, S], bias float or None -> [B, L, H, D] through the cuDNN call named by `call`
    (one of CALLS)."""
    # No check of jax.default_backend(): a CPU host with CUDA's jaxlib plugin can lower this
    # for 'cuda' (tests/test_lowering.py). Without the plugin jax raises here.
    if value.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"implementation={call!r} (jax.nn.dot_product_attention) needs the value head dim "
            f"equal to the key's; got key {key.shape}, value {value.shape}: use 'xla' or "
            "'chunked' for d_v != d_k"
        )
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"implementation={call!r} (cuDNN's fused attention) needs bfloat16 or float16 "
            f"inputs; got {query.dtype}: set model.dtype=bfloat16, or use 'auto' or 'xla'"
        )
    B, L, H, _ = query.shape
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        heads = mask.shape[1] if call == "cudnn_broadcast" else H
        mask = jnp.broadcast_to(mask, (B, heads, L, key.shape[1]))
    try:
        out = None
        if call == "cudnn_nodbias" and bias is None and mask is not None:
            out = masked_attention(query, key, value, mask)
        if out is None:  # a learned bias keeps its gradient; a jax this was not written for
            out = jax.nn.dot_product_attention(
                query, key, value, bias=bias, mask=mask, implementation="cudnn"
            )
    except RuntimeError as e:  # no CUDA in jaxlib; or run eagerly on a CPU (no lowering rule)
        raise ValueError(
            f"implementation={call!r} runs only on a GPU with cuDNN (jax: {e}); "
            "use 'auto', 'xla' or 'chunked'"
        ) from e
    if mask is not None:  # cuDNN leaves fully masked rows undefined; ours are zeros
        out = jnp.where(jnp.moveaxis(mask.any(-1), 1, 2)[..., None], out, 0)
    return out


# jax's private cuDNN call (custom_vjp) with the parameters `masked_attention` passes
_CORE_ARGS = (
    "query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
    "page_table_k", "page_table_v", "scale", "seed", "dropout_rate", "variadic_args",
    "mask_type", "layout", "sliding_window_length", "cudnn_version", "return_residual",
)  # fmt: skip
_CORE_HELPERS = (
    "combine_bias_and_mask",
    "check_layout",
    "check_cudnn_version",
    "_normalize_layout",
)


def masked_attention(query: Array, key: Array, value: Array, mask: Array) -> Array | None:
    """softmax(q k^T / sqrt(D) + bias) v through cuDNN, the bias 0 where the dense bool mask
    [B, H or 1, L, S] is True and a large negative number elsewhere (jax.nn's 'cudnn' path),
    with no bias gradient. jax.nn.dot_product_attention asks cuDNN's backward for d(bias)
    whatever the bias (`should_export_dbias` answers True in jax 0.10), so each backward call
    writes a [B, H, L, S] array that the step then drops: a mask has no gradient. None where
    jax's private call is not the one this was written against (the caller then uses
    jax.nn.dot_product_attention).

    query [B, L, H, D], key/value [B, S, K, D] in bf16/fp16 -> [B, L, H, D]."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:
        return None
    core = getattr(fa, "_dot_product_attention", None)
    if core is None or not all(hasattr(fa, n) for n in (*_CORE_HELPERS, "MaskType")):
        return None
    try:
        params = tuple(inspect.signature(getattr(core, "fun", core)).parameters)
    except (TypeError, ValueError):
        return None
    if params != _CORE_ARGS:
        return None
    cudnn_version = fa.check_cudnn_version()
    layout = fa._normalize_layout("BTNH")
    bias = fa.combine_bias_and_mask(None, mask, query.dtype)
    fa.check_layout(query, key, value, bias, None, None, None, None, None, None, layout)
    unused = jnp.zeros(0, query.dtype)
    # variadic_args (has_bias, has_dbias) = (True, False): the backward writes dq, dk, dv only
    return core(
        query, key, value, bias, unused, unused, unused, unused, unused, unused,
        1.0 / math.sqrt(query.shape[-1]), 0, 0.0, (True, False), fa.MaskType.NO_MASK,
        layout.value, None, cudnn_version, False,
    )  # fmt: skip
