"""dot_product_attention, the mask helpers, and MultiHeadAttention."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import reference_attention

from tx_jax.model import attention as A
from tx_jax.model.multihead import MultiHeadAttention
from tx_jax.ops import masks

IMPLS = ["xla", "chunked"]


def _one_query_attention(q, k, v):
    """Attention of one query over a few keys: [D], [S, D], [S, Dv] -> weights, output."""
    out, w = A.dot_product_attention(
        jnp.asarray(q, jnp.float32)[None, None, None],
        jnp.asarray(k, jnp.float32)[None, :, None],
        jnp.asarray(v, jnp.float32)[None, :, None],
        implementation="xla",
        return_weights=True,
    )
    return np.asarray(w[0, 0, 0], np.float64), np.asarray(out[0, 0, 0], np.float64)


def _exact_softmax(scores):
    e = np.exp(np.asarray(scores, np.float64) - np.max(scores))
    return e / e.sum()


def test_worked_example_of_the_attention_article():
    """Section 4.1-4.2: q=[.1,.2,.3], k1=[.4,.5,.6], k2=[.7,.8,.9], d_k=3.

    The article prints raw scores 0.38 and 0.65, but its own products give
    0.1*0.4 + 0.2*0.5 + 0.3*0.6 = 0.32 and 0.1*0.7 + 0.2*0.8 + 0.3*0.9 = 0.50: an arithmetic
    slip. We assert the exact values of the vectors, and separately the article's chain
    from its stated scores (0.38, 0.65 -> ~0.22, ~0.38 -> softmax), both computed exactly.
    """
    q = np.array([0.1, 0.2, 0.3])
    k = np.array([[0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    v = np.array([[1.0, 0.0, 2.0], [0.0, 3.0, -1.0]])
    np.testing.assert_allclose(k @ q, [0.32, 0.50], rtol=1e-12)
    w, out = _one_query_attention(q, k, v)
    exact = _exact_softmax(np.array([0.32, 0.50]) / np.sqrt(3.0))
    np.testing.assert_allclose(exact, [0.4740426, 0.5259574], atol=1e-7)
    np.testing.assert_allclose(w, exact, rtol=1e-6)
    # log(w2 / w1) recovers the scaled score difference (0.50 - 0.32) / sqrt(3)
    np.testing.assert_allclose(np.log(w[1] / w[0]), 0.18 / np.sqrt(3.0), rtol=1e-5)
    np.testing.assert_allclose(out, exact @ v, rtol=1e-6)

    # The article's figures: keys along q's direction with raw scores exactly 0.38 and 0.65.
    q_a = np.array([1.0, 0.0, 0.0])
    k_a = np.array([[0.38, 0.0, 0.0], [0.65, 0.0, 0.0]])
    scaled = np.array([0.38, 0.65]) / np.sqrt(3.0)
    np.testing.assert_allclose(scaled, [0.22, 0.38], atol=6e-3)  # the article's rounding
    np.testing.assert_allclose(np.exp(scaled), [1.25, 1.46], atol=6e-3)  # its exp() figures
    w_a, out_a = _one_query_attention(q_a, k_a, v)
    exact_a = _exact_softmax(scaled)
    np.testing.assert_allclose(exact_a, [0.4611076, 0.5388924], atol=1e-7)
    np.testing.assert_allclose(w_a, exact_a, rtol=1e-6)
    np.testing.assert_allclose(out_a, exact_a @ v, rtol=1e-6)


def test_mask_helpers_values():
    np.testing.assert_array_equal(masks.causal_mask(3)[0, 0], [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(masks.causal_mask(1, 4, offset=2)[0, 0], [[1, 1, 1, 0]])
    pm = masks.padding_mask(jnp.array([[True, False]]), jnp.array([[True, True, False]]))
    np.testing.assert_array_equal(pm[0, 0], [[1, 1, 0], [0, 0, 0]])
    sm = masks.segment_mask(jnp.array([[1, 1, 2, 0]]), jnp.array([[1, 2, 2, 0]]))
    np.testing.assert_array_equal(
        sm[0, 0], [[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]]
    )
    both = masks.combine_masks(None, sm, masks.causal_mask(4))
    np.testing.assert_array_equal(
        both[0, 0], [[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]]
    )
    assert masks.combine_masks(None, None) is None


def _random_problem(rng, B=2, L=13, S=37, H=4, K=2, D=8, Dv=None):
    q = rng.normal(size=(B, L, H, D)).astype(np.float32)
    k = rng.normal(size=(B, S, K, D)).astype(np.float32)
    v = rng.normal(size=(B, S, K, Dv or D)).astype(np.float32)
    kv_len = rng.integers(1, S + 1, size=B)
    q_len = rng.integers(1, L + 1, size=B)
    kv_seg = (np.arange(S)[None] < kv_len[:, None]).astype(np.int32)
    q_seg = (np.arange(L)[None] < q_len[:, None]).astype(np.int32)
    return q, k, v, q_seg, kv_seg


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_float64_reference(rng, impl, causal):
    q, k, v, q_seg, kv_seg = _random_problem(rng, L=37 if causal else 13)
    L, S = q.shape[1], k.shape[1]
    bias = None  # an additive bias: 'xla' (and cuDNN) only
    if impl == "xla":
        bias = rng.normal(size=(1, q.shape[2], L, S)).astype(np.float32)
    out = A.dot_product_attention(
        q,
        k,
        v,
        bias=bias,
        is_causal=causal,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        implementation=impl,
        chunk_size=8,
    )
    mask = masks.dense_mask(L, S, is_causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    ref, _ = reference_attention(q, k, v, np.asarray(mask), bias)
    err = np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err


@pytest.mark.parametrize("impl", IMPLS)
def test_dense_mask_argument_matches_reference(rng, impl):
    q, k, v, _, _ = _random_problem(rng)
    mask = rng.random((2, 4, 13, 37)) > 0.3
    out = A.dot_product_attention(q, k, v, mask=mask, implementation=impl, chunk_size=16)
    ref, _ = reference_attention(q, k, v, mask)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


MASKINGS = {
    "none": dict(),
    "causal": dict(is_causal=True),
    "padding": dict(segments="padding"),
    "causal+padding": dict(is_causal=True, segments="padding"),
    "packed+causal": dict(is_causal=True, segments="packed"),
    "dense": dict(dense=True),
    "dense+causal+padding": dict(dense=True, is_causal=True, segments="padding"),
}


def _masking_kwargs(rng, name, q_seg, kv_seg, L, S):
    spec = dict(MASKINGS[name])
    kw = {"is_causal": spec.get("is_causal", False)}
    if spec.get("segments") == "padding":
        kw.update(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    elif spec.get("segments") == "packed":  # three packed examples per row, then padding
        n = max(L, S)
        ids = np.repeat(np.array([1, 2, 3, 0], np.int32), -(-n // 4))[None, :n]
        ids = ids.repeat(q_seg.shape[0], 0)
        kw.update(q_segment_ids=ids[:, :L], kv_segment_ids=ids[:, :S])
    if spec.get("dense"):
        kw["mask"] = rng.random((q_seg.shape[0], 1, L, S)) > 0.3
    return kw


@pytest.mark.parametrize("masking", sorted(MASKINGS))
@pytest.mark.parametrize("shape", [dict(L=20, S=20), dict(L=13, S=37), dict(L=29, S=11)])
def test_chunked_gradients_equal_xla(rng, masking, shape):
    """The flash custom VJP (saved output + log-sum-exp, recomputed blocks) gives the dense
    path's gradients, with ragged last blocks (chunk 6 divides none of the lengths)."""
    q, k, v, q_seg, kv_seg = _random_problem(rng, **shape)
    kw = _masking_kwargs(rng, masking, q_seg, kv_seg, shape["L"], shape["S"])
    cot = rng.normal(size=q.shape).astype(np.float32)

    def loss(impl, q, k, v):
        out = A.dot_product_attention(q, k, v, implementation=impl, chunk_size=6, **kw)
        return jnp.sum(out * cot)

    g_xla = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(q, k, v)
    g_chk = jax.jit(jax.grad(lambda *a: loss("chunked", *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_xla, g_chk):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_gradients_with_dropout_equal_autodiff_of_the_same_forward(rng):
    """With dropout the masks differ from 'xla''s, so the custom VJP is checked against
    autodiff through flash.py's own forward pass (the same per-block dropout draws)."""
    from tx_jax.ops import flash

    q, k, v, q_seg, kv_seg = _random_problem(rng, L=17, S=23)
    cot = rng.normal(size=q.shape).astype(np.float32)
    key = jax.random.key(5)
    extras = (None, q_seg, kv_seg, key)
    spec = dict(is_causal=True, q_block=6, k_block=6, rate=0.25, precision=None)

    def custom(q, k, v):
        out = flash.flash_attention(
            q,
            k,
            v,
            is_causal=True,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            dropout_rate=0.25,
            dropout_rng=key,
            chunk_size=6,
        )
        return jnp.sum(out * cot)

    def reference(q, k, v):
        return jnp.sum(flash.reference_forward(spec, q, k, v, extras) * cot)

    np.testing.assert_allclose(custom(q, k, v), reference(q, k, v), rtol=1e-6)
    for a, b in zip(
        jax.grad(custom, argnums=(0, 1, 2))(q, k, v),
        jax.grad(reference, argnums=(0, 1, 2))(q, k, v),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# d_v != d_k (the paper's value and key head dims, Table 3 row B): wider and narrower values.
DVS = [12, 4]  # with Dk = 8
DV_MASKINGS = ["causal+padding", "packed+causal", "dense+causal+padding", "padding"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dv", DVS)
@pytest.mark.parametrize("masking", DV_MASKINGS)
def test_value_head_dim_differs_matches_float64_reference(rng, impl, dv, masking):
    """[B, L, H, Dk] q, [B, S, K, Dk] k, [B, S, K, Dv] v with GQA (H 4, K 2) and ragged blocks:
    the output is [B, L, H, Dv] and equals softmax(q k^T / sqrt(Dk)) v in float64."""
    L, S = 13, 37
    q, k, v, q_seg, kv_seg = _random_problem(rng, L=L, S=S, Dv=dv)
    kw = _masking_kwargs(rng, masking, q_seg, kv_seg, L, S)
    out = A.dot_product_attention(q, k, v, implementation=impl, chunk_size=6, **kw)
    assert out.shape == (2, L, 4, dv)
    mask = masks.dense_mask(L, S, **kw)
    ref, _ = reference_attention(q, k, v, np.asarray(mask))
    err = np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err


@pytest.mark.parametrize("dv", DVS)
def test_value_head_dim_differs_with_bias_matches_float64_reference(rng, dv):
    """A bias with d_v != d_k ('xla'); 'chunked' refuses a bias."""
    q, k, v, q_seg, kv_seg = _random_problem(rng, L=37, Dv=dv)
    bias = rng.normal(size=(1, 4, 37, 37)).astype(np.float32)
    kw = dict(is_causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    ref, _ = reference_attention(q, k, v, np.asarray(masks.dense_mask(37, 37, **kw)), bias)
    out = A.dot_product_attention(q, k, v, bias=bias, implementation="xla", **kw)
    err = np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err
    with pytest.raises(ValueError, match="'chunked' does not support bias"):
        A.dot_product_attention(q, k, v, bias=bias, implementation="chunked", **kw)


@pytest.mark.parametrize("dv", DVS)
@pytest.mark.parametrize("masking", ["causal+padding", "dense+causal+padding"])
def test_value_head_dim_differs_chunked_gradients_equal_xla(rng, dv, masking):
    """The flash custom VJP's dq [.., Dk], dk [.., Dk], dv [.., Dv] equal the dense path's
    (whose forward matches the float64 reference above)."""
    L, S = 13, 37
    q, k, v, q_seg, kv_seg = _random_problem(rng, L=L, S=S, Dv=dv)
    kw = _masking_kwargs(rng, masking, q_seg, kv_seg, L, S)
    cot = rng.normal(size=(2, L, 4, dv)).astype(np.float32)

    def loss(impl, q, k, v):
        out = A.dot_product_attention(q, k, v, implementation=impl, chunk_size=6, **kw)
        return jnp.sum(out * cot)

    g_xla = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(q, k, v)
    g_chk = jax.jit(jax.grad(lambda *a: loss("chunked", *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b, x in zip(g_xla, g_chk, (q, k, v)):
        assert b.shape == x.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dv", DVS)
def test_value_head_dim_differs_with_dropout(rng, dv):
    """Dropout on the weights with d_v != d_k: 'chunked''s custom VJP equals autodiff of its
    own forward, and 'xla' drops whole weights (each output row is a combination of v rows)."""
    from tx_jax.ops import flash

    q, k, v, q_seg, kv_seg = _random_problem(rng, L=17, S=23, Dv=dv)
    cot = rng.normal(size=(2, 17, 4, dv)).astype(np.float32)
    key = jax.random.key(5)
    spec = dict(is_causal=True, q_block=6, k_block=6, rate=0.25, precision=None)
    kw = dict(is_causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg)

    def custom(q, k, v):
        out = A.dot_product_attention(
            q,
            k,
            v,
            dropout_rate=0.25,
            dropout_rng=key,
            deterministic=False,
            implementation="chunked",
            chunk_size=6,
            **kw,
        )
        return jnp.sum(out * cot)

    def reference(q, k, v):
        out = flash.reference_forward(spec, q, k, v, (None, q_seg, kv_seg, key))
        return jnp.sum(out * cot)

    np.testing.assert_allclose(custom(q, k, v), reference(q, k, v), rtol=1e-6)
    for a, b in zip(
        jax.grad(custom, argnums=(0, 1, 2))(q, k, v),
        jax.grad(reference, argnums=(0, 1, 2))(q, k, v),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    out = A.dot_product_attention(
        q, k, v, dropout_rate=0.25, dropout_rng=key, deterministic=False, implementation="xla"
    )
    assert out.shape == (2, 17, 4, dv) and np.isfinite(np.asarray(out)).all()
    assert not np.allclose(out, A.dot_product_attention(q, k, v, implementation="xla"))


def test_cudnn_rejects_a_value_head_dim_differing_from_the_key_and_auto_avoids_it(rng):
    """jax.nn.dot_product_attention needs value.shape == key.shape, so 'cudnn' cannot do
    d_v != d_k: an explicit request is an error naming both shapes, and 'auto' resolved for a
    GPU picks it only when the head dims agree."""
    q, k, v, _, _ = _random_problem(rng, Dv=16)
    with pytest.raises(ValueError, match=r"cudnn.*value head dim.*\(2, 37, 2, 16\)"):
        A.dot_product_attention(q, k, v, implementation="cudnn")
    from tx_jax.model.config import ModelConfig

    cfg = ModelConfig(attention_impl="auto", d_model=64, num_heads=4, dtype="bfloat16")
    assert cfg.resolved("gpu").attention_impl == "cudnn"
    assert cfg.replace(value_head_dim=8).resolved("gpu").attention_impl == "xla"


def test_chunked_backward_memory_is_linear_in_length():
    """XLA's compiled temporary memory for forward+backward at L = 2048 (not a timing)."""
    B, L, H, D = 1, 2048, 2, 16
    q = jnp.zeros((B, L, H, D), jnp.float32)
    seg = jnp.ones((B, L), jnp.int32)

    def temp(impl):
        def loss(q, k, v):
            out = A.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                q_segment_ids=seg,
                kv_segment_ids=seg,
                implementation=impl,
                chunk_size=256,
            )
            return out.sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes

    assert temp("chunked") * 10 < temp("xla")


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_row_gives_zeros_not_nan(rng, impl):
    q, k, v, _, _ = _random_problem(rng, B=1)
    mask = np.ones((1, 1, 13, 37), bool)
    mask[..., 3, :] = False  # query 3 may attend to nothing
    out = A.dot_product_attention(q, k, v, mask=mask, implementation=impl, chunk_size=8)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(out[0, 3], 0.0)
    grad = jax.grad(
        lambda q: A.dot_product_attention(q, k, v, mask=mask, implementation=impl).sum()
    )(q)
    assert np.isfinite(np.asarray(grad)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_segments_equal_separate_sequences(rng, impl):
    """Two sequences packed in one row attend exactly as they would alone."""
    D, H = 8, 2
    x = rng.normal(size=(1, 9, H, D)).astype(np.float32)
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 0, 0]], np.int32)
    packed = A.dot_product_attention(
        x,
        x,
        x,
        is_causal=True,
        q_segment_ids=seg,
        kv_segment_ids=seg,
        implementation=impl,
        chunk_size=4,
    )
    first = A.dot_product_attention(x[:, :4], x[:, :4], x[:, :4], is_causal=True)
    second = A.dot_product_attention(x[:, 4:7], x[:, 4:7], x[:, 4:7], is_causal=True)
    np.testing.assert_allclose(packed[:, :4], first, rtol=1e-5, atol=1e-6)
    # causal positions inside segment 2 are global (4..6), which only shifts the diagonal
    # equally for queries and keys, so the result equals the separate computation.
    np.testing.assert_allclose(packed[:, 4:7], second, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(packed[:, 7:], 0.0)


def test_attention_dropout(rng):
    q, k, v, _, _ = _random_problem(rng)
    kw = dict(dropout_rate=0.5, dropout_rng=jax.random.key(0), implementation="xla")
    same = A.dot_product_attention(q, k, v, deterministic=True, **kw)
    np.testing.assert_allclose(same, A.dot_product_attention(q, k, v), rtol=1e-6)
    _, w = A.dot_product_attention(q, k, v, deterministic=False, return_weights=True, **kw)
    dropped = A.dot_product_attention(q, k, v, deterministic=False, **kw)
    assert not np.allclose(dropped, same)
    for impl in IMPLS:  # inverted dropout keeps the expectation: average over many keys
        # one program over the 64 keys (eagerly, each call would trace and lower its loops)
        outs = jax.jit(
            jax.vmap(
                lambda key, impl=impl: A.dot_product_attention(
                    q,
                    k,
                    v,
                    deterministic=False,
                    dropout_rate=0.3,
                    dropout_rng=key,
                    implementation=impl,
                    chunk_size=8,
                )
            )
        )(jax.random.split(jax.random.key(0), 64))
        mean = np.mean(np.asarray(outs), axis=0)
        assert np.abs(mean - same).mean() < 0.1 * np.abs(same).mean() + 0.02
    with pytest.raises(ValueError, match="dropout_rng"):
        A.dot_product_attention(q, k, v, dropout_rate=0.1, deterministic=False)


def test_attention_dropout_draws_its_bits_where_dropout_bits_says(rng):
    """The weights' dropout follows model.dropout_bits in every implementation: 'xla' drops
    exactly ops.kernels.keep_mask's [B, K, G, L, S] mask of that generator, and the blockwise
    path (flash's custom VJP) gives other draws for another generator."""
    from tx_jax.ops import kernels as K_

    q, k, v, _, _ = _random_problem(rng)
    key, rate = jax.random.key(7), 0.3
    kw = dict(dropout_rate=rate, dropout_rng=key, deterministic=False)
    _, w = A.dot_product_attention(q, k, v, implementation="xla", return_weights=True)
    B, L, H, D = q.shape
    Kh = k.shape[2]
    w = np.asarray(w).reshape(B, Kh, H // Kh, L, -1)
    keep = np.asarray(K_.keep_mask(key, rate, w.shape, "packed"))
    used = np.where(keep, w / (1 - K_.effective_rate(rate, "packed")), 0.0)
    want = np.einsum("bkgls,bskd->blkgd", used, v).reshape(B, L, H, -1)
    got = A.dot_product_attention(q, k, v, implementation="xla", dropout_bits="packed", **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for impl in ("xla", "chunked"):
        outs = [
            A.dot_product_attention(
                q, k, v, implementation=impl, chunk_size=8, dropout_bits=bits, **kw
            )
            for bits in ("packed", "bernoulli")
        ]
        assert not np.allclose(outs[0], outs[1]), impl


def test_bad_arguments_are_named(rng):
    q, k, v, _, _ = _random_problem(rng)
    with pytest.raises(ValueError, match="implementation"):
        A.dot_product_attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="head_dim"):
        A.dot_product_attention(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="divisible"):
        A.dot_product_attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="key .* and value .*: batch, length or kv heads"):
        A.dot_product_attention(q, k, v[:, :5])
    with pytest.raises(ValueError, match="return_weights"):
        A.dot_product_attention(q, k, v, implementation="chunked", return_weights=True)
    with pytest.raises(ValueError, match="needs bfloat16 or float16 inputs; got float32"):
        A.dot_product_attention(q, k, v, implementation="cudnn")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU"):
            bf16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
            A.dot_product_attention(*bf16, implementation="cudnn")


def _mha_params(module, x, kv=None):
    return module.init(jax.random.key(0), x, kv)["params"]


@pytest.mark.parametrize("value_head_dim", [None, 6])
def test_multihead_equals_concat_of_heads_times_wo(rng, value_head_dim):
    """MultiHead(Q,K,V) = Concat(head_1..head_h) W^O, each head from its own W_i^Q/K/V; with
    value_head_dim, W_i^V is M x d_v and W^O (H d_v) x M while d_k (and the scale) stay."""
    B, L, S, M, H = 2, 5, 7, 16, 4
    D = M // H
    Dv = value_head_dim or D
    x = jnp.asarray(rng.normal(size=(B, L, M)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(B, S, M)), jnp.float32)
    mha = MultiHeadAttention(
        num_heads=H, value_head_dim=value_head_dim, use_bias=True, implementation="xla"
    )
    params = nn.meta.unbox(_mha_params(mha, x, y))
    assert params["key_kernel"].shape == (M, H, D)
    assert params["value_kernel"].shape == (M, H, Dv) and params["value_bias"].shape == (H, Dv)
    assert params["out_kernel"].shape == (H, Dv, M)
    # give the biases non-zero values so that they are checked too
    params = jax.tree_util.tree_map(lambda p: p + 0.1 * jnp.ones_like(p), params)
    out = mha.apply({"params": params}, x, y)
    p = jax.tree_util.tree_map(np.asarray, params)
    heads = []
    for h in range(H):
        qh = x @ p["query_kernel"][:, h] + p["query_bias"][h]  # [B, L, D]
        kh = y @ p["key_kernel"][:, h] + p["key_bias"][h]
        vh = y @ p["value_kernel"][:, h] + p["value_bias"][h]
        w = jax.nn.softmax(qh @ np.swapaxes(kh, 1, 2) / np.sqrt(D), axis=-1)
        heads.append(w @ vh)
    concat = np.concatenate(heads, axis=-1)  # [B, L, H*Dv]
    wo = p["out_kernel"].reshape(H * Dv, M)
    np.testing.assert_allclose(out, concat @ wo + p["out_bias"], rtol=1e-5, atol=1e-5)


def test_grouped_query_attention():
    rng = np.random.default_rng(1)
    B, L, M, H = 2, 6, 16, 4
    x = jnp.asarray(rng.normal(size=(B, L, M)), jnp.float32)
    mha = MultiHeadAttention(num_heads=H)
    params = _mha_params(mha, x)
    gqa_full = MultiHeadAttention(num_heads=H, num_kv_heads=H)
    np.testing.assert_array_equal(
        mha.apply({"params": params}, x), gqa_full.apply({"params": params}, x)
    )
    # K=2 < H=4: equals standard MHA whose K/V weights repeat each kv head for its group.
    gqa = MultiHeadAttention(num_heads=H, num_kv_heads=2)
    gp = nn.meta.unbox(_mha_params(gqa, x))
    assert gp["key_kernel"].shape == (M, 2, M // H)
    expanded = dict(gp)
    for name in ("key_kernel", "value_kernel"):
        expanded[name] = jnp.repeat(gp[name], 2, axis=1)
    np.testing.assert_allclose(
        gqa.apply({"params": gp}, x, is_causal=True),
        mha.apply({"params": expanded}, x, is_causal=True),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("rope", [None, 10_000.0])
def test_kv_cache_equals_full_causal_attention(rope):
    rng = np.random.default_rng(2)
    B, L, M = 2, 7, 16
    x = jnp.asarray(rng.normal(size=(B, L, M)), jnp.float32)
    full = MultiHeadAttention(num_heads=4, num_kv_heads=2, rope_base=rope)
    params = full.init(jax.random.key(0), x)["params"]
    want = full.apply({"params": params}, x, is_causal=True)
    step = MultiHeadAttention(num_heads=4, num_kv_heads=2, rope_base=rope, decode=True)
    cache = step.init(jax.random.key(0), x)["cache"]
    assert cache["cached_key"].shape == (B, 2, L, 4)  # heads-major: [B, K, T, Dk]
    outs = []
    for t in [0, 1, 2]:  # one token at a time ...
        o, upd = step.apply({"params": params, "cache": cache}, x[:, t : t + 1], mutable="cache")
        cache = upd["cache"]
        outs.append(o)
    o, upd = step.apply({"params": params, "cache": cache}, x[:, 3:], mutable="cache")
    outs.append(o)  # ... then a chunk of four (prefill-style)
    assert int(upd["cache"]["cache_index"]) == L
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want, rtol=1e-5, atol=1e-5)


def test_cross_attention_cache_projects_once():
    """The call that creates the cache with the real parameters projects the encoder output;
    later steps read it (zeros in place of the encoder output give the same result); a cache
    made by init, with other parameters, is refused."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(2, 3, 16)), jnp.float32)
    enc = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    full = MultiHeadAttention(num_heads=4)
    params = full.init(jax.random.key(0), x, enc)["params"]
    want = full.apply({"params": params}, x, enc)
    step = MultiHeadAttention(num_heads=4, decode=True)
    o, upd = step.apply({"params": params}, x[:, :1], enc, mutable="cache")
    cache, outs = upd["cache"], [o]
    assert set(cache) == {"cross_key", "cross_value"}
    for t in (1, 2):
        o, upd = step.apply(
            {"params": params, "cache": cache},
            x[:, t : t + 1],
            jnp.zeros_like(enc),
            mutable="cache",
        )
        cache = upd["cache"]
        outs.append(o)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not init"):
        step.init(jax.random.key(0), x[:, :1], enc)


def _encoder_decoder(impl="xla", **kw):
    from tx_jax.model.config import variant
    from tx_jax.model.transformer import EncoderDecoder

    cfg = variant("tiny", vocab_size=11, dropout_rate=0.0, attention_impl=impl, **kw)
    src = jnp.array([[5, 6, 7, 8, 9], [4, 9, 10, 0, 0]], jnp.int32)
    tgt = jnp.array([[5, 6, 7, 8, 9, 4], [4, 9, 10, 1, 5, 0]], jnp.int32)
    model = EncoderDecoder(cfg)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), src, tgt)["params"])
    return model, params, src, tgt


def test_model_with_value_head_dim_differing_from_head_dim():
    """EncoderDecoder (tiny: M 64, H 4) with d_k 8, d_v 12 and GQA (K 2): every attention's
    W^V is [M, K, 12], W^O [H, 12, M]; forward and backward run and 'chunked' gives 'xla''s
    logits and gradients. value_head_dim=None is the old model: the same parameters. One
    layer per stack: each kind of attention (encoder self, decoder self, cross) once."""
    layers = dict(num_encoder_layers=1, num_decoder_layers=1)
    kw = dict(head_dim=8, value_head_dim=12, num_kv_heads=2, **layers)
    model, params, src, tgt = _encoder_decoder(**kw)
    attentions = [
        layer[name]
        for stack in ("encoder", "decoder")
        for layer_name, layer in params[stack].items()
        if layer_name.startswith("layer_")
        for name in ("self_attention", "cross_attention")
        if name in layer
    ]
    assert len(attentions) == 1 + 2 * 1
    for p in attentions:
        assert p["query_kernel"].shape == (64, 4, 8) and p["key_kernel"].shape == (64, 2, 8)
        assert p["value_kernel"].shape == (64, 2, 12) and p["out_kernel"].shape == (4, 12, 64)

    def loss(params, model):
        logits = model.apply({"params": params}, src, tgt)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 4]), logits

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (l_xla, logits), g_xla = grad(params, model)
    chunked, _, _, _ = _encoder_decoder("chunked", **kw)
    (l_chk, logits_chk), g_chk = grad(params, chunked)
    assert logits.shape == (2, 6, 11) and np.isfinite(np.asarray(logits)).all()
    np.testing.assert_allclose(logits_chk, logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g_xla), jax.tree_util.tree_leaves(g_chk)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    dv = g_xla["decoder"]["layer_0"]["cross_attention"]["value_kernel"]
    assert dv.shape == (64, 2, 12) and float(jnp.abs(dv).max()) > 0

    _, default, _, _ = _encoder_decoder(**layers)
    _, explicit, _, _ = _encoder_decoder(value_head_dim=16, **layers)  # d_model // num_heads
    same = jax.tree_util.tree_map(lambda a, b: bool((a == b).all()), default, explicit)
    assert all(jax.tree_util.tree_leaves(same))
    assert jax.tree_util.tree_structure(default) == jax.tree_util.tree_structure(explicit)


def test_params_carry_logical_axis_names():
    x = jnp.ones((1, 3, 16))
    params = MultiHeadAttention(num_heads=4, num_kv_heads=2, use_bias=True).init(
        jax.random.key(0), x
    )["params"]
    names = {k: v.names for k, v in params.items()}
    assert names["query_kernel"] == ("embed", "heads", "kv")
    assert names["key_kernel"] == ("embed", "kv_heads", "kv")
    assert names["out_kernel"] == ("heads", "kv", "embed")
    for k, v in params.items():
        assert len(v.names) == v.value.ndim, k


def test_sow_weights_rows_sum_to_one():
    x = jnp.asarray(np.random.default_rng(4).normal(size=(1, 4, 8)), jnp.float32)
    mha = MultiHeadAttention(num_heads=2, sow_weights=True)
    v = mha.init(jax.random.key(0), x)
    _, inter = mha.apply(v, x, is_causal=True, mutable="intermediates")
    (w,) = inter["intermediates"]["attention_weights"]
    assert w.shape == (1, 2, 4, 4)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(np.triu(np.asarray(w[0, 0]), 1), 0.0)


def test_deterministic_gpu_mode_keeps_cudnn_out(monkeypatch):
    """Under XLA:GPU's deterministic ops cuDNN's fused attention fails at its first call
    (H100, jax 0.11.2): a run resolved for a GPU with train.deterministic, or with the flag in
    XLA_FLAGS, gets XLA's attention."""
    import ml_collections

    from tx_jax.model.config import ModelConfig
    from tx_jax.ops import backend

    run = ml_collections.ConfigDict(
        {
            "model": {"attention_impl": "auto", "dtype": "bfloat16"},
            "data": {"max_len": 64},
            "train": {"deterministic": False},
        }
    )
    monkeypatch.setenv("XLA_FLAGS", "")
    assert ModelConfig.of_run(run, "gpu").attention_impl == "cudnn"
    run.train.deterministic = True
    assert ModelConfig.of_run(run, "gpu").attention_impl == "xla"
    run.train.deterministic = False
    monkeypatch.setenv("XLA_FLAGS", backend.DETERMINISTIC_FLAG)
    assert ModelConfig.of_run(run, "gpu").attention_impl == "xla"


def test_require_deterministic_ops_adds_the_flag_once(monkeypatch):
    from tx_jax.ops import backend

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    backend.require_deterministic_ops()  # CPU host: the flag is set for any GPU to come
    backend.require_deterministic_ops()
    flags = os.environ["XLA_FLAGS"].split()
    assert flags == ["--xla_force_host_platform_device_count=2", backend.DETERMINISTIC_FLAG]
