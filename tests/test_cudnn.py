"""ops/cudnn.py on a CPU: the cuDNN call it makes, with what mask, and the wrapping around it
(fully masked rows zeroed), against a stand-in for jax's call that computes its documented
contract in XLA. tests/test_gpu.py runs the kernels themselves;
tests/test_lowering.py lowers them for 'cuda' where this jaxlib has CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import reference_attention

from tx_jax.model import attention as A
from tx_jax.ops import cudnn, masks

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
    masks it is given."""
    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", _recording_public(calls))
    return calls


def test_cudnn_is_the_public_call_with_the_mask_on_every_head(public_call):
    """'cudnn' runs jax.nn's cuDNN call (the one tested and timed on GPUs) with the mask
    broadcast to [B, H, L, S]; rows with no key are zeros."""
    q, k, v, seg = _problem()
    kw = dict(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    out = A.dot_product_attention(q, k, v, implementation="cudnn", **kw)
    assert public_call == [(B, H, L, L)]
    mask = masks.dense_mask(L, L, **kw)
    f32 = (np.asarray(x, np.float32) for x in (q, k, v))
    ref, _ = reference_attention(*f32, np.asarray(mask))
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)
    np.testing.assert_array_equal(np.asarray(out[0, 8:], np.float32), 0.0)


def test_cudnn_refuses_dropout_rather_than_dropping_it_silently(public_call):
    q, k, v, _ = _problem()
    drop = dict(dropout_rate=0.1, dropout_rng=jax.random.key(0), deterministic=False)
    with pytest.raises(ValueError, match="'cudnn' does not support dropout"):
        A.dot_product_attention(q, k, v, implementation="cudnn", **drop)
    assert public_call == []


def _recording_public(calls):
    real = jax.nn.dot_product_attention

    def fake(query, key, value, bias=None, mask=None, *, implementation=None):
        assert implementation == "cudnn"
        calls.append(None if mask is None else mask.shape)
        return real(query, key, value, bias=bias, mask=mask, implementation="xla")

    return fake


def test_applies_is_what_auto_needs():
    assert cudnn.applies("bfloat16", 64, 64) and cudnn.applies("float16", 128, 128)
    assert not cudnn.applies("float32", 64, 64)
    assert not cudnn.applies("bfloat16", 64, 32)  # d_v
    assert not cudnn.applies("bfloat16", 12, 12)  # not a multiple of 8
    assert not cudnn.applies("bfloat16", 256, 256)  # over 128
