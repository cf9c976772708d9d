"""Which attention implementation runs (`model.attention_impl`), and the call to each kernel;
model/attention.py computes 'xla', the reference, itself and asks here for the others.

    'xla'              einsum, softmax, einsum (model/attention.py): the reference every other
                       implementation is tested against.
    'chunked'          online softmax over key blocks with a FlashAttention-style custom VJP
                       (flash.py): memory linear in S, and on XLA:CPU faster than 'xla' at long
                       keys; elsewhere a memory lever. No bias.
    'cudnn'            cuDNN's fused attention through jax.nn (cudnn.py): GPU, bf16/fp16.
    'cudnn_broadcast', 'cudnn_nodbias'
                       GPU candidates (cudnn.py): asked for by name, timed against 'cudnn' by
                       benchmarks/gpu_speed.sh.
    'splash'           JAX's Pallas TPU kernel (splash.py): a TPU candidate, asked for by name.
    'auto'             by platform (`choose`): a value only where it passed its tests on that
                       platform and a timed run there found it fastest (docs/design.md,
                       "Implementation choices: one rule"):
                         cpu  'chunked' from CHUNKED_FROM keys, else 'xla'
                         gpu  'cudnn' where cudnn.applies (and not in XLA's deterministic mode,
                              where cuDNN's attention fails), else 'xla'
                         tpu  'xla'
                       and 'xla' whenever the weights are returned or a bias rules the others out.
"""

from __future__ import annotations

import jax

from tx_jax.ops import backend, cudnn, splash
from tx_jax.ops.flash import flash_attention
from tx_jax.ops.masks import dense_mask

Array = jax.Array
IMPLEMENTATIONS = (
    "auto", "xla", "chunked", "cudnn", "cudnn_broadcast", "cudnn_nodbias", "splash"
)  # fmt: skip
CHUNKED_FROM = 2048  # keys: from here the L x S scores dominate XLA:CPU's memory and time


def choose(
    impl: str,
    query: Array,
    key: Array,
    value: Array,
    *,
    dropout: bool = False,
    weights: bool = False,
    bias: bool = False,
    platform: str | None = None,
) -> str:
    """`impl` checked, 'auto' resolved for `platform` (default backend.current()); `dropout`,
    `weights`, `bias`: attention dropout, returned weights, an additive bias are asked for."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={impl!r}; expected one of {IMPLEMENTATIONS}")
    if impl in cudnn.CALLS and backend.deterministic_ops():
        raise ValueError(
            f"implementation={impl!r}: cuDNN's fused attention fails under XLA_FLAGS="
            f"{backend.DETERMINISTIC_FLAG} (train.deterministic); use 'auto' or 'xla'"
        )
    if impl != "auto":
        return impl
    platform = platform or backend.current()
    if weights:
        return "xla"
    if (
        platform == "gpu"
        and not dropout
        and not backend.deterministic_ops()
        and cudnn.applies(query, key, value)
    ):
        return "cudnn"
    if platform == "cpu" and key.shape[1] >= CHUNKED_FROM and not bias:
        return "chunked"
    return "xla"


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
    """The kernel `impl` (any value of IMPLEMENTATIONS but 'auto' and 'xla') over [B, L, H, Dk]
    queries and [B, S, K, Dk] / [B, S, K, Dv] keys and values -> [B, L, H, Dv]. `drop`:
    (rate, rng, kernels, dropout_bits) of the weights' dropout, or None."""
    given = {"mask": mask is not None, "bias": bias is not None, "dropout": drop is not None}
    if impl == "splash":
        _refuse(impl, given, "mask", "bias", "dropout")
        return splash.attention(query, key, value, is_causal, q_segment_ids, kv_segment_ids)
    if impl == "chunked":
        _refuse(impl, given, "bias")
        rate, rng, kernels, bits = drop if drop is not None else (0.0, None, "auto", "auto")
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
            kernels=kernels,
            dropout_bits=bits,
        )
    if impl not in cudnn.CALLS:
        raise ValueError(f"implementation={impl!r} is computed by model/attention.py, not here")
    _refuse(impl, given, "dropout")
    full = dense_mask(
        query.shape[1],
        key.shape[1],
        mask=mask,
        is_causal=is_causal,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    return cudnn.attention(query, key, value, full, bias, impl)


def _refuse(impl: str, given: dict[str, bool], *unsupported: str) -> None:
    named = [name for name in unsupported if given[name]]
    if named:
        raise ValueError(
            f"implementation={impl!r} does not support {', '.join(named)}: use 'xla'"
            + (", or is_causal/segment ids" if "mask" in named else "")
        )
