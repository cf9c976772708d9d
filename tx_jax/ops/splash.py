"""JAX's splash attention kernel (Pallas, TPU: block-sparse flash attention) as
`model.attention_impl='splash'`: a kernel JAX ships and tests on TPUs, wrapped thinly for long
context there; asked for by name ('auto' keeps to 'xla' until a TPU has timed it here).

Shape letters (model/attention.py's): B batch, L query length, S key/value length, H query
heads, K key/value heads, Dk/Dv head dims; Lp, Sp the lengths padded to whole blocks.

It takes the structured masks only (is_causal, segment ids); no dense mask, bias, dropout or
returned weights. Under a mesh the kernel runs per device in a shard_map (XLA cannot partition
a Mosaic kernel). tests/test_attention_splash.py runs it in Pallas' interpreter on a CPU
(`_INTERPRET`, set by the tests only) and compiles it for a v5e from a CPU host.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
LANES = 128  # splash's block lengths are multiples of the TPU's 128 lanes
# Pallas interpret mode, so that tests run the TPU kernel on a CPU; tests set it (monkeypatch),
# nothing else does: on a TPU the kernel must compile to Mosaic.
_INTERPRET = False


def attention(query, key, value, is_causal, q_seg, kv_seg):
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
    Lp, Sp = -(-L // LANES) * LANES, -(-S // LANES) * LANES
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
        interpret=_INTERPRET,
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
