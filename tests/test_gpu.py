"""On a GPU only: the paths that CI's CPU can lower but never run. Skipped without a GPU.

    JAX_PLATFORMS=cuda,cpu python -m pytest tests/test_gpu.py      (conftest defaults to cpu)

'cudnn' attention (jax.nn.dot_product_attention's cuDNN fused kernel) against the float64
reference and against 'xla' on the same GPU, forward and gradients, masks as the model builds
them (padding, causal, packed segments, fully masked rows); 'auto' choosing it in bfloat16;
the model's bfloat16 train step through it against the same step through 'xla'; the
masked call without a bias gradient against jax.nn's, which writes one; and
model.residual_norm='pallas' compiled by Triton against flax's LayerNorm after the hashed
dropout, model.loss_impl='fused' against the dense loss and model.ffn_impl='pallas' against
XLA's FFN (tests/test_residual_norm.py, tests/test_fused_loss.py and tests/test_ffn.py run the
same kernels in Pallas' interpreter).
"""

import functools

import flax.linen as nn
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


# 'cudnn' (jax.nn's call, 'auto' on a GPU) and the two candidates: 'cudnn_broadcast' (does cuDNN
# take the mask as [B, 1, L, S]?) and 'cudnn_nodbias' (jax's private call, no bias gradient)
_IMPLS = ("cudnn", "cudnn_broadcast", "cudnn_nodbias")


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


@pytest.mark.parametrize("causal", [False, True])
def test_masked_attention_without_bias_gradient_equals_jax_nn(causal):
    """cudnn.masked_attention (cuDNN's backward asked for dq, dk, dv only) gives the
    outputs and gradients of jax.nn.dot_product_attention with the same mask, whose backward
    also writes the bias gradient."""
    from tx_jax.ops import cudnn

    q, k, v, q_seg, kv_seg = _problem(np.random.default_rng(4), causal)
    mask = masks.dense_mask(
        L, k.shape[1], is_causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg
    )
    mask = jnp.broadcast_to(mask, (B, H, L, k.shape[1]))
    w = jnp.asarray(np.random.default_rng(5).normal(size=(B, L, H, D)), jnp.float32)

    def ours(q, k, v):
        return cudnn.masked_attention(q, k, v, mask)

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")

    results = []
    for fn in (ours, theirs):

        def loss(q, k, v, fn=fn):
            return (fn(q, k, v).astype(jnp.float32) * w).sum()

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        results.append(step(q, k, v))
        bwd = [c for c in step.lower(q, k, v).as_text().splitlines() if "Backward(" in c]
        assert len(bwd) == 1
        bias_grads = bwd[0].rsplit("->", 1)[1].count(f"x{L}x{k.shape[1]}xbf16>")
        assert bias_grads == (0 if fn is ours else 1), bwd[0][-300:]
    (l1, g1), (l2, g2) = results
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-3)
    for name, a, b in zip("qkv", g1, g2):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max(), name


def test_auto_picks_cudnn_in_bfloat16_only():
    q, k, v, q_seg, kv_seg = _problem(np.random.default_rng(4), False)
    fn = jax.jit(functools.partial(_attend, "auto", causal=False))
    assert "__cudnn$fmha" in fn.lower(q, k, v, q_seg, kv_seg).as_text()
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    assert "__cudnn$fmha" not in fn.lower(*f32, q_seg, kv_seg).as_text()


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_residual_norm_compiled_by_triton_matches_flax(dtype):
    """The Triton kernels: the same masks (unsigned hashing and comparison as jax's), outputs
    and gradients within float32 rounding (bf16: one bf16 step of z's scale)."""
    from tx_jax.ops import kernels, residual_norm

    rng = np.random.default_rng(8)
    shape, M = (4, 96, 256), 256
    x, y = (jnp.asarray(rng.normal(size=shape), dtype) for _ in range(2))
    g = jnp.asarray(1.0 + 0.1 * rng.normal(size=M), jnp.float32)
    b = jnp.asarray(0.1 * rng.normal(size=M), jnp.float32)
    w = jnp.asarray(rng.normal(size=shape), jnp.float32)
    key = jax.random.key(3)

    def reference(x, y, g, b):
        z = x + kernels.dropout(y, 0.1, key, kernels="generic", bits="hash")
        ln = nn.LayerNorm(epsilon=1e-6, dtype=x.dtype)
        return ln.apply({"params": {"scale": g, "bias": b}}, z)

    def fused(x, y, g, b):
        return residual_norm.post_norm(x, y, g, b, 0.1, key, eps=1e-6, interpret=False)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w)

    step = jax.jit(jax.value_and_grad(loss(fused), argnums=(0, 1, 2, 3)))
    assert step.lower(x, y, g, b).as_text().count("__gpu$xla.gpu.triton") == 2
    got = step(x, y, g, b)
    want = jax.jit(jax.value_and_grad(loss(reference), argnums=(0, 1, 2, 3)))(x, y, g, b)
    keep = np.asarray(kernels.keep_mask(key, 0.1, shape, "generic", "hash"))
    np.testing.assert_array_equal(np.asarray(got[1][1]) == 0, ~keep)  # dy's zeros: the mask
    tol = 1e-5 if dtype == "float32" else 2.0**-6
    for a, c in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        a, c = np.asarray(a, np.float64), np.asarray(c, np.float64)
        np.testing.assert_allclose(c, a, rtol=tol, atol=tol * max(np.abs(a).max(), 1.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_loss_compiled_by_triton_matches_the_dense_path(dtype):
    """model.loss_impl='fused': the Triton kernels' sums and gradients against the dense path's
    (tests/test_fused_loss.py runs the same kernels in Pallas' interpreter)."""
    from tx_jax.ops import fused_loss
    from tx_jax.training import losses

    rng = np.random.default_rng(9)
    B, L, M, V = 4, 100, 256, 1000
    h = jnp.asarray(rng.normal(size=(B, L, M)), dtype)
    table = jnp.asarray(0.1 * rng.normal(size=(V, M)), jnp.float32)
    targets = jnp.asarray(rng.integers(1, V, size=(B, L)), jnp.int32)
    weights = jnp.asarray(rng.random((B, L)) > 0.2, jnp.float32)

    def dense(h, table):
        logits = jnp.einsum("blm,vm->blv", h, table.astype(h.dtype)).astype(jnp.float32)
        return losses.loss_sums(logits, targets, weights, 0.1)["loss"]

    def fused(h, table):
        sums = fused_loss.fused_output_loss(h, table, None, targets, weights, 0.1)
        return sums["loss"]

    step = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))
    assert step.lower(h, table).as_text().count("__gpu$xla.gpu.triton") == 2
    got = step(h, table)
    want = jax.jit(jax.value_and_grad(dense, argnums=(0, 1)))(h, table)
    tol = 1e-5 if dtype == "float32" else 1e-2
    for a, c in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        a, c = np.asarray(a, np.float64), np.asarray(c, np.float64)
        np.testing.assert_allclose(c, a, rtol=tol, atol=tol * max(np.abs(a).max(), 1.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_ffn_compiled_by_triton_matches_xla(dtype):
    """model.ffn_impl='pallas': the Triton matmuls with the bias/ReLU and mask epilogues
    against the XLA path (tests/test_ffn.py runs them in Pallas' interpreter)."""
    from tx_jax.ops import ffn

    rng = np.random.default_rng(10)
    M, F = 256, 1024
    x = jnp.asarray(rng.normal(size=(4, 200, M)), dtype)
    w1, w2 = (jnp.asarray(0.05 * rng.normal(size=s), jnp.float32) for s in ((M, F), (F, M)))
    b1, b2 = (jnp.asarray(0.1 * rng.normal(size=s), jnp.float32) for s in ((F,), (M,)))
    w = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def reference(x, w1, b1, w2, b2):
        h = nn.relu(jnp.einsum("blm,mf->blf", x, w1.astype(x.dtype)) + b1.astype(x.dtype))
        return jnp.einsum("blf,fm->blm", h, w2.astype(x.dtype)) + b2.astype(x.dtype)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w)

    step = jax.jit(jax.value_and_grad(loss(ffn.relu_ffn), argnums=range(5)))
    assert step.lower(x, w1, b1, w2, b2).as_text().count("__gpu$xla.gpu.triton") == 2
    got = step(x, w1, b1, w2, b2)
    want = jax.jit(jax.value_and_grad(loss(reference), argnums=range(5)))(x, w1, b1, w2, b2)
    tol = 1e-4 if dtype == "float32" else 2e-2
    for a, c in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        a, c = np.asarray(a, np.float64), np.asarray(c, np.float64)
        np.testing.assert_allclose(c, a, rtol=tol, atol=tol * max(np.abs(a).max(), 1.0))
