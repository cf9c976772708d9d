"""ops/cudnn.py on a CPU: which cuDNN call each implementation makes, with what mask, and the
wrapping around it (fully masked rows zeroed), against stand-ins for jax's calls that compute
their documented contract in XLA. tests/test_gpu.py runs the kernels themselves;
tests/test_lowering.py lowers them for 'cuda' where this jaxlib has CUDA."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import reference_attention

from tx_jax.model import attention as A
from tx_jax.ops import backend, cudnn, masks

B, L, H, D = 2, 12, 4, 8


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, L, H, D)), jnp.bfloat16) for _ in range(3))
    seg = np.ones((B, L), np.int32)
    seg[0, 8:] = 0  # padded queries: rows with no key
    seg[1, 5:] = 2  # two packed sequences
    return q, k, v, jnp.asarray(seg)


@pytest.fixture
def public_call(monkeypatch):
    """jax.nn.dot_product_attention with implementation='cudnn' computed by XLA, recording the
    masks it is given; the private call made to fail, so a test sees which one ran."""
    calls = []

    def private(*args):
        raise AssertionError("the private cuDNN call ran")

    monkeypatch.setattr(jax.nn, "dot_product_attention", _recording_public(calls))
    monkeypatch.setattr(cudnn, "masked_attention", private)
    return calls


def test_auto_on_a_gpu_is_the_public_call_with_the_mask_on_every_head(public_call):
    """'auto' traced for a GPU runs jax.nn's cuDNN call (the one tested and timed on GPUs),
    never the private one; the mask broadcast to [B, H, L, S]; rows with no key are zeros."""
    q, k, v, seg = _problem()
    kw = dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    with backend.target("gpu"):
        out = A.dot_product_attention(q, k, v, **kw)
    assert public_call == [(B, H, L, L)]
    mask = masks.dense_mask(L, L, **kw)
    f32 = (np.asarray(x, np.float32) for x in (q, k, v))
    ref, _ = reference_attention(*f32, np.asarray(mask))
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(out[0, 8:], np.float32), 0.0)


def test_broadcast_keeps_the_mask_one_head_wide(public_call):
    q, k, v, seg = _problem(1)
    kw = dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    out = A.dot_product_attention(q, k, v, implementation="cudnn_broadcast", **kw)
    assert public_call == [(B, 1, L, L)]
    np.testing.assert_array_equal(np.asarray(out[0, 8:], np.float32), 0.0)


def test_cudnn_refuses_dropout_rather_than_dropping_it_silently(public_call):
    q, k, v, _ = _problem()
    drop = dict(dropout_rate=0.1, dropout_rng=jax.random.key(0), deterministic=False)
    with pytest.raises(ValueError, match="'cudnn' does not support dropout"):
        A.dot_product_attention(q, k, v, implementation="cudnn", **drop)
    with backend.target("gpu"):  # 'auto' with dropout: XLA's attention, no cuDNN call
        A.dot_product_attention(q, k, v, **drop)
    assert public_call == []


def _fake_core(calls):
    """jax's private cuDNN call (the signature masked_attention checks), computing softmax(q
    k^T * scale + bias) v in XLA and recording (has_bias, has_dbias)."""

    def core(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
             page_table_k, page_table_v, scale, seed, dropout_rate, variadic_args,
             mask_type, layout, sliding_window_length, cudnn_version, return_residual):  # fmt: skip
        calls.append(variadic_args)
        s = jnp.einsum("blhd,bshd->bhls", query, key, preferred_element_type=jnp.float32)
        p = jax.nn.softmax(s * scale + bias.astype(jnp.float32), axis=-1)
        return jnp.einsum("bhls,bshd->blhd", p.astype(value.dtype), value)

    return core


def test_nodbias_asks_the_private_call_for_no_bias_gradient(monkeypatch):
    """'cudnn_nodbias' (a GPU candidate): the mask's bias through jax's private call with
    (has_bias, has_dbias) = (True, False); the same outputs as the masked reference."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    calls = []
    monkeypatch.setattr(fa, "_dot_product_attention", _fake_core(calls))
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91900)
    q, k, v, seg = _problem(2)
    kw = dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    out = A.dot_product_attention(q, k, v, implementation="cudnn_nodbias", **kw)
    assert calls == [(True, False)]
    ref, _ = reference_attention(
        *(np.asarray(x, np.float32) for x in (q, k, v)), np.asarray(masks.dense_mask(L, L, **kw))
    )
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2)
    np.testing.assert_array_equal(np.asarray(out[0, 8:], np.float32), 0.0)


def test_nodbias_falls_back_to_the_public_call_where_jax_moved_on(monkeypatch):
    """A jax whose private call has another signature: masked_attention answers None and the
    public call runs (with its bias gradient)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", _recording_public(calls))
    monkeypatch.setattr(fa, "_dot_product_attention", lambda query, key, value: None)
    q, k, v, seg = _problem(3)
    mask = masks.dense_mask(L, L, q_segment_ids=seg, kv_segment_ids=seg)
    assert cudnn.masked_attention(q, k, v, jnp.broadcast_to(mask, (B, H, L, L))) is None
    A.dot_product_attention(
        q, k, v, q_segment_ids=seg, kv_segment_ids=seg, implementation="cudnn_nodbias"
    )
    assert calls == [(B, H, L, L)]


def _recording_public(calls):
    real = jax.nn.dot_product_attention

    def fake(query, key, value, bias=None, mask=None, *, implementation=None):
        assert implementation == "cudnn"
        calls.append(None if mask is None else mask.shape)
        return real(query, key, value, bias=bias, mask=mask, implementation="xla")

    return fake


def test_the_private_signature_checked_is_this_jax_s():
    """The parameters masked_attention passes are those of the installed jax's private call
    (on a jax where they differ, the test says so before a GPU does)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    core = fa._dot_product_attention
    params = tuple(inspect.signature(getattr(core, "fun", core)).parameters)
    assert params == cudnn._CORE_ARGS


def test_applies_is_what_auto_needs():
    bf = functools.partial(jnp.zeros, dtype=jnp.bfloat16)
    assert cudnn.applies(bf((1, 4, 2, 64)), bf((1, 4, 2, 64)), bf((1, 4, 2, 64)))
    assert not cudnn.applies(*(jnp.zeros((1, 4, 2, 64)),) * 3)  # float32
    assert not cudnn.applies(bf((1, 4, 2, 64)), bf((1, 4, 2, 64)), bf((1, 4, 2, 32)))  # d_v
    assert not cudnn.applies(*(bf((1, 4, 2, 12)),) * 3)  # not a multiple of 8
    assert not cudnn.applies(*(bf((1, 4, 2, 256)),) * 3)  # over 128
