"""training/losses.py's blocked path (loss_impl='blocked': the output layer fused with the loss)
against its dense path over full logits, the reference: sums, gradients of every parameter, and
whole train steps."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import state_and_step

from tx_jax.model.config import ModelConfig, variant
from tx_jax.model.transformer import DecoderOnly, EncoderDecoder
from tx_jax.training import losses
from tx_jax.training.step import _loss_sums

V = 29
KEYS = ("loss", "nll", "correct", "weight")


def _dense_sums(h, table, bias, targets, weights, eps):
    z = jnp.einsum("blm,vm->blv", h, table.astype(h.dtype)).astype(jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    loss, weight = losses.smoothed_cross_entropy(z, targets, weights, eps)
    return {
        "loss": loss,
        "nll": losses.nll(z, targets, weights)[0],
        "correct": losses.accuracy(z, targets, weights)[0],
        "weight": weight,
    }


def _arrays(seed=0, B=3, L=11, M=8, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    targets = rng.integers(1, V, size=(B, L))
    targets[:, -3:] = 0  # padding
    h = jnp.asarray(rng.normal(size=(B, L, M)), dtype)
    table = jnp.asarray(rng.normal(size=(V, M)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(V,)), jnp.float32)
    targets = jnp.asarray(targets, jnp.int32)
    return h, table, bias, targets, (targets > 0).astype(jnp.float32)


def _close(a, b, rel):
    """max |a - b| <= rel * max |a|, leaf by leaf."""
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.abs(x - y).max() <= rel * max(np.abs(x).max(), 1e-30), (x, y)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("block", [1, 4, 11, 64])
def test_function_matches_dense_sums_and_every_cotangent(eps, block):
    """Every output gets a cotangent (the step ignores nll's; the function must not): the
    gradients w.r.t. h, the table, the bias and the weights equal autodiff of the dense path.
    L = 11 is not a multiple of 4 (padded), and is below 64 (one block)."""
    h, table, bias, targets, weights = _arrays()
    dense = _dense_sums(h, table, bias, targets, weights, eps)
    blocked = losses.output_loss(h, table, bias, targets, weights, eps, block)
    _close([dense[k] for k in KEYS], [blocked[k] for k in KEYS], 1e-6)
    assert float(blocked["weight"]) == 24.0 and float(blocked["correct"]) >= 0

    def scalar(fn):
        def f(h, table, bias, weights):
            s = fn(h, table, bias, targets, weights)
            return s["loss"] + 0.3 * s["nll"] - 0.5 * s["correct"] + 0.7 * s["weight"]

        return jax.grad(f, argnums=(0, 1, 2, 3))

    g_dense = scalar(functools.partial(_dense_sums, eps=eps))(h, table, bias, weights)
    g_blocked = scalar(lambda *a: losses.output_loss(*a, label_smoothing=eps, block=block))(
        h, table, bias, weights
    )
    _close(g_dense, g_blocked, 1e-5)


def test_perfect_prediction_and_ties_count_as_the_dense_path_counts():
    """Hand-made logits: a target far above the rest gives smoothed loss ~0 (the entropy
    offset) and a hit; a target tied with the max is a hit; one below it is not."""
    M = 2
    table = jnp.zeros((V, M)).at[1, 0].set(1.0).at[2, 0].set(1.0)  # tokens 1, 2 tie
    h = jnp.array([[[40.0, 0.0], [40.0, 0.0], [40.0, 0.0]]])  # logits 40 on tokens 1 and 2
    targets = jnp.array([[1, 2, 3]])
    out = losses.output_loss(h, table, None, targets, jnp.ones((1, 3)), 0.0, block=2)
    assert float(out["correct"]) == 2.0
    np.testing.assert_allclose(float(out["nll"]), 2 * np.log(2) + (40 + np.log(2)), rtol=1e-6)
    # one target alone at 40: smoothed loss -> 0 only with q's entropy removed
    h1, t1 = jnp.array([[[40.0, 0.0]]]), jnp.array([[4]])
    table1 = jnp.zeros((V, M)).at[4, 0].set(1.0)
    eps = 0.1
    got = losses.output_loss(h1, table1, None, t1, jnp.ones((1, 1)), eps, block=8)
    want = _dense_sums(h1, table1, None, t1, jnp.ones((1, 1)), eps)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)


def test_bad_block_shapes_and_names_error():
    h, table, bias, targets, weights = _arrays()
    for block in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="loss_block"):
            losses.output_loss(h, table, bias, targets, weights, 0.0, block)
    with pytest.raises(ValueError, match="table"):
        losses.output_loss(h, table.T, bias, targets, weights, 0.0, 4)
    with pytest.raises(ValueError, match="bias"):
        losses.output_loss(h, table, bias[:-1], targets, weights, 0.0, 4)
    with pytest.raises(ValueError, match="loss_block"):
        ModelConfig(loss_block=0)
    with pytest.raises(ValueError, match="loss_impl"):
        ModelConfig(loss_impl="onepass")


MODELS = {
    # the paper's model: tied output, one table shared by source and target
    "tied_shared": (EncoderDecoder, {}),
    "tied_target_embed": (EncoderDecoder, {"share_embeddings": False, "target_vocab_size": 31}),
    # Marian-like: untied kernel plus final_logits_bias, pre-LN
    "untied_bias": (
        EncoderDecoder,
        {"tie_output": False, "logits_bias": True, "norm_position": "pre"},
    ),
    "lm_untied_bias": (DecoderOnly, {"tie_output": False, "logits_bias": True}),
}


def _model(name, **kw):
    cls, extra = MODELS[name]
    cfg = variant("tiny", vocab_size=V, num_encoder_layers=1, num_decoder_layers=1, **extra, **kw)
    model = cls(cfg)
    args = (jnp.ones((1, 8), jnp.int32),) * (1 if cls is DecoderOnly else 2)
    params = nn.meta.unbox(model.init(jax.random.key(0), *args)["params"])
    # a nonzero bias, so that its gradient and its place in the logits are checked
    if cfg.logits_bias:
        params["decoder"]["logits_bias"] = jax.random.normal(jax.random.key(1), (V,)) * 0.5
    return model, params


def _batch(seed=0, rows=4, length=11):
    tokens = np.random.default_rng(seed).integers(3, V, size=(2, rows, length))
    tokens[:, 0, -4:] = 0  # padding at the end of some rows
    tokens[:, 2, -1:] = 0
    return {"inputs": jnp.asarray(tokens[0], jnp.int32), "targets": jnp.asarray(tokens[1])}


@pytest.mark.parametrize("name", list(MODELS))
def test_hidden_states_project_to_the_models_logits(name):
    """return_hidden=True gives h with logits = float32(h table^T) + bias exactly."""
    model, params = _model(name)
    batch = _batch()
    args = (
        (batch["targets"],)
        if isinstance(model, DecoderOnly)
        else (batch["inputs"], batch["targets"])
    )
    logits = model.apply({"params": params}, *args)
    hidden = model.apply({"params": params}, *args, return_hidden=True)
    assert hidden.shape == (4, 11, 64)
    table, bias = model.apply({"params": params}, method="output_weights")
    z = jnp.einsum("blm,vm->blv", hidden, table).astype(jnp.float32)
    z = z if bias is None else z + bias
    np.testing.assert_allclose(np.asarray(z), np.asarray(logits), rtol=1e-6, atol=1e-6)


# Each model once, each smoothing twice (the output layers differ by model; smoothing's terms
# are the loss functions' own, checked with every block size above).
@pytest.mark.parametrize(
    "name,eps",
    [
        ("tied_shared", 0.1),
        ("tied_target_embed", 0.0),
        ("untied_bias", 0.1),
        ("lm_untied_bias", 0.0),
    ],
)
def test_loss_sums_and_gradients_of_every_param_match_dense(name, eps):
    """The step's loss function with loss_impl='blocked' (block 4 over L = 11: padded) equals
    'dense' in float32: sums, and the gradient of every parameter within 1e-5 relative."""
    sums, grads = {}, {}
    for impl in ("dense", "blocked"):
        model, params = _model(name, loss_impl=impl, loss_block=4)
        fn = jax.grad(
            functools.partial(_loss_sums, model, label_smoothing=eps, deterministic=True),
            has_aux=True,
        )
        grads[impl], sums[impl] = jax.jit(fn)(params, _batch(), None)
    for impl in ("blocked",):
        _close([sums["dense"][k] for k in KEYS], [sums[impl][k] for k in KEYS], 1e-5)
        assert float(sums[impl]["weight"]) == 4 * 11 - 5
        assert jax.tree_util.tree_structure(grads["dense"]) == jax.tree_util.tree_structure(
            grads[impl]
        )
        _close(grads["dense"], grads[impl], 1e-5)


@pytest.mark.parametrize("name,accum", [("tied_shared", 1), ("lm_untied_bias", 2)])
def test_train_steps_with_blocked_loss_equal_dense(name, accum):
    """Three train steps with dropout on (the same masks: the model is the same up to its
    output layer): the metrics and the parameters' updates of 'blocked' equal 'dense'. SGD
    with momentum, linear in the gradients, so the updates compare the steps' gradients; Adam
    divides each entry by its own scale, which turns float-rounding differences in near-zero
    gradients into visible updates (2e-4 of a leaf on a Zen 4 VM with AVX-512), whatever the
    loss's implementation."""
    out = {}
    for impl in ("dense", "blocked"):
        model, params = _model(name, loss_impl=impl, loss_block=4, dropout_rate=0.1)
        tx = optax.sgd(0.5, momentum=0.9)
        state, step = state_and_step(model, tx, 1e-2, params, grad_accum_steps=accum)
        history = []
        for i in range(3):
            state, metrics = step(state, _batch(seed=i))
            history.append(metrics)
        out[impl] = (history, jax.tree_util.tree_map(lambda a, b: a - b, state.params, params))
    for impl in ("blocked",):
        for m_dense, m_other in zip(out["dense"][0], out[impl][0], strict=True):
            for k in ("loss", "nll", "accuracy", "tokens", "grad_norm"):
                np.testing.assert_allclose(float(m_other[k]), float(m_dense[k]), rtol=1e-5)
        _close(out["dense"][1], out[impl][1], 1e-5)
    assert float(out["dense"][0][0]["tokens"]) == 4 * 11 - 5


def test_bfloat16_blocked_matches_dense_within_bfloat16_rounding():
    """Compute in bfloat16 (the product rounds to bfloat16 in both paths): the sums agree to
    bfloat16's precision, the gradients to a few of its ulps of their scale."""
    sums, grads = {}, {}
    for impl in ("dense", "blocked"):
        model, params = _model("untied_bias", loss_impl=impl, loss_block=4, dtype="bfloat16")
        fn = jax.grad(
            functools.partial(_loss_sums, model, label_smoothing=0.1, deterministic=True),
            has_aux=True,
        )
        grads[impl], sums[impl] = jax.jit(fn)(params, _batch(), None)
    for k in KEYS:
        np.testing.assert_allclose(
            float(sums["blocked"][k]), float(sums["dense"][k]), rtol=1e-2, err_msg=k
        )
    assert jax.tree_util.tree_leaves(grads["blocked"])[0].dtype == jnp.float32
    _close(grads["dense"], grads["blocked"], 3e-2)
