"""On a GPU only: the paths that CI's CPU can lower but never run. Skipped without a GPU.

    JAX_PLATFORMS=cuda,cpu python -m pytest tests/test_gpu.py      (conftest defaults to cpu)

'cudnn' attention (jax.nn.dot_product_attention's cuDNN fused kernel) against the float64
reference and against 'xla' on the same GPU, forward and gradients, masks as the model builds
them (padding, causal, packed segments, fully masked rows); 'auto' resolved for a GPU choosing
it in bfloat16; the model's bfloat16 train step through it against the same step through 'xla'.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import reference_attention
from helpers import state_and_step

from tx_jax.model import attention as A
from tx_jax.model.config import variant
from tx_jax.model.transformer import EncoderDecoder
from tx_jax.ops import masks


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


pytestmark = pytest.mark.skipif(
    _gpu() is None, reason="needs a GPU (on a GPU host: JAX_PLATFORMS=cuda,cpu)"
)

B, L, S, H, D = 2, 128, 96, 4, 64


def _problem(rng, causal):
    """bf16 q/k/v on the GPU, padded rows (segment id 0) and, for self-attention, two packed
    segments; bf16 values are what both the kernel and the reference see."""
    S_ = L if causal else S
    q, k, v = (
        jax.device_put(jnp.asarray(rng.normal(size=(B, n, H, D)), jnp.bfloat16), _gpu())
        for n in (L, S_, S_)
    )
    q_seg = np.ones((B, L), np.int32)
    q_seg[0, 100:] = 0  # padded queries: fully masked rows
    if causal:
        q_seg[1, 60:] = 2  # two packed sequences in row 1
        kv_seg = q_seg
    else:
        kv_seg = np.ones((B, S_), np.int32)
        kv_seg[:, 70:] = 0
    return q, k, v, jnp.asarray(q_seg), jnp.asarray(kv_seg)


def _attend(impl, q, k, v, q_seg, kv_seg, causal):
    return A.dot_product_attention(
        q,
        k,
        v,
        is_causal=causal,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        implementation=impl,
    )


_IMPLS = ("cudnn",)  # jax.nn's call, 'auto' on a GPU


@pytest.mark.parametrize("impl", _IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_forward_matches_float64_reference(causal, impl):
    q, k, v, q_seg, kv_seg = _problem(np.random.default_rng(1), causal)
    fn = jax.jit(functools.partial(_attend, causal=causal), static_argnums=0)
    assert "__cudnn$fmha" in fn.lower(impl, q, k, v, q_seg, kv_seg).as_text()
    out = np.asarray(fn(impl, q, k, v, q_seg, kv_seg), np.float64)
    xla = np.asarray(fn("xla", q, k, v, q_seg, kv_seg), np.float64)
    mask = masks.dense_mask(
        L, k.shape[1], is_causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg
    )
    ref, _ = reference_attention(
        np.asarray(q, np.float32),
        np.asarray(k, np.float32),
        np.asarray(v, np.float32),
        np.asarray(mask),
    )
    scale = np.abs(ref).max()
    err, err_xla = (np.abs(x - ref).max() / scale for x in (out, xla))
    assert err < 1e-2, (err, err_xla)  # bf16 output: ~4e-3 rounding
    assert err < 2 * err_xla + 1e-3, (err, err_xla)
    np.testing.assert_array_equal(out[0, 100:], 0.0)  # fully masked rows are zeros


@pytest.mark.parametrize("impl", _IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_gradients_match_xla_in_float32(causal, impl):
    q, k, v, q_seg, kv_seg = _problem(np.random.default_rng(2), causal)
    w = jnp.asarray(np.random.default_rng(3).normal(size=(B, L, H, D)), jnp.float32)

    def loss(impl, q, k, v):
        out = _attend(impl, q, k, v, q_seg, kv_seg, causal)
        return (out.astype(jnp.float32) * w).sum()

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    with jax.default_matmul_precision("highest"):
        ref = grad("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
    got = grad(impl, q, k, v)
    for name, g, r in zip("qkv", got, ref):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.isfinite(g).all(), name
        err = np.abs(g - r).max() / np.abs(r).max()
        assert err < 3e-2, (name, err)


def test_auto_picks_cudnn_in_bfloat16_only():
    from tx_jax.model.config import ModelConfig

    auto = ModelConfig(attention_impl="auto", d_model=128, num_heads=2)
    impl = auto.replace(dtype="bfloat16").resolved(jax.default_backend()).attention_impl
    assert impl == "cudnn" and auto.resolved(jax.default_backend()).attention_impl == "xla"
    q, k, v, q_seg, kv_seg = _problem(np.random.default_rng(4), False)
    fn = jax.jit(functools.partial(_attend, impl, causal=False))
    assert "__cudnn$fmha" in fn.lower(q, k, v, q_seg, kv_seg).as_text()


def test_bfloat16_train_step_through_cudnn_equals_xla():
    """Same init, same batches, 5 updates: the losses through cuDNN's attention and XLA's
    agree to bf16 accuracy (dropout off: the two would draw different attention masks)."""
    V = 64
    tokens = np.random.default_rng(5).integers(3, V, size=(2, 8, 32))
    tokens[:, :, -5:] = 0
    batch = {"inputs": jnp.asarray(tokens[0], jnp.int32), "targets": jnp.asarray(tokens[1])}

    def run(impl):
        cfg = variant(
            "tiny",
            vocab_size=V,
            d_model=128,
            num_heads=2,  # head dim 64: a shape cuDNN's kernel takes
            dtype="bfloat16",
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
            attention_impl=impl,
        )
        state, step = state_and_step(EncoderDecoder(cfg), optax.adam(1e-3), 1e-3)
        text = step.lower(state, batch).as_text()
        losses = []
        for _ in range(5):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return text, np.array(losses)

    text_cudnn, cudnn = run("cudnn")
    text_xla, xla = run("xla")
    assert "__cudnn$fmha" in text_cudnn and "__cudnn$fmha" not in text_xla
    assert np.isfinite(cudnn).all()
    assert cudnn[-1] < cudnn[0]  # it learns
    np.testing.assert_allclose(cudnn, xla, rtol=2e-2)
