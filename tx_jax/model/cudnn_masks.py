"""The structured masks (attention.py's is_causal and segment ids) in cuDNN's own terms, so
that its fused attention reads no [B, H, L, S] bias.

Shape letters: B batch, L query length, S key/value length, H query heads, K key/value
heads, D head dim, M the static bound on segments per row (`max_segments`).

    causal only                 -> cuDNN's causal mask type; no array
    segment ids (packing, pads) -> the packed ("ragged") layout of
                                   jax._src.cudnn.fused_attention_stablehlo.dot_product_attention:
                                   per row, the length [B, M] and start [B, M + 1] of each
                                   segment, -1 past the row's last; compute capability >= 9.0

A segment is a run of equal non-zero ids. The packed layout equals the dense mask
(masks.dense_mask) when, in every row,
  - each id forms one run: the runs' ids increase (tx_jax's packing numbers them 1, 2, ...,
    padding 0; an unpacked row is ids 1 then 0s: real tokens first, as tx_jax's batches are);
  - query and key rows hold the same ids in the same order (cross-attention: targets and
    inputs of the same examples), and with is_causal each segment starts at the same position
    on both sides (causal counts from the segment's start in cuDNN, from 0 in the dense mask);
  - at most M segments.
A row that breaks one of these comes out NaN rather than silently different: values are not
known when the program is traced, and a training step skips and counts non-finite updates.
Padding positions (id 0) come out as zeros, with zero gradients, as the dense path gives them.
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp

Array = jax.Array
# cuDNN's packed layout needs Hopper, and cuDNN 9.6 (jax's own test of it skips below)
_PACKED_CAPABILITY = (9, 0)
_PACKED_CUDNN = 90600
# Compute capability that jax's check answers with on a host without a GPU (see _shim_check)
# The keywords cudnn_masks.attention passes to jax's private call
_CALL_ARGS = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type")
_CROSS_TARGET: list[tuple[int, int] | None] = [None]


def max_segments(query_length: int, key_length: int) -> int:
    """M, the bound on segments per row: one per 8 tokens, at least 2 (M = 1 is not the
    packed layout for jax). The softmax statistics cuDNN keeps for the backward pass are
    [B * M, H, L] float32, so M = L would cost more than the bias it replaces; a packed row
    of WMT pairs averages ~30 tokens per example."""
    return max(2, min(query_length, key_length) // 8)


def packed_layout(segment_ids: Array, num_segments: int) -> tuple[Array, Array, Array, Array]:
    """Segment ids [B, L] (0 = padding) -> the packed layout of its runs of equal non-zero ids.

    Returns:
      seqlen [B, M] int32: each run's length, -1 past the row's last run;
      offsets [B, M + 1] int32: each run's first position, -1 past the row's last run;
      ids [B, M] int32: each run's id, 0 past the row's last run;
      count [B] int32: runs in the row (may exceed M: those past M are left out).
    """
    B, L = segment_ids.shape
    M = num_segments
    seg = segment_ids.astype(jnp.int32)
    prev = jnp.pad(seg, ((0, 0), (1, 0)))[:, :-1]
    starts = (seg != 0) & (seg != prev)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # [B, L]: run of each token
    slot = jnp.where((seg != 0) & (run < M), run, M)  # M: dropped (padding or past M)
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, L))
    # Scatters: O(L) per row, where comparing every id with every slot would be O(L * M).
    length = jnp.zeros((B, M + 1), jnp.int32).at[rows, slot].add(1)[:, :M]
    first = jnp.full((B, M + 1), L, jnp.int32).at[rows, slot].min(pos)[:, :M]
    ids = jnp.zeros((B, M + 1), jnp.int32).at[rows, slot].max(seg)[:, :M]
    count = starts.sum(axis=1, dtype=jnp.int32)
    present = jnp.arange(M)[None, :] < count[:, None]
    seqlen = jnp.where(present, length, -1)
    offsets = jnp.pad(jnp.where(present, first, -1), ((0, 0), (0, 1)), constant_values=-1)
    return seqlen, offsets, ids, count


def layout_matches(
    q_layout: tuple, kv_layout: tuple | None, num_segments: int, is_causal: bool
) -> Array:
    """[B] bool: the row's packed layout equals its dense mask (module docstring).
    kv_layout None: self-attention over the same ids."""
    _, q_off, q_ids, q_count = q_layout
    ok = (q_count <= num_segments) & _increasing(q_ids, q_count)
    if kv_layout is None:
        return ok
    _, kv_off, kv_ids, kv_count = kv_layout
    ok = ok & (kv_count == q_count) & jnp.all(kv_ids == q_ids, axis=1)
    if is_causal:
        ok = ok & jnp.all(kv_off == q_off, axis=1)
    return ok


def _increasing(ids: Array, count: Array) -> Array:
    later = jnp.arange(1, ids.shape[1])[None, :] < count[:, None]
    return jnp.all(~later | (ids[:, 1:] > ids[:, :-1]), axis=1)


def mask_from_layout(
    q_seqlen: Array,
    q_offsets: Array,
    kv_seqlen: Array,
    kv_offsets: Array,
    L: int,
    S: int,
    is_causal: bool = False,
) -> Array:
    """The [B, 1, L, S] bool mask that a packed layout means to cuDNN: query i and key j in
    segment m of their rows (causal: j - kv start <= i - q start). For tests, against
    masks.dense_mask."""

    def member(seqlen, offsets, n):  # [B, n, M]: position in segment m
        start, length = offsets[:, None, :-1], seqlen[:, None, :]
        p = jnp.arange(n)[None, :, None]
        return (length > 0) & (p >= start) & (p < start + length), p - start

    q_in, q_rel = member(q_seqlen, q_offsets, L)
    kv_in, kv_rel = member(kv_seqlen, kv_offsets, S)
    both = q_in[:, :, None, :] & kv_in[:, None, :, :]  # [B, L, S, M]
    if is_causal:
        both = both & (kv_rel[:, None, :, :] <= q_rel[:, :, None, :])
    return both.any(-1)[:, None]


# ---------------------------------------------------------------- the cuDNN call


def capability() -> tuple[int, int] | None:
    """The compute capability of the GPU a step is traced for: the mesh's devices (jax.set_mesh:
    a training run's GPUs, or tx_jax.planning's compile-only devices of its target chip), else
    this host's first GPU; None without either."""
    devices = []
    try:  # private, but the one way to see the mesh's devices inside jit
        from jax._src.mesh import get_concrete_mesh

        mesh = get_concrete_mesh()
        if mesh is not None and not mesh.empty:
            devices = list(mesh.devices.flat)
    except (ImportError, AttributeError):
        pass
    if not devices:
        try:
            devices = jax.devices("gpu")
        except RuntimeError:
            return None
    cc = getattr(devices[0], "compute_capability", None)
    if not isinstance(cc, str):
        return None
    try:
        return tuple(int(x) for x in cc.split(".")[:2])
    except ValueError:
        return None


def packed_supported(head_dim: int) -> bool:
    """Whether the packed layout applies to the chip traced for (jax's own conditions,
    checked against that chip rather than this host's)."""
    cc = capability()
    if cc is None or cc < _PACKED_CAPABILITY or head_dim % 8 or head_dim > 256:
        return False
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:
        return False
    if not all(hasattr(fa, n) for n in ("dot_product_attention", "MaskType")):
        return False
    params = inspect.signature(fa.dot_product_attention).parameters
    if not set(_CALL_ARGS) <= set(params):  # a jax whose private API moved on
        return False
    try:
        if fa.check_cudnn_version() < _PACKED_CUDNN:
            return False
    except RuntimeError:
        return False
    # a CPU host compiling for the GPU (planning): see _shim_check
    return _local_cuda() or _shim_check(fa, cc)


def _local_cuda() -> bool:
    try:
        from jax._src import xla_bridge

        return "cuda" in xla_bridge.get_backend().platform_version
    except Exception:  # no backend at all: not CUDA
        return False


def _shim_check(fa, cc: tuple[int, int]) -> bool:
    """jax refuses the packed layout unless *this host's* GPU is Hopper or later
    (check_compute_capability reads the local backend), which a CPU host compiling for a GPU
    does not have. There, and only there, answer its check for the chip compiled for; False
    where jax's check is not the function this was written against."""
    check = fa.check_compute_capability
    original = getattr(check, "__tx_jax_original__", check)
    try:
        original("9.0")  # the signature this shim replaces
    except TypeError:
        return False
    _CROSS_TARGET[0] = cc

    def shimmed(capability: str) -> bool:
        if _local_cuda():
            return original(capability)
        target = _CROSS_TARGET[0]
        want = tuple(int(x) for x in capability.split("."))
        return target is not None and target >= want

    shimmed.__tx_jax_original__ = original
    fa.check_compute_capability = shimmed
    return True


def attention(
    query: Array,
    key: Array,
    value: Array,
    is_causal: bool,
    q_segment_ids: Array | None,
    kv_segment_ids: Array | None,
) -> Array | None:
    """softmax(q k^T / sqrt(D)) v through cuDNN with the masks in its native form; None where
    that form does not apply (the caller then builds the dense mask).

    query [B, L, H, D], key/value [B, S, K, D] in bf16/fp16 -> [B, L, H, D]."""
    if q_segment_ids is None and kv_segment_ids is None:
        return jax.nn.dot_product_attention(
            query, key, value, is_causal=is_causal, implementation="cudnn"
        )
    if q_segment_ids is None or kv_segment_ids is None:
        return None
    if not packed_supported(query.shape[-1]):
        return None
    from jax._src.cudnn import fused_attention_stablehlo as fa

    L, S = query.shape[1], key.shape[1]
    M = max_segments(L, S)
    q_layout = packed_layout(q_segment_ids, M)
    same = kv_segment_ids is q_segment_ids  # self-attention: one layout for both sides
    kv_layout = q_layout if same else packed_layout(kv_segment_ids, M)
    ok = layout_matches(q_layout, None if same else kv_layout, M, is_causal)
    q_valid = q_segment_ids != 0
    kv_valid = kv_segment_ids != 0
    # cuDNN writes neither outputs nor gradients at positions outside every segment: their
    # gradients are zeroed on the way back (a select on the inputs instead costs the plan's
    # HBM floor ~4%: a pass over q, k and v forward as well).
    q = _zero_grad_where(query, ~q_valid)
    k = _zero_grad_where(key, ~kv_valid)
    v = _zero_grad_where(value, ~kv_valid)
    mask_type = fa.MaskType.CAUSAL if is_causal else fa.MaskType.NO_MASK
    out = fa.dot_product_attention(
        q,
        k,
        v,
        q_seqlen=q_layout[0],
        kv_seqlen=kv_layout[0],
        q_offsets=q_layout[1],
        kv_offsets=kv_layout[1],
        scale=1.0 / math.sqrt(query.shape[-1]),
        mask_type=mask_type,
    )
    out = jnp.where(q_valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    return jnp.where(ok[:, None, None, None], out, jnp.asarray(jnp.nan, out.dtype))


@jax.custom_vjp
def _zero_grad_where(x: Array, outside: Array) -> Array:
    """x [B, T, ...] unchanged; its gradient zero where outside [B, T]."""
    return x


def _zero_grad_fwd(x, outside):
    return x, outside


def _zero_grad_bwd(outside, g):
    zero = jnp.zeros((), g.dtype)
    where = outside.reshape(outside.shape + (1,) * (g.ndim - outside.ndim))
    return jnp.where(where, zero, g), None


_zero_grad_where.defvjp(_zero_grad_fwd, _zero_grad_bwd)


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
    whatever the bias (`should_export_dbias` answers True in jax 0.10; older jax asked only for
    a [1, H, L, S] one), so each backward call writes a [B, H, L, S] array that the step then
    drops: a mask has no gradient. None where jax's private call is not the one this was
    written against (the caller then uses jax.nn.dot_product_attention).

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
