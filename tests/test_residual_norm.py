"""model.residual_norm='pallas' (tx_jax/ops/residual_norm.py): the post-LN tail
LayerNorm(x + Dropout(y)) as one Pallas kernel each way, run here in Pallas' interpreter and
lowered for a GPU, against the reference: flax's LayerNorm after the hashed dropout, under
autodiff. Outputs and gradients within float32 rounding, the same dropout masks, the same
parameter tree and the same model loss and gradients."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.model.config import ModelConfig, variant
from tx_jax.model.transformer import EncoderDecoder
from tx_jax.ops import backend, kernels, residual_norm

EPS = 1e-6


def _reference(x, y, g, b, rate, key):
    dropped = (
        kernels.dropout(y, rate, key, kernels="generic", bits="hash") if key is not None else y
    )
    ln = nn.LayerNorm(epsilon=EPS, dtype=x.dtype)
    return ln.apply({"params": {"scale": g, "bias": b}}, x + dropped)


def _inputs(shape, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    M = shape[-1]
    return (
        jax.random.normal(k[0], shape, dtype),
        jax.random.normal(k[1], shape, dtype) * 2.0,
        1.0 + 0.1 * jax.random.normal(k[2], (M,)),
        0.1 * jax.random.normal(k[3], (M,)),
        jax.random.normal(k[4], shape),
    )


# (2, 8, 32): 16 rows, blocks of 16; (3, 5, 64): 15 rows, blocks of one row
@pytest.mark.parametrize("shape", [(2, 8, 32), (3, 5, 64)])
@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5])
def test_forward_and_gradients_match_flax_in_float32(shape, rate):
    x, y, g, b, w = _inputs(shape, jnp.float32)
    key = jax.random.key(7) if rate else None

    def loss(fn):
        return lambda x, y, g, b: jnp.sum(fn(x, y, g, b) * w)

    ref = lambda x, y, g, b: _reference(x, y, g, b, rate, key)  # noqa: E731
    fused = lambda x, y, g, b: residual_norm.post_norm(  # noqa: E731
        x, y, g, b, rate, key, eps=EPS
    )
    np.testing.assert_allclose(jax.jit(fused)(x, y, g, b), ref(x, y, g, b), atol=2e-6)
    want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(x, y, g, b)
    got = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2, 3)))(x, y, g, b)
    for name, a, c in zip(("dx", "dy", "dscale", "dbias"), want, got, strict=True):
        assert a.shape == c.shape and a.dtype == c.dtype, name
        scale = float(jnp.abs(a).max())
        assert scale > 0, name
        np.testing.assert_allclose(c, a, atol=1e-5 * max(scale, 1.0), err_msg=name)
    if rate:
        # dy is zero exactly where the hashed mask drops, at the reference's rate
        dropped = np.asarray(got[1]) == 0
        keep = np.asarray(kernels.keep_mask(key, rate, shape, "generic", "hash"))
        np.testing.assert_array_equal(dropped, ~keep)
        assert abs(dropped.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / dropped.size)


def test_bfloat16_within_its_rounding():
    """In bf16 the two may round z = x + dropout(y) differently (XLA keeps excess precision
    where it fuses the add into what reads it), so outputs differ by a bf16 step of z's
    scale at most, and most are equal (73% here)."""
    x, y, g, b, _ = _inputs((4, 8, 64), jnp.bfloat16, seed=3)
    key = jax.random.key(1)
    got = residual_norm.post_norm(x, y, g, b, 0.1, key, eps=EPS)
    want = _reference(x, y, g, b, 0.1, key)
    assert got.dtype == want.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=2.0**-6)
    assert (got == want).mean() > 0.6


def _model_loss_and_grads(residual, rate=0.1):
    cfg = variant(
        "tiny",
        vocab_size=50,
        d_model=64,
        dropout_rate=rate,
        kernels="generic",
        dropout_bits="hash",
        residual_norm=residual,
    )
    model = EncoderDecoder(cfg)
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.integers(3, 50, (3, 7)), jnp.int32).at[0, 5:].set(0)
    tgt = jnp.asarray(rng.integers(3, 50, (3, 6)), jnp.int32).at[2, 4:].set(0)
    params = nn.meta.unbox(model.init(jax.random.key(0), src, tgt)["params"])

    def loss(p):
        logits = model.apply(
            {"params": p}, src, tgt, deterministic=False, rngs={"dropout": jax.random.key(9)}
        )
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 3])

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return params, value, grads


def test_model_with_pallas_equals_xla_with_dropout():
    """The same parameter tree (a checkpoint loads either way), loss and gradients: the fused
    kernel draws the residual dropout's masks from the Dropout module's own key."""
    p_xla, l_xla, g_xla = _model_loss_and_grads("xla")
    with backend.pallas_interpreter():
        p_pal, l_pal, g_pal = _model_loss_and_grads("pallas")
    assert jax.tree.structure(p_xla) == jax.tree.structure(p_pal)
    jax.tree.map(np.testing.assert_array_equal, p_xla, p_pal)
    np.testing.assert_allclose(float(l_pal), float(l_xla), rtol=1e-6)
    _, l_off, _ = _model_loss_and_grads("xla", rate=0.0)
    assert abs(float(l_off) - float(l_xla)) > 1e-4  # the dropout is there to be matched
    flat_x, flat_p = jax.tree.leaves_with_path(g_xla), jax.tree.leaves(g_pal)
    for (path, a), c in zip(flat_x, flat_p, strict=True):
        scale = max(float(jnp.abs(a).max()), 1e-3)
        np.testing.assert_allclose(c, a, atol=2e-5 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"norm_position": "pre"}, "norm_position"),
        ({"norm": "rmsnorm"}, "norm"),
        ({"dropout_bits": "packed"}, "dropout_bits"),
        ({"dropout_bits": "auto"}, "dropout_bits"),  # 'auto' is not 'hash' on any platform
        ({"d_model": 48, "num_heads": 4}, "d_model"),
    ],
)
def test_config_names_what_pallas_cannot_fuse(overrides, key):
    with pytest.raises(ValueError, match=f"residual_norm='pallas'.*{key}|{key}.*residual_norm"):
        ModelConfig(vocab_size=32, residual_norm="pallas", **{"dropout_bits": "hash", **overrides})
    with pytest.raises(ValueError, match="model.residual_norm='fused'"):
        ModelConfig(vocab_size=32, residual_norm="fused")


def test_pallas_is_the_kernels_on_gpu_and_xla_elsewhere():
    """A GPU run's config evaluates on a CPU or trains on a TPU at that platform's speed:
    'pallas' resolves to the kernels for a GPU (or in the interpreter when asked), else to
    'xla'."""
    assert residual_norm.resolve("auto") == residual_norm.resolve("xla") == "xla"
    assert residual_norm.resolve("pallas") == "xla"  # this CPU
    with backend.target("tpu"):
        assert residual_norm.resolve("pallas") == "xla"
    with backend.target("gpu"):
        assert residual_norm.resolve("pallas") == "pallas"
    with backend.pallas_interpreter():
        assert residual_norm.resolve("pallas") == "pallas"


def test_lowers_for_cuda_as_two_triton_kernels():
    """For a GPU the step's LayerNorms are Triton kernels (forward and backward), not flax's."""
    x, y, g, b, w = _inputs((4, 16, 64), jnp.bfloat16)

    def loss(x, y, g, b):
        out = residual_norm.post_norm(x, y, g, b, 0.1, jax.random.key(2), eps=EPS, interpret=False)
        return jnp.sum(out.astype(jnp.float32) * w)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    try:
        text = grad.trace(x, y, g, b).lower(lowering_platforms=("cuda",)).as_text()
    except NotImplementedError as e:  # a jaxlib without Pallas' Triton lowering
        pytest.skip(f"Pallas' Triton lowering unavailable: {e}")
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert 'name = "residual_norm_fwd"' in text and 'name = "residual_norm_bwd"' in text


_SHARDED = r"""
import json
import flax.linen as nn
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from test_residual_norm import _inputs, EPS
from tx_jax.ops import residual_norm

x, y, g, b, w = _inputs((8, 6, 32), jnp.float32)
key = jax.random.key(4)

def loss(x, y, g, b):
    out = residual_norm.post_norm(x, y, g, b, 0.3, key, eps=EPS)
    return jnp.sum(out * w), out

grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
(_, want_out), want = grad(x, y, g, b)  # no mesh: one call over all rows
mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
with jax.set_mesh(mesh), nn.logical_axis_rules([("batch", ("data", "fsdp"))]):
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(("data", "fsdp"))))
    args = (put(x), put(y), g, b)
    text = grad.lower(*args).compile().as_text()
    (_, out), got = grad(*args)
print(json.dumps({
    "out": float(np.abs(np.asarray(out) - np.asarray(want_out)).max()),
    "grads": [float(np.abs(np.asarray(a) - np.asarray(c)).max()) for a, c in zip(want, got)],
    "out_sharding": str(out.sharding.spec),
    "all_gather": "all-gather" in text,
}))
"""


def test_sharded_batch_runs_per_shard_with_the_unsharded_masks():
    """8 CPU devices, the batch split over (data, fsdp): each device runs the kernels on its
    rows (no all-gather), hashing its masks from its rows' place in the whole, so outputs and
    gradients are the unsharded call's."""
    import json

    from helpers import run_python

    result = json.loads(run_python(_SHARDED).strip().splitlines()[-1])
    assert result["out"] <= 1e-6 and max(result["grads"]) <= 1e-5, result
    assert "data" in result["out_sharding"] and not result["all_gather"], result
