"""cudnn_masks: segment ids -> cuDNN's packed layout, checked on the CPU against hand-computed
values and against the dense mask it replaces; and cudnn_masks.attention's wrapping (zeroed
padding, NaN for rows the layout cannot express, the gradients) around a stand-in for jax's
cuDNN call that implements its documented contract in XLA. tests/test_gpu.py runs the
kernel itself; tests/test_lowering.py lowers it for 'cuda'."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import reference_attention

from tx_jax.model import attention as A
from tx_jax.model import cudnn_masks as C
from tx_jax.model import masks


def packed_ids(rng, B, length, counts, other_length=None):
    """Rows of ids 1..n (contiguous, in order) then 0s, n = counts[b], as tx_jax's packing
    writes them; with other_length, also a second side holding the same examples (lengths
    drawn afresh: cross-attention's source rows)."""

    def row(n, L):
        ids = np.zeros(L, np.int32)
        if n:
            cuts = np.sort(rng.choice(np.arange(1, L), size=n, replace=False))
            ends = cuts if rng.random() < 0.7 else np.append(cuts[:-1], L)  # some unpadded
            start = 0
            for m, end in enumerate(ends, 1):
                ids[start:end] = m
                start = end
        return ids

    q = np.stack([row(n, length) for n in counts])
    if other_length is None:
        return q
    return q, np.stack([row(n, other_length) for n in counts])


def test_packed_layout_hand_computed():
    seg = jnp.array(
        [
            [1, 1, 2, 2, 2, 3, 0, 0],  # three examples, then padding
            [1, 1, 1, 1, 1, 1, 1, 1],  # one, no padding
            [0, 0, 0, 0, 0, 0, 0, 0],  # all padding
            [1, 1, 1, 0, 0, 0, 0, 0],  # one, padded (an unpacked row)
        ]
    )
    seqlen, offsets, ids, count = (np.asarray(x) for x in C.packed_layout(seg, 4))
    np.testing.assert_array_equal(
        seqlen, [[2, 3, 1, -1], [8, -1, -1, -1], [-1, -1, -1, -1], [3, -1, -1, -1]]
    )
    np.testing.assert_array_equal(
        offsets,
        [[0, 2, 5, -1, -1], [0, -1, -1, -1, -1], [-1, -1, -1, -1, -1], [0, -1, -1, -1, -1]],
    )
    np.testing.assert_array_equal(ids, [[1, 2, 3, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(count, [3, 1, 0, 1])
    assert seqlen.dtype == offsets.dtype == np.int32  # what jax's check_layout demands
    # M = 2 leaves the third run out and says so in count
    seqlen, offsets, _, count = (np.asarray(x) for x in C.packed_layout(seg, 2))
    np.testing.assert_array_equal(seqlen[0], [2, 3])
    np.testing.assert_array_equal(offsets[0], [0, 2, -1])
    assert count[0] == 3


def test_max_segments():
    assert C.max_segments(256, 256) == 32
    assert C.max_segments(8, 100) == 2  # at least 2: M = 1 is not jax's packed layout
    assert C.max_segments(1024, 64) == 8


@pytest.mark.parametrize("case", ["self", "causal", "cross"])
def test_layout_equals_dense_mask_on_random_packed_rows(case):
    rng = np.random.default_rng({"self": 0, "causal": 1, "cross": 2}[case])
    B, L, S = 12, 64, 48
    M = C.max_segments(L, S if case == "cross" else L)
    counts = rng.integers(0, M + 1, size=B)
    counts[:3] = [0, 1, M]  # all padding, one example (an unpacked row), the bound
    causal = case == "causal"
    if case == "cross":
        q_seg, kv_seg = packed_ids(rng, B, L, counts, S)
    else:
        q_seg = kv_seg = packed_ids(rng, B, L, counts)
    q_lay = C.packed_layout(jnp.asarray(q_seg), M)
    kv_lay = C.packed_layout(jnp.asarray(kv_seg), M)
    assert np.asarray(C.layout_matches(q_lay, kv_lay, M, causal)).all()
    got = C.mask_from_layout(
        q_lay[0],
        q_lay[1],
        kv_lay[0],
        kv_lay[1],
        L,
        q_seg.shape[1] if case != "cross" else S,
        is_causal=causal,
    )
    want = masks.dense_mask(
        L,
        kv_seg.shape[1],
        is_causal=causal,
        q_segment_ids=jnp.asarray(q_seg),
        kv_segment_ids=jnp.asarray(kv_seg),
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_rows_the_layout_cannot_express_are_flagged():
    M = 3
    q = jnp.array(
        [
            [1, 1, 2, 2, 0, 0],  # fine
            [1, 2, 1, 0, 0, 0],  # id 1 in two runs
            [1, 2, 3, 4, 0, 0],  # more than M segments
            [1, 1, 2, 2, 0, 0],  # cross: the key side holds other ids
            [1, 1, 2, 2, 0, 0],  # cross: the key side has fewer segments
            [2, 2, 1, 1, 0, 0],  # decreasing ids
        ]
    )
    kv = q.at[3].set(jnp.array([1, 1, 3, 3, 0, 0])).at[4].set(jnp.array([1, 1, 1, 0, 0, 0]))
    self_ok = np.asarray(C.layout_matches(C.packed_layout(q, M), None, M, False))
    np.testing.assert_array_equal(self_ok, [True, False, False, True, True, False])
    cross = C.layout_matches(C.packed_layout(q, M), C.packed_layout(kv, M), M, False)
    np.testing.assert_array_equal(np.asarray(cross), [True, False, False, False, False, False])
    # causal with the segments starting at other positions on the two sides
    kv2 = q.at[0].set(jnp.array([1, 2, 2, 2, 0, 0]))
    causal = C.layout_matches(C.packed_layout(q, M), C.packed_layout(kv2, M), M, True)
    assert not bool(causal[0]) and bool(causal[3])


# ---------------------------------------------------------------- the wrapper, on a CPU


def _fake_cudnn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    q_seqlen=None,
    kv_seqlen=None,
    q_offsets=None,
    kv_offsets=None,
    *,
    scale,
    mask_type,
):
    """jax's packed-layout call as its docstring describes it, in XLA; NaN wherever cuDNN
    writes nothing (outputs and gradients outside every segment), as uninitialised memory
    may hold."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    assert bias is None and mask is None
    assert mask_type in (MaskType.NO_MASK, MaskType.CAUSAL)
    B, L, H, D = query.shape
    S = key.shape[1]
    assert q_seqlen.shape == kv_seqlen.shape and q_offsets.shape == (B, q_seqlen.shape[1] + 1)
    # jax compacts the non-negative entries of all rows together: each row must list as many
    # lengths as offsets, on both sides, or the segments would shift between rows
    for sl, off in ((q_seqlen, q_offsets), (kv_seqlen, kv_offsets)):
        assert bool(jnp.all((sl >= 0).sum(1) == (off >= 0).sum(1)))
    assert bool(jnp.all((q_seqlen >= 0).sum(1) == (kv_seqlen >= 0).sum(1)))
    causal = mask_type == MaskType.CAUSAL
    full = C.mask_from_layout(q_seqlen, q_offsets, kv_seqlen, kv_offsets, L, S, causal)
    q_in = C.mask_from_layout(q_seqlen, q_offsets, q_seqlen, q_offsets, L, L).any(-1)[:, 0]
    kv_in = C.mask_from_layout(kv_seqlen, kv_offsets, kv_seqlen, kv_offsets, S, S).any(-1)[:, 0]

    def ref(q, k, v):
        G = H // k.shape[2]
        k, v = (jnp.repeat(x.astype(jnp.float32), G, axis=2) for x in (k, v))
        s = jnp.einsum("blhd,bshd->bhls", q.astype(jnp.float32), k) * scale
        p = jnp.where(full, jax.nn.softmax(jnp.where(full, s, -1e30), axis=-1), 0.0)
        return jnp.einsum("bhls,bshd->blhd", p, v).astype(q.dtype)

    def unwritten(x, valid):
        return jnp.where(valid[:, :, None, None], x, jnp.nan)

    @jax.custom_vjp
    def call(q, k, v):
        return unwritten(ref(q, k, v), q_in)

    def fwd(q, k, v):
        return call(q, k, v), (q, k, v)

    def bwd(res, g):
        g = jnp.where(q_in[:, :, None, None], g, 0)
        dq, dk, dv = jax.vjp(ref, *res)[1](g)
        return unwritten(dq, q_in), unwritten(dk, kv_in), unwritten(dv, kv_in)

    call.defvjp(fwd, bwd)
    return call(query, key, value)


@pytest.fixture
def fake_cudnn(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "dot_product_attention", _fake_cudnn)
    monkeypatch.setattr(C, "packed_supported", lambda head_dim: True)


@pytest.mark.parametrize("case", ["self", "causal", "cross", "gqa"])
def test_wrapper_matches_dense_reference(fake_cudnn, case):
    rng = np.random.default_rng(10 + ["self", "causal", "cross", "gqa"].index(case))
    B, L, S, H, D = 5, 40, 32, 4, 16
    K = 2 if case == "gqa" else H
    causal = case == "causal"
    M = C.max_segments(L, S if case == "cross" else L)
    counts = np.array([0, 1, M, 2, 3])
    if case == "cross":
        q_seg, kv_seg = (jnp.asarray(x) for x in packed_ids(rng, B, L, counts, S))
    else:
        q_seg = kv_seg = jnp.asarray(packed_ids(rng, B, L, counts))
    S_ = kv_seg.shape[1]
    q, k, v = (
        jnp.asarray(rng.normal(size=(B, n, h, D)), jnp.float32)
        for n, h in ((L, H), (S_, K), (S_, K))
    )
    w = jnp.asarray(rng.normal(size=(B, L, H, D)), jnp.float32)

    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return (out * w).sum(), out

    native = functools.partial(
        C.attention, is_causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg
    )
    dense = functools.partial(
        A.dot_product_attention,
        is_causal=causal,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        implementation="xla",
        precision="highest",
    )
    (_, out), grads = jax.value_and_grad(functools.partial(loss, native), (0, 1, 2), has_aux=True)(
        q, k, v
    )
    (_, ref), ref_grads = jax.value_and_grad(
        functools.partial(loss, dense), (0, 1, 2), has_aux=True
    )(q, k, v)
    mask = masks.dense_mask(L, S_, is_causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    ref64, _ = reference_attention(q, k, v, np.asarray(mask))
    np.testing.assert_allclose(np.asarray(out), ref64, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(q_seg) == 0], 0.0)
    np.testing.assert_array_equal(np.asarray(out)[0], 0.0)  # a row of padding only
    for name, g, r in zip("qkv", grads, ref_grads):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, err_msg=name)


def test_wrapper_poisons_rows_it_cannot_express(fake_cudnn):
    B, L, H, D = 3, 16, 2, 8
    seg = np.ones((B, L), np.int32)
    seg[1, 4:8] = 2
    seg[1, 8:12] = 1  # id 1 in two runs: the dense mask joins them, the layout would not
    seg[2, 12:] = 0
    q = jnp.asarray(np.random.default_rng(0).normal(size=(B, L, H, D)), jnp.float32)
    seg = jnp.asarray(seg)
    out = np.asarray(C.attention(q, q, q, False, seg, seg))
    assert np.isfinite(out[[0, 2]]).all() and np.isnan(out[1]).all()


def test_choice_without_a_known_gpu_is_the_dense_fallback():
    """On this CPU host no GPU is known (no mesh, no local GPU): segment ids keep today's
    dense mask; causal-only and unmasked calls need no capability."""
    assert C.capability() is None
    assert not C.packed_supported(64)
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    seg = jnp.ones((1, 8), jnp.int32)
    assert C.attention(q, q, q, False, seg, seg) is None
