"""tx_jax.ops.kernels / model.kernels and model.dropout_bits: the CPU kernels and the generic
ones compute the same model, the CPU config uses them, and each dropout generator is a proper
dropout on any layout."""

import collections
import dataclasses
import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import run_python

from tx_jax.inference.locate import HARMLESS_MODEL_KEYS
from tx_jax.model.config import ModelConfig, variant
from tx_jax.model.transformer import DecoderOnly, EncoderDecoder
from tx_jax.ops import kernels as K
from tx_jax.training.state import TrainState
from tx_jax.training.step import train_step

V = 29


def _batch(seed=0, rows=4, length=9):
    tokens = np.random.default_rng(seed).integers(3, V, size=(2, rows, length))
    tokens[:, :, -2:] = 0  # some padding
    return {"inputs": jnp.asarray(tokens[0], jnp.int32), "targets": jnp.asarray(tokens[1])}


def _state_and_step(cls, cfg):
    """(state, jitted train_step) with plain SGD at lr 1: the update is -grad/tokens exactly."""
    model = cls(cfg)
    args = (jnp.ones((1, 8), jnp.int32),) * (1 if cls is DecoderOnly else 2)
    params = nn.meta.unbox(model.init(jax.random.key(0), *args)["params"])
    tx = optax.sgd(1.0)
    zero = jnp.zeros((), jnp.int32)
    state = TrainState(zero, params, tx.init(params), jax.random.PRNGKey(5), zero, zero)
    step = functools.partial(
        train_step, model=model, tx=tx, schedule=lambda s: 1.0, label_smoothing=0.1
    )
    return state, jax.jit(step)


def _tiny(**kw):
    return variant("tiny", vocab_size=V, num_encoder_layers=1, num_decoder_layers=1, **kw)


@pytest.mark.parametrize(
    "cls,extra",
    [
        (EncoderDecoder, {}),
        (DecoderOnly, {"tie_output": False, "activation": "swiglu", "norm_position": "pre"}),
    ],
    ids=["encoder_decoder", "decoder_only"],
)
def test_cpu_and_generic_kernels_give_the_same_loss_and_gradients(cls, extra):
    """Dropout off: the two implementations are the same function up to float rounding
    (rtol 1e-5 on every gradient leaf, 1e-6 on the loss)."""
    results = {}
    for kernels in ("cpu", "generic"):
        state, step = _state_and_step(cls, _tiny(kernels=kernels, **extra))
        new, metrics = step(state, _batch())
        grads = jax.tree_util.tree_map(lambda a, b: a - b, state.params, new.params)
        results[kernels] = (float(metrics["loss"]), grads)
    (loss_c, grads_c), (loss_g, grads_g) = results["cpu"], results["generic"]
    assert loss_c > 1.0
    np.testing.assert_allclose(loss_g, loss_c, rtol=1e-6)
    leaves_c, tree = jax.tree_util.tree_flatten(grads_c)
    leaves_g = tree.flatten_up_to(grads_g)
    assert sum(float(jnp.abs(g).sum()) for g in leaves_c) > 0
    for c, g in zip(leaves_c, leaves_g, strict=True):
        np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-7)


def _primitives(jaxpr, counts=None) -> collections.Counter:
    """How often each primitive occurs in `jaxpr` and its sub-jaxprs (scans, custom VJPs)."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    _primitives(sub, counts)
    return counts


@pytest.mark.parametrize(
    "cls,extra,draws",
    [(EncoderDecoder, {}, 12), (DecoderOnly, {"attention_impl": "chunked"}, 7)],
    ids=["encoder_decoder", "decoder_only_chunked"],
)
def test_every_projection_and_dropout_follows_model_kernels(cls, extra, draws):
    """The gradient's jaxpr: 'generic' has no optimisation barrier (no CPU matmul VJP) and
    one jax.random draw per dropout site (EncoderDecoder 1+1 layers: 2 embeddings, 3 + 5
    residual/attention/FFN sites, + 2 cross-attention; DecoderOnly: 4 outside attention, the
    chunked attention's forward and two in its backward); the CPU kernels with their packed
    masks the reverse, and a config resolved for a CPU is those."""
    rates = {"dropout_rate": 0.1, "attention_dropout_rate": 0.1, "ffn_dropout_rate": 0.1}
    batch = _batch()
    args = (batch["targets"],) if cls is DecoderOnly else (batch["inputs"], batch["targets"])
    configs = {
        "resolved": _tiny(kernels="auto", dropout_bits="auto", **rates, **extra).resolved("cpu"),
        "cpu": _tiny(kernels="cpu", dropout_bits="packed", **rates, **extra),
        "generic": _tiny(kernels="generic", dropout_bits="bernoulli", **rates, **extra),
    }
    found = {}
    for name, cfg in configs.items():
        model = cls(cfg)
        params = model.init(jax.random.key(0), *args)["params"]

        def loss(p, model=model):
            rngs = {"dropout": jax.random.key(1)}
            return model.apply({"params": p}, *args, deterministic=False, rngs=rngs).sum()

        counts = _primitives(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
        found[name] = counts["optimization_barrier"], counts["random_bits"]
    assert found["generic"] == (0, draws)
    assert found["cpu"][0] > 0 and found["cpu"][1] == 0
    assert found["resolved"] == found["cpu"]


def _has_barrier(kernels: str) -> bool:
    x, w = jnp.ones((6, 4)), jnp.ones((4, 5))
    grad = jax.grad(lambda x, w: K.dense(x, w, kernels=kernels).sum(), argnums=(0, 1))
    return "optimization_barrier" in str(jax.make_jaxpr(grad)(x, w))


def test_cpu_kernels_alone_hold_optimisation_barriers_and_bad_values_name_the_key():
    assert _has_barrier("cpu") and not _has_barrier("generic")
    with pytest.raises(ValueError, match="model.kernels='gpu'"):
        ModelConfig(kernels="gpu")
    with pytest.raises(ValueError, match="model.kernels='fast'"):
        ModelConfig.from_config({"kernels": "fast"})


def test_kernels_is_one_of_restores_harmless_model_keys():
    """model.kernels changes the computation, not the parameters: restore does not warn when
    it differs from the checkpoint's (locate.HARMLESS_MODEL_KEYS, all ModelConfig fields)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert "kernels" in HARMLESS_MODEL_KEYS and fields >= HARMLESS_MODEL_KEYS


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_generic_dropout_keeps_the_rate_and_scale(impl):
    rate, shape = 0.1, (64, 1000)
    out = K.dropout(jnp.ones(shape), rate, jax.random.key(3, impl=impl), "bernoulli")
    values = np.unique(np.asarray(out))
    np.testing.assert_allclose(values, [0.0, 1 / (1 - rate)], rtol=1e-6)
    n = out.size
    dropped = float((out == 0).mean())
    assert abs(dropped - rate) < 4 * np.sqrt(rate * (1 - rate) / n), dropped
    # not rounded to 2^-16 like the CPU masks
    assert K.effective_rate(rate, "bernoulli") == rate


def test_generic_dropout_differs_between_steps_of_the_train_step():
    """The train step folds its step number into the key: two steps from the same parameters
    give different losses with dropout on (and equal ones with it off)."""
    losses = {}
    for rate in (0.0, 0.3):
        cfg = _tiny(kernels="generic", dropout_rate=rate, ffn_dropout_rate=rate)
        state, step = _state_and_step(DecoderOnly, cfg)
        one = step(state, _batch())[1]["loss"]
        two = step(state.replace(step=state.step + 1), _batch())[1]["loss"]
        losses[rate] = float(one), float(two)
    assert losses[0.0][0] == losses[0.0][1]
    assert abs(losses[0.3][0] - losses[0.3][1]) > 1e-3, losses


def test_generic_masks_across_pmap_devices_and_a_sharded_jit():
    """8 forced devices: under pmap (the key folded with axis_index, as train_step does) the
    8 masks differ pairwise and each keeps the rate; under a jit over a mesh, the mask of an
    array sharded 8 ways equals the unsharded mask and is drawn shard by shard without
    collectives (jax.random.bernoulli with jax_threefry_partitionable); and the pmap train
    step with the same batch on every device sees 8 different masks."""
    out = run_python(_EIGHT_DEVICES)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["devices"] == 8
    assert result["pairs_equal"] == 0
    assert all(abs(r - 0.25) < 4 * np.sqrt(0.25 * 0.75 / (16 * 512)) for r in result["rates"])
    assert result["sharded_equals_unsharded"]
    assert result["collectives"] == []  # each device draws only its shard of the mask
    # Same batch everywhere: different masks per device make the mean loss differ from one
    # device's; without dropout they agree.
    assert abs(result["pmap_loss"] - result["single_loss"]) > 1e-4, result
    assert abs(result["pmap_loss_nodrop"] - result["single_loss_nodrop"]) < 1e-5, result


_EIGHT_DEVICES = r"""
import functools, json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import test_kernels as T
from tx_jax.model.transformer import DecoderOnly
from tx_jax.ops import kernels as K
from tx_jax.training.step import train_step

# jax's default from 0.5 (the declared range starts at 0.4.35); kernels.py recommends it.
jax.config.update("jax_threefry_partitionable", True)
n = jax.device_count()
x = jnp.ones((n, 16, 512))

@functools.partial(jax.pmap, axis_name="batch")
def masks(x):
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 7), jax.lax.axis_index("batch"))
    return K.dropout(x, 0.25, rng, "bernoulli") != 0

m = np.asarray(masks(x))
pairs = sum(int((m[i] == m[j]).all()) for i in range(n) for j in range(i + 1, n))
rates = [float(1 - m[i].mean()) for i in range(n)]

mesh = Mesh(np.array(jax.devices()), ("data",))
y = jnp.ones((n * 16, 512))
f = jax.jit(lambda y: K.dropout(y, 0.25, jax.random.key(1), "bernoulli"))
sharded = f(jax.device_put(y, NamedSharding(mesh, P("data"))))
unsharded = f(jax.device_put(y, jax.devices()[0]))
assert len(sharded.sharding.device_set) == n
hlo = f.lower(jax.device_put(y, NamedSharding(mesh, P("data")))).compile().as_text()
collectives = [op for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all")
               if op in hlo]

def losses(rate):
    cfg = T._tiny(kernels="generic", dropout_rate=rate, ffn_dropout_rate=rate)
    state, step = T._state_and_step(DecoderOnly, cfg)
    batch = T._batch()
    single = float(step(state, batch)[1]["loss"])
    raw = functools.partial(train_step, model=DecoderOnly(cfg), tx=__import__("optax").sgd(1.0),
                            schedule=lambda s: 1.0, label_smoothing=0.1, axis_name="batch")
    rep = lambda t: jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), t)
    _, metrics = jax.pmap(raw, axis_name="batch")(rep(state), rep(batch))
    return float(metrics["loss"][0]), single

pmap_loss, single_loss = losses(0.3)
pmap_nodrop, single_nodrop = losses(0.0)
print(json.dumps({
    "devices": n, "pairs_equal": pairs, "rates": rates,
    "collectives": collectives,
    "sharded_equals_unsharded": bool((np.asarray(sharded) == np.asarray(unsharded)).all()),
    "pmap_loss": pmap_loss, "single_loss": single_loss,
    "pmap_loss_nodrop": pmap_nodrop, "single_loss_nodrop": single_nodrop,
}))
"""


def test_cpu_bfloat16_matmuls_accumulate_in_float32_and_round_once():
    """bfloat16 operands: the CPU kernels' dots produce float32 (XLA:CPU then uses the CPU's
    bfloat16 matrix units where it has them) and round the result once; forward and
    gradients equal float32 arithmetic on the same bfloat16 inputs, rounded to bfloat16."""
    from tx_jax.ops import matmul

    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    x = jnp.asarray(rng.normal(size=(4, 16, 32)), bf)  # 64 rows: split 64 x 1 in backward
    w = jnp.asarray(rng.normal(size=(32, 48)), bf)
    table = jnp.asarray(rng.normal(size=(40, 32)), bf)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_array_equal(f32(matmul.dense(x, w)), f32(jnp.asarray(f32(x) @ f32(w), bf)))
    np.testing.assert_array_equal(
        f32(matmul.tied_logits(x, table)), f32(jnp.asarray(f32(x) @ f32(table).T, bf))
    )
    hlo = jax.jit(matmul.dense).lower(x, w).as_text()
    assert "-> tensor<4x16x48xf32>" in hlo  # the dot's own result is float32

    def loss(fn, a, b):
        return jnp.sum(fn(a, b).astype(jnp.float32) ** 2)

    for fn, b in ((matmul.dense, w), (matmul.tied_logits, table)):
        got = jax.grad(functools.partial(loss, fn), argnums=(0, 1))(x, b)
        ref = jax.grad(functools.partial(loss, fn), argnums=(0, 1))(
            x.astype(jnp.float32), b.astype(jnp.float32)
        )
        for g, r in zip(got, ref):
            assert g.dtype == bf
            np.testing.assert_allclose(f32(g), f32(r), rtol=0.05, atol=0.05 * np.abs(r).max())
    # the weight gradient's split contraction is the plain one's sum
    g = jnp.asarray(rng.normal(size=(64, 48)), bf)
    x_t = x.reshape(64, 32).T
    np.testing.assert_allclose(
        f32(matmul._contract_rows(x_t, g)),
        f32(jnp.asarray(f32(x_t) @ f32(g), bf)),
        rtol=0.01,
        atol=1e-3 * np.abs(f32(x_t) @ f32(g)).max(),
    )
    # bias_add: the bias gradient is the cotangent summed over every row, in float32
    y = jnp.asarray(rng.normal(size=(4, 16, 48)), bf)
    b = jnp.asarray(rng.normal(size=(48,)), jnp.float32)
    out, vjp = jax.vjp(matmul.bias_add, y, b)
    assert out.dtype == bf
    np.testing.assert_array_equal(f32(out), f32(y + b.astype(bf)))
    dy, db = vjp(y)
    np.testing.assert_array_equal(f32(dy), f32(y))
    np.testing.assert_allclose(db, f32(y).reshape(64, 48).sum(0), rtol=1e-6)


@pytest.mark.parametrize("bits", ["bernoulli", "packed"])
def test_every_dropout_generator_keeps_the_rate_and_scale_and_is_a_function_of_the_key(bits):
    rate, shape = 0.1, (64, 1000)
    x = jnp.ones(shape)
    out = K.dropout(x, rate, jax.random.key(3), bits)
    used = K.effective_rate(rate, bits)
    expected = {"bernoulli": rate, "packed": 6554 / 65536}[bits]
    assert used == expected
    np.testing.assert_allclose(np.unique(np.asarray(out)), [0.0, 1 / (1 - used)], rtol=1e-6)
    dropped = float((out == 0).mean())
    assert abs(dropped - used) < 4 * np.sqrt(used * (1 - used) / out.size), dropped
    again = K.dropout(x, rate, jax.random.key(3), bits)
    other = K.dropout(x, rate, jax.random.key(4), bits)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))  # resume: same key, same mask
    assert float((out != other).mean()) > 0.1  # another key, another mask


def test_packed_bits_are_the_cpu_kernels_masks_and_bad_values_name_the_key():
    key, shape = jax.random.key(5), (8, 37)
    from tx_jax.ops import dropout as D

    np.testing.assert_array_equal(
        np.asarray(K.keep_mask(key, 0.2, shape, "packed")), np.asarray(D.keep_mask(key, 0.2, shape))
    )
    with pytest.raises(ValueError, match="model.dropout_bits='philox'"):
        ModelConfig(dropout_bits="philox")


@pytest.mark.parametrize("bits", ["packed", "bernoulli"])
def test_train_step_with_each_dropout_generator_is_repeatable_and_differs_between_steps(bits):
    cfg = _tiny(kernels="generic", dropout_rate=0.3, ffn_dropout_rate=0.3, dropout_bits=bits)
    state, step = _state_and_step(DecoderOnly, cfg)
    one = float(step(state, _batch())[1]["loss"])
    assert one == float(step(state, _batch())[1]["loss"])
    two = float(step(state.replace(step=state.step + 1), _batch())[1]["loss"])
    assert abs(one - two) > 1e-3, (one, two)
    plain = _state_and_step(DecoderOnly, cfg.replace(dropout_rate=0.0, ffn_dropout_rate=0.0))
    assert abs(one - float(plain[1](plain[0], _batch())[1]["loss"])) > 1e-3


def test_the_attention_weights_dropout_follows_the_models_dropout_bits():
    """The model hands dropout_bits to its attention: with only the weights' dropout on,
    another generator gives another loss."""
    cfg = _tiny(kernels="generic", dropout_rate=0.0, ffn_dropout_rate=0.0)
    cfg = cfg.replace(attention_dropout_rate=0.3, attention_impl="xla")
    losses = {}
    for bits in ("packed", "bernoulli"):
        state, step = _state_and_step(DecoderOnly, cfg.replace(dropout_bits=bits))
        losses[bits] = float(step(state, _batch())[1]["loss"])
    assert abs(losses["packed"] - losses["bernoulli"]) > 1e-4, losses
