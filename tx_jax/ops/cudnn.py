"""cuDNN's fused attention (`model.attention_impl='cudnn'`): jax.nn.dot_product_attention's
cuDNN call with the masks as a dense additive bias broadcast to [B, H, L, S], bf16/fp16 only,
equal key and value head dims: the call tests/test_gpu.py checked on a GPU and a GPU timed.
jax's backward also writes the gradient of the bias the mask becomes (which the step drops).

Shape letters (model/attention.py's): B batch, L query length, S key/value length, H query
heads, K key/value heads, D head dim.

cuDNN leaves a query row with no key to attend to undefined; `attention` returns zeros there,
as every other implementation does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def applies(dtype, head_dim: int, value_head_dim: int) -> bool:
    """Whether cuDNN's kernel takes a model's operands: bf16/fp16, value and key head dims
    equal (jax.nn.dot_product_attention's contract), a head dim a multiple of 8 up to 128."""
    return (
        jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        and value_head_dim == head_dim
        and head_dim % 8 == 0
        and head_dim <= 128
    )


def attention(
    query: Array, key: Array, value: Array, mask: Array | None, bias: Array | None
) -> Array:
    """query [B, L, H, D], key/value [B, S, K, D] (bf16/fp16), mask bool broadcastable to
    [B, H, L, S], bias float or None -> [B, L, H, D] through cuDNN."""
    # No check of jax.default_backend(): a CPU host with CUDA's jaxlib plugin can lower this
    # for 'cuda' (tests/test_lowering.py). Without the plugin jax raises here.
    if value.shape[-1] != key.shape[-1]:
        raise ValueError(
            "implementation='cudnn' (jax.nn.dot_product_attention) needs the value head dim "
            f"equal to the key's; got key {key.shape}, value {value.shape}: use 'xla' or "
            "'chunked' for d_v != d_k"
        )
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            "implementation='cudnn' (cuDNN's fused attention) needs bfloat16 or float16 "
            f"inputs; got {query.dtype}: set model.dtype=bfloat16, or use 'auto' or 'xla'"
        )
    B, L, H, _ = query.shape
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        mask = jnp.broadcast_to(mask, (B, H, L, key.shape[1]))
    try:
        out = jax.nn.dot_product_attention(
            query, key, value, bias=bias, mask=mask, implementation="cudnn"
        )
    except RuntimeError as e:  # no CUDA in jaxlib; or run eagerly on a CPU (no lowering rule)
        raise ValueError(
            f"implementation='cudnn' runs only on a GPU with cuDNN (jax: {e}); "
            "use 'auto', 'xla' or 'chunked'"
        ) from e
    if mask is not None:  # cuDNN leaves fully masked rows undefined; ours are zeros
        out = jnp.where(jnp.moveaxis(mask.any(-1), 1, 2)[..., None], out, 0)
    return out
