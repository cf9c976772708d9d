"""model.loss_impl='fused' (tx_jax/ops/fused_loss.py): the output layer and loss in Pallas
kernels that never write the [B, L, V] logits, run here in Pallas' interpreter and lowered for
a GPU, against the dense path (training/losses.loss_sums over h E^T + bias): the same sums and
gradients to float32 rounding, padded rows and vocabulary tails included, and the same train
step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import state_and_step

from tx_jax.model.config import ModelConfig, variant
from tx_jax.model.transformer import EncoderDecoder
from tx_jax.ops import backend, fused_loss, output_loss
from tx_jax.training import losses


def _problem(B, L, M, V, seed=0, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (B, L, M), dtype)
    table = jax.random.normal(k[1], (V, M)) * 0.2
    bias = jax.random.normal(k[2], (V,)) * 0.1
    targets = jax.random.randint(k[3], (B, L), 1, V)
    weights = (jax.random.uniform(k[4], (B, L)) > 0.2).astype(jnp.float32)
    return h, table, bias, targets, weights


def _dense(h, table, bias, targets, weights, smoothing):
    logits = jnp.einsum("blm,vm->blv", h, table.astype(h.dtype)).astype(jnp.float32)
    if bias is not None:
        logits = logits + bias
    return losses.loss_sums(logits, targets, weights, smoothing)


# (3, 37, 128, 300): rows and vocabulary padded to the tiles; (2, 64, 64, 256): neither
@pytest.mark.parametrize("shape", [(3, 37, 128, 300), (2, 64, 64, 256)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_sums_and_gradients_match_the_dense_path(shape, smoothing, with_bias):
    h, table, bias, targets, weights = _problem(*shape)
    bias = bias if with_bias else None

    def objective(fn):
        def f(h, table, bias, weights):
            s = fn(h, table, bias, targets, weights, smoothing)
            return s["loss"] + 0.3 * s["nll"] + 0.2 * s["correct"] + 0.1 * s["weight"], s

        return f

    fused = fused_loss.fused_output_loss
    (_, want), gw = jax.value_and_grad(objective(_dense), argnums=(0, 1, 2, 3), has_aux=True)(
        h, table, bias, weights
    )
    (_, got), gg = jax.jit(
        jax.value_and_grad(objective(fused), argnums=(0, 1, 2, 3), has_aux=True)
    )(h, table, bias, weights)
    for key in ("loss", "nll", "correct", "weight"):
        np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=1e-5, err_msg=key)
    for name, a, c in zip(("dh", "dtable", "dbias", "dweights"), gw, gg, strict=True):
        if a is None:
            assert c is None, name
            continue
        assert a.shape == c.shape and a.dtype == c.dtype, name
        scale = float(jnp.abs(a).max())
        assert scale > 0, name
        np.testing.assert_allclose(c, a, atol=2e-5 * scale, err_msg=name)


def test_bfloat16_hidden_states_round_logits_as_the_dense_path():
    h, table, bias, targets, weights = _problem(2, 64, 64, 200, seed=2, dtype=jnp.bfloat16)
    want = _dense(h, table, bias, targets, weights, 0.1)
    got = jax.jit(fused_loss.fused_output_loss, static_argnums=5)(
        h, table, bias, targets, weights, 0.1
    )
    for key in ("loss", "nll", "correct"):
        np.testing.assert_allclose(float(got[key]), float(want[key]), rtol=1e-5, err_msg=key)


def test_train_steps_match_onepass():
    """Five updates of the tiny model with dropout: the same losses with 'fused' (its kernels
    in the interpreter) as with 'onepass' (the same dropout masks, logits never written)."""
    V = 64
    tokens = np.random.default_rng(5).integers(3, V, size=(2, 4, 12))
    tokens[:, :, -3:] = 0
    batch = {"inputs": jnp.asarray(tokens[0], jnp.int32), "targets": jnp.asarray(tokens[1])}

    def run(loss_impl):
        cfg = variant("tiny", vocab_size=V, dropout_rate=0.1, loss_impl=loss_impl)
        state, step = state_and_step(EncoderDecoder(cfg), optax.adam(1e-3), 1e-3)
        out = []
        for _ in range(5):
            state, metrics = step(state, batch)
            out.append([float(metrics[k]) for k in ("loss", "nll", "accuracy", "grad_norm")])
        return np.array(out)

    with backend.pallas_interpreter():
        fused = run("fused")
    onepass = run("onepass")
    assert fused[-1, 0] < fused[0, 0]  # it learns
    np.testing.assert_allclose(fused, onepass, rtol=2e-5)


def test_config_names_a_width_the_tiles_cannot_take():
    with pytest.raises(ValueError, match="loss_impl='fused'.*multiple of 64"):
        ModelConfig(vocab_size=32, d_model=96, num_heads=4, loss_impl="fused")


def test_lowers_for_cuda_as_two_triton_kernels():
    """For a GPU: the statistics kernel in the forward pass, which leaves no [N, V] array in
    the program, and the kernel writing dz in the backward pass."""
    h, table, bias, targets, weights = _problem(2, 64, 64, 256, dtype=jnp.bfloat16)

    def loss(h, table):
        s = fused_loss.fused_output_loss(h, table, bias, targets, weights, 0.1, interpret=False)
        return s["loss"]

    try:
        forward = jax.jit(loss).trace(h, table).lower(lowering_platforms=("cuda",)).as_text()
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(h, table)
        text = text.lower(lowering_platforms=("cuda",)).as_text()
    except NotImplementedError as e:
        pytest.skip(f"Pallas' Triton lowering unavailable: {e}")
    assert forward.count("__gpu$xla.gpu.triton") == 1 and 'name = "fused_loss_fwd"' in forward
    assert "x256xf32>" not in forward and "x256xbf16>" not in forward  # no logits
    assert text.count("__gpu$xla.gpu.triton") == 2 and 'name = "fused_loss_dz"' in text
    assert "tensor<128x256xbf16>" in text  # dz, written once


def test_fused_resolves_to_the_kernels_on_gpu_and_to_auto_elsewhere():
    assert output_loss.resolve("fused") == "dense"  # this CPU's 'auto'
    with backend.target("tpu"):
        assert output_loss.resolve("fused") == "dense"
    with backend.target("gpu"):
        assert output_loss.resolve("fused") == "fused"
    with backend.pallas_interpreter():
        assert output_loss.resolve("fused") == "fused"


def test_a_direct_call_on_tpu_is_refused_not_interpreted():
    from tx_jax.ops import residual_norm

    h, table, bias, targets, weights = _problem(1, 64, 64, 128)
    with backend.target("tpu"), pytest.raises(ValueError, match="on TPU use 'auto'"):
        fused_loss.fused_output_loss(h, table, bias, targets, weights)
    x = h[..., :64]
    with backend.target("tpu"), pytest.raises(ValueError, match="on TPU use 'xla'"):
        residual_norm.post_norm(x, x, table[0], table[1], 0.0, None, eps=1e-6)


_SHARDED = r"""
import json
import flax.linen as nn
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from test_fused_loss import _problem
from tx_jax.ops import backend, fused_loss, output_loss

out = {}
for with_bias in (True, False):
    h, table, bias, targets, weights = _problem(8, 20, 64, 200, seed=6)
    bias = bias if with_bias else None

    def f(h, table, bias, weights):
        s = fused_loss.fused_output_loss(h, table, bias, targets, weights, 0.1)
        return s["loss"] + 0.5 * s["nll"], s

    grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))
    (_, want_sums), want = grad(h, table, bias, weights)
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
    with jax.set_mesh(mesh), nn.logical_axis_rules([("batch", ("data", "fsdp"))]):
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P(("data", "fsdp"))))
        targets = put(targets)
        args = (put(h), table, bias, put(weights))
        text = grad.lower(*args).compile().as_text()
        (_, sums), got = grad(*args)
    out[str(with_bias)] = {
        "sums": [abs(float(sums[k]) - float(want_sums[k])) / max(abs(float(want_sums[k])), 1.0)
                 for k in ("loss", "nll", "correct", "weight")],
        "grads": [float(np.abs(np.asarray(a) - np.asarray(c)).max() / np.abs(np.asarray(a)).max())
                  for a, c in zip(jax.tree.leaves(want), jax.tree.leaves(got))],
        "all_gather": "all-gather" in text,
    }
print(json.dumps(out))
"""


def test_sharded_batch_runs_per_shard_and_adds_the_sums():
    """8 CPU devices, the batch split over (data, fsdp): each device's tokens in its own
    kernels (no all-gather of the hidden states), the sums and the table's gradient added
    across devices: the unsharded call's values."""
    import json

    from helpers import run_python

    result = json.loads(run_python(_SHARDED).strip().splitlines()[-1])
    for case in result.values():
        assert max(case["sums"]) <= 1e-5 and max(case["grads"]) <= 1e-5, result
        assert not case["all_gather"], result
