"""model.ffn_impl='pallas' (tx_jax/ops/ffn.py): the paper's FFN with its bias, ReLU and their
gradients inside Pallas matmuls, run here in Pallas' interpreter and lowered for a GPU, against
the XLA path (FeedForward's einsums and autodiff): outputs and gradients to float32 rounding,
the same parameter tree and model loss and gradients, sharded rows on 8 devices."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.model.config import ModelConfig, variant
from tx_jax.model.layers import FeedForward
from tx_jax.model.transformer import EncoderDecoder
from tx_jax.ops import backend, ffn


def _inputs(shape, F, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    M = shape[-1]
    return (
        jax.random.normal(k[0], shape, dtype),
        jax.random.normal(k[1], (M, F)) * 0.1,
        jax.random.normal(k[2], (F,)) * 0.1,
        jax.random.normal(k[3], (F, M)) * 0.1,
        jax.random.normal(k[4], (M,)) * 0.1,
        jax.random.normal(k[5], shape),
    )


def _xla(x, w1, b1, w2, b2):
    h = nn.relu(jnp.einsum("...m,mf->...f", x, w1.astype(x.dtype)) + b1.astype(x.dtype))
    return jnp.einsum("...f,fm->...m", h, w2.astype(x.dtype)) + b2.astype(x.dtype)


# (3, 50, 64): 150 rows padded to 256; (2, 128, 128): no padding
@pytest.mark.parametrize("shape, F", [((3, 50, 64), 128), ((2, 128, 128), 256)])
def test_outputs_and_gradients_match_xla_in_float32(shape, F):
    x, w1, b1, w2, b2, w = _inputs(shape, F)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * w)

    np.testing.assert_allclose(
        jax.jit(ffn.relu_ffn)(x, w1, b1, w2, b2), _xla(x, w1, b1, w2, b2), atol=2e-5
    )
    want = jax.grad(loss(_xla), argnums=range(5))(x, w1, b1, w2, b2)
    got = jax.jit(jax.grad(loss(ffn.relu_ffn), argnums=range(5)))(x, w1, b1, w2, b2)
    for name, a, c in zip(("dx", "dw1", "db1", "dw2", "db2"), want, got, strict=True):
        assert a.shape == c.shape and a.dtype == c.dtype, name
        scale = float(jnp.abs(a).max())
        assert scale > 0, name
        np.testing.assert_allclose(c, a, atol=2e-5 * max(scale, 1.0), err_msg=name)


def test_bfloat16_within_its_rounding():
    x, w1, b1, w2, b2, _ = _inputs((2, 64, 64), 128, jnp.bfloat16, seed=1)
    got = np.asarray(ffn.relu_ffn(x, w1, b1, w2, b2), np.float32)
    want = np.asarray(_xla(x, w1, b1, w2, b2), np.float32)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=2.0**-6, atol=2.0**-6 * np.abs(want).max())


def test_model_with_pallas_equals_xla():
    """The same parameter tree, loss and gradients through the tiny model (dropout on at the
    residuals; the FFN's hidden dropout is off, as 'pallas' requires)."""

    def run(impl):
        cfg = variant("tiny", vocab_size=40, dropout_rate=0.1, ffn_impl=impl)
        model = EncoderDecoder(cfg)
        rng = np.random.default_rng(1)
        src = jnp.asarray(rng.integers(3, 40, (3, 7)), jnp.int32).at[0, 5:].set(0)
        tgt = jnp.asarray(rng.integers(3, 40, (3, 6)), jnp.int32)
        params = nn.meta.unbox(model.init(jax.random.key(0), src, tgt)["params"])

        def loss(p):
            logits = model.apply(
                {"params": p}, src, tgt, deterministic=False, rngs={"dropout": jax.random.key(3)}
            )
            return jnp.mean(jax.nn.log_softmax(logits)[..., 4])

        return params, *jax.jit(jax.value_and_grad(loss))(params)

    p_x, l_x, g_x = run("xla")
    with backend.pallas_interpreter():
        p_p, l_p, g_p = run("pallas")
    jax.tree.map(np.testing.assert_array_equal, p_x, p_p)
    np.testing.assert_allclose(float(l_p), float(l_x), rtol=1e-6)
    for (path, a), c in zip(jax.tree.leaves_with_path(g_x), jax.tree.leaves(g_p), strict=True):
        scale = max(float(jnp.abs(a).max()), 1e-3)
        np.testing.assert_allclose(c, a, atol=2e-5 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"activation": "gelu"}, "activation"),
        ({"ffn_bias": False}, "ffn_bias"),
        ({"ffn_dropout_rate": 0.1}, "ffn_dropout_rate"),
        ({"d_ff": 200}, "d_ff"),
    ],
)
def test_config_names_what_pallas_cannot_fuse(overrides, key):
    with pytest.raises(ValueError, match=f"ffn_impl='pallas'.*{key}|{key}.*ffn_impl"):
        ModelConfig(vocab_size=32, d_model=64, num_heads=4, ffn_impl="pallas", **overrides)


def test_pallas_resolves_to_xla_off_a_gpu_and_keeps_the_module_names():
    x, w1, b1, w2, b2, _ = _inputs((1, 8, 64), 128)
    with backend.target("tpu"), pytest.raises(ValueError, match="on TPU use 'xla'"):
        ffn.relu_ffn(x, w1, b1, w2, b2)  # a direct call: refused, not interpreted
    assert ffn.resolve("pallas") == "xla"
    with backend.target("tpu"):
        assert ffn.resolve("pallas") == "xla"
    with backend.target("gpu"):
        assert ffn.resolve("pallas") == "pallas"
    with backend.pallas_interpreter():
        assert ffn.resolve("pallas") == "pallas"
        pallas = FeedForward(128, impl="pallas").init(jax.random.key(0), x)["params"]
    xla = FeedForward(128, impl="xla").init(jax.random.key(0), x)["params"]
    assert jax.tree.structure(pallas) == jax.tree.structure(xla)
    jax.tree.map(np.testing.assert_array_equal, pallas, xla)


def test_lowers_for_cuda_as_two_triton_matmuls():
    x, w1, b1, w2, b2, w = _inputs((2, 64, 64), 128, jnp.bfloat16)

    def loss(x, w1, w2):
        return jnp.sum(ffn.relu_ffn(x, w1, b1, w2, b2, interpret=False).astype(jnp.float32) * w)

    try:
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, w1, w2)
        text = text.lower(lowering_platforms=("cuda",)).as_text()
    except NotImplementedError as e:
        pytest.skip(f"Pallas' Triton lowering unavailable: {e}")
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert 'name = "ffn_bias_relu"' in text and 'name = "ffn_mask"' in text
