"""FeedForward, norms, and the post-LN / pre-LN residual order."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.model import layers
from tx_jax.model.config import variant


def _x(shape=(2, 5, 16), seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_ffn_relu_is_equation_2():
    x = _x()
    ffn = layers.FeedForward(d_ff=32)
    p = nn.meta.unbox(ffn.init(jax.random.key(0), x)["params"])
    p = jax.tree_util.tree_map(lambda a: a + 0.05, p)  # non-zero biases
    want = np.maximum(0, x @ p["wi_kernel"] + p["wi_bias"]) @ p["wo_kernel"] + p["wo_bias"]
    np.testing.assert_allclose(ffn.apply({"params": p}, x), want, rtol=1e-5, atol=1e-5)


def test_ffn_swiglu_and_gelu():
    x = _x()
    ffn = layers.FeedForward(d_ff=32, activation="swiglu", use_bias=False)
    p = nn.meta.unbox(ffn.init(jax.random.key(0), x)["params"])
    want = (jax.nn.silu(x @ p["wi_kernel"]) * (x @ p["wi_gate_kernel"])) @ p["wo_kernel"]
    np.testing.assert_allclose(ffn.apply({"params": p}, x), want, rtol=1e-5, atol=1e-5)
    gelu = layers.FeedForward(d_ff=32, activation="gelu")
    pg = nn.meta.unbox(gelu.init(jax.random.key(0), x)["params"])
    want = jax.nn.gelu(x @ pg["wi_kernel"]) @ pg["wo_kernel"]
    np.testing.assert_allclose(gelu.apply({"params": pg}, x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="activation"):
        layers.FeedForward(d_ff=8, activation="tanh").init(jax.random.key(0), x)


def test_rmsnorm_and_layernorm_formulas():
    x = _x()
    rms = layers.make_norm("rmsnorm", 1e-6, jnp.float32, jnp.float32, "n")
    y = rms.apply(rms.init(jax.random.key(0), x), x)
    np.testing.assert_allclose(
        y, x / np.sqrt((np.asarray(x) ** 2).mean(-1, keepdims=True) + 1e-6), rtol=1e-5
    )
    ln = layers.make_norm("layernorm", 1e-6, jnp.float32, jnp.float32, "n")
    y = ln.apply(ln.init(jax.random.key(0), x), x)
    np.testing.assert_allclose(np.asarray(y).mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y).std(-1), 1.0, rtol=1e-3)
    with pytest.raises(ValueError, match="norm"):
        layers.make_norm("batchnorm", 1e-6, jnp.float32, jnp.float32, "n")


@pytest.mark.parametrize("position", ["post", "pre"])
def test_encoder_layer_residual_order(position):
    """Post-LN outputs are normalised per token; pre-LN outputs are x + sublayer (not)."""
    cfg = variant("tiny", vocab_size=10, norm_position=position)
    x = 3.0 + 2.0 * _x()
    seg = jnp.ones(x.shape[:2], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    layer = layers.EncoderLayer(cfg)
    v = layer.init(jax.random.key(0), x, seg, pos)
    y = np.asarray(layer.apply(v, x, seg, pos))
    normalised = np.allclose(y.mean(-1), 0.0, atol=1e-4) and np.allclose(y.std(-1), 1.0, rtol=1e-2)
    assert normalised == (position == "post")
    # pre-LN: zeroing the sub-layer output projections makes the layer the identity
    if position == "pre":
        params = jax.tree_util.tree_map(lambda a: a, nn.meta.unbox(v["params"]))
        params["self_attention"]["out_kernel"] = jnp.zeros_like(
            params["self_attention"]["out_kernel"]
        )
        params["ffn"]["wo_kernel"] = jnp.zeros_like(params["ffn"]["wo_kernel"])
        params["ffn"]["wo_bias"] = jnp.zeros_like(params["ffn"]["wo_bias"])
        np.testing.assert_allclose(layer.apply({"params": params}, x, seg, pos), x, rtol=1e-6)


def test_residual_dropout_active_only_in_training():
    cfg = variant("tiny", vocab_size=10, dropout_rate=0.5)
    x = _x()
    seg = jnp.ones(x.shape[:2], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    layer = layers.EncoderLayer(cfg)
    v = layer.init(jax.random.key(0), x, seg, pos)
    a = layer.apply(v, x, seg, pos, True)
    b = layer.apply(v, x, seg, pos, False, rngs={"dropout": jax.random.key(1)})
    c = layer.apply(v, x, seg, pos, False, rngs={"dropout": jax.random.key(2)})
    np.testing.assert_allclose(a, layer.apply(v, x, seg, pos, True), rtol=0)
    assert not np.allclose(a, b) and not np.allclose(b, c)


@pytest.mark.parametrize("activation", ["silu", "gelu_exact"])
def test_ffn_plain_silu_and_exact_gelu(activation):
    """Marian's "swish" (x sigmoid(x), no gate) and torch's erf GELU (Transformers' "gelu")."""
    from scipy.special import erf

    x = _x()
    ffn = layers.FeedForward(d_ff=32, activation=activation)
    p = nn.meta.unbox(ffn.init(jax.random.key(0), x)["params"])
    assert "wi_gate_kernel" not in p
    h = np.asarray(x, np.float64) @ np.asarray(p["wi_kernel"], np.float64)
    if activation == "silu":
        h = h / (1 + np.exp(-h))
    else:
        h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
    want = h @ np.asarray(p["wo_kernel"], np.float64)
    np.testing.assert_allclose(ffn.apply({"params": p}, x), want, rtol=1e-5, atol=1e-5)
