"""The attention kernels other than the reference (`model.attention_impl`, a concrete value:
ModelConfig.resolved says which runs on each platform); model/attention.py computes 'xla', the
reference, itself and calls `attend` for the others.

    'xla'      einsum, softmax, einsum (model/attention.py): the reference every other
               implementation is tested against.
    'chunked'  online softmax over key blocks with a FlashAttention-style custom VJP
               (flash.py): memory linear in S, and on XLA:CPU faster than 'xla' at long keys;
               elsewhere a memory lever. No bias.
    'cudnn'    cuDNN's fused attention through jax.nn (cudnn.py): GPU, bf16/fp16.
    'splash'   JAX's Pallas TPU kernel (splash.py): long context on TPUs.
"""

from __future__ import annotations

import jax

from tx_jax.ops import cudnn, splash
from tx_jax.ops.flash import flash_attention
from tx_jax.ops.masks import dense_mask

Array = jax.Array
IMPLEMENTATIONS = ("xla", "chunked", "cudnn", "splash")


def attend(
    impl: str,
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None,
    bias: Array | None,
    is_causal: bool,
    q_segment_ids: Array | None,
    kv_segment_ids: Array | None,
    drop: tuple | None,
    chunk_size: int,
    precision,
) -> Array:
    """The kernel `impl` ('chunked', 'cudnn' or 'splash') over [B, L, H, Dk] queries and
    [B, S, K, Dk] / [B, S, K, Dv] keys and values -> [B, L, H, Dv]. `drop`: (rate, rng,
    dropout_bits) of the weights' dropout, or None."""
    given = {"mask": mask is not None, "bias": bias is not None, "dropout": drop is not None}
    if impl == "splash":
        _refuse(impl, given, "mask", "bias", "dropout")
        return splash.attention(query, key, value, is_causal, q_segment_ids, kv_segment_ids)
    if impl == "chunked":
        _refuse(impl, given, "bias")
        rate, rng, bits = drop if drop is not None else (0.0, None, "bernoulli")
        return flash_attention(
            query,
            key,
            value,
            mask=mask,
            is_causal=is_causal,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            dropout_rate=rate,
            dropout_rng=rng,
            chunk_size=chunk_size,
            precision=precision,
            dropout_bits=bits,
        )
    if impl != "cudnn":
        raise ValueError(f"implementation={impl!r}; expected one of {IMPLEMENTATIONS}")
    _refuse(impl, given, "dropout")
    full = dense_mask(
        query.shape[1],
        key.shape[1],
        mask=mask,
        is_causal=is_causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    return cudnn.attention(query, key, value, full, bias)


def _refuse(impl: str, given: dict[str, bool], *unsupported: str) -> None:
    named = [name for name in unsupported if given[name]]
    if named:
        raise ValueError(
            f"implementation={impl!r} does not support {', '.join(named)}: use 'xla'"
            + (", or is_causal/segment ids" if "mask" in named else "")
        )
