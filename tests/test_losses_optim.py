"""Label-smoothed cross-entropy, accuracy, and the learning-rate schedules."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tx_jax.training import losses, optim


def _ref_smoothed_ce(logits, targets, weights, eps):
    logits = np.asarray(logits, np.float64)
    V = logits.shape[-1]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    q = np.full(logits.shape, eps / (V - 1))
    np.put_along_axis(q, np.asarray(targets)[..., None], 1 - eps, axis=-1)
    ce = -(q * logp).sum(-1)
    entropy = -(q * np.log(np.where(q > 0, q, 1.0))).sum(-1)
    return ((ce - entropy) * weights).sum()


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_smoothed_cross_entropy_matches_float64_reference(eps):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 11)).astype(np.float32)
    targets = rng.integers(1, 11, size=(3, 5))
    weights = (rng.random((3, 5)) > 0.3).astype(np.float32)
    loss, w = losses.smoothed_cross_entropy(jnp.asarray(logits), targets, weights, eps)
    np.testing.assert_allclose(loss, _ref_smoothed_ce(logits, targets, weights, eps), rtol=1e-5)
    assert float(w) == weights.sum()


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_smoothed_cross_entropy_gradient_is_softmax_minus_q(eps):
    """The custom VJP equals autodiff of the textbook -sum_v q_v log_softmax(z)_v."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32)
    targets = jnp.asarray(rng.integers(1, 7, size=(2, 3)))
    weights = jnp.asarray(rng.random((2, 3)) > 0.3, jnp.float32)

    def textbook(z):
        q = jnp.where(jax.nn.one_hot(targets, 7) > 0, 1 - eps, eps / 6)
        return (-(q * jax.nn.log_softmax(z)).sum(-1) * weights).sum()

    ours = jax.grad(lambda z: losses.smoothed_cross_entropy(z, targets, weights, eps)[0])
    np.testing.assert_allclose(jax.jit(ours)(logits), jax.grad(textbook)(logits), atol=1e-6)


def test_perfect_prediction_has_zero_smoothed_loss():
    V, eps = 6, 0.1
    q = np.full((1, 1, V), eps / (V - 1))
    q[0, 0, 2] = 1 - eps
    loss, _ = losses.smoothed_cross_entropy(
        jnp.log(jnp.asarray(q)), jnp.array([[2]]), jnp.ones((1, 1)), eps
    )
    assert abs(float(loss)) < 1e-6


def test_accuracy_counts_weighted_argmax_hits():
    logits = jnp.array([[[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]]])
    correct, w = losses.accuracy(logits, jnp.array([[1, 1, 2]]), jnp.array([[1.0, 1.0, 0.0]]))
    assert (float(correct), float(w)) == (1.0, 2.0)
    # a tie for the largest logit counts as a hit, whichever index argmax would pick
    tie = jnp.array([[[3.0, 3.0, 0.0], [3.0, 3.0, 0.0]]])
    correct, _ = losses.accuracy(tie, jnp.array([[0, 1]]), jnp.ones((1, 2)))
    assert float(correct) == 2.0


def test_accuracy_agrees_with_argmax_without_ties():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 16, 50)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 50, (4, 16)))
    targets = targets.at[:, ::3].set(jnp.argmax(logits, -1)[:, ::3])  # some hits
    weights = jnp.asarray(rng.integers(0, 2, (4, 16)), jnp.float32)
    expected = float(((jnp.argmax(logits, -1) == targets) * weights).sum())
    assert expected > 0
    assert float(losses.accuracy(logits, targets, weights)[0]) == expected


def _train_cfg(**kw):
    base = dict(
        schedule="rsqrt",
        warmup_steps=4000,
        lr_scale=1.0,
        peak_lr=1e-3,
        final_lr_fraction=0.1,
        num_steps=100_000,
        beta1=0.9,
        beta2=0.98,
        eps=1e-9,
        weight_decay=0.0,
        clip_grad_norm=0.0,
    )
    base.update(kw)
    return ml_collections.ConfigDict(base)


def test_paper_schedule_values():
    """lrate = d^-0.5 min(step^-0.5, step warmup^-1.5): step 1, warmup, 4 x warmup."""
    sched = optim.make_schedule(_train_cfg(), d_model=512)
    d, w = 512, 4000
    # Optax count c is the (c+1)-th update: step = c + 1
    np.testing.assert_allclose(sched(0), d**-0.5 * 1 * w**-1.5, rtol=1e-6)
    np.testing.assert_allclose(sched(w - 1), d**-0.5 * w**-0.5, rtol=1e-6)  # the peak, 6.99e-4
    np.testing.assert_allclose(sched(4 * w - 1), d**-0.5 * (4 * w) ** -0.5, rtol=1e-6)
    assert float(sched(w - 1)) == pytest.approx(6.988e-4, rel=1e-3)
    assert float(sched(4 * w - 1)) == pytest.approx(float(sched(w - 1)) / 2, rel=1e-6)


def test_other_schedules():
    lin = optim.make_schedule(_train_cfg(schedule="linear_rsqrt", warmup_steps=10), 512)
    np.testing.assert_allclose([lin(0), lin(9), lin(39)], [1e-4, 1e-3, 5e-4], rtol=1e-6)
    cos = optim.make_schedule(_train_cfg(schedule="cosine", warmup_steps=10, num_steps=110), 512)
    np.testing.assert_allclose([cos(10), cos(110)], [1e-3, 1e-4], rtol=1e-5)
    with pytest.raises(ValueError, match="train.schedule='exp'"):
        optim.make_schedule(_train_cfg(schedule="exp"), 512)


def test_cooldown_ramps_the_last_updates_down_and_leaves_the_rest():
    """cooldown_steps=C: updates before num_steps - C follow the schedule exactly; then the
    rate falls linearly, to 1/C of the schedule at the last update."""
    plain = optim.make_schedule(_train_cfg(warmup_steps=10, num_steps=100), 512)
    cool = optim.make_schedule(_train_cfg(warmup_steps=10, num_steps=100, cooldown_steps=20), 512)
    counts = np.arange(100)
    got, ref = np.asarray([cool(c) for c in counts]), np.asarray([plain(c) for c in counts])
    np.testing.assert_array_equal(got[:80], ref[:80])
    np.testing.assert_allclose(got[80:], ref[80:] * (100 - counts[80:]) / 20, rtol=1e-6)
    assert got[99] == pytest.approx(ref[99] / 20, rel=1e-6) and float(cool(100)) == 0.0


def test_optimizer_is_adam_with_paper_betas_and_clipping():
    tx, _ = optim.make_optimizer(_train_cfg(clip_grad_norm=1.0, schedule="constant"), 512)
    params = {"w": jnp.zeros(3)}
    grads = {"w": jnp.array([30.0, 40.0, 0.0])}  # norm 50 -> clipped to 1
    updates, _ = tx.update(grads, tx.init(params), params)
    # Adam's first step is -lr * g / (|g| + eps) elementwise: sign-like, whatever the scale
    np.testing.assert_allclose(updates["w"], [-1e-3, -1e-3, 0.0], rtol=1e-5, atol=1e-9)
    assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(params)


def test_weight_decay_skips_biases_and_norm_scales_on_the_real_model():
    """AdamW decays weight matrices and embeddings by lr * wd * w; biases and scales keep still."""
    import flax.linen as nn

    from tx_jax.model import init_params, make_model, variant

    cfg = variant("tiny", vocab_size=50, attention_bias=True, tie_output=False)
    boxed = init_params(make_model(cfg), jax.random.PRNGKey(0))
    tx, _ = optim.make_optimizer(
        _train_cfg(clip_grad_norm=0.0, schedule="constant", weight_decay=0.1), cfg.d_model
    )
    for params in (nn.meta.unbox(boxed), boxed):  # the mask also reads boxed (sharded) trees
        zero = jax.tree_util.tree_map(jnp.zeros_like, params)  # Adam's part of the step is 0
        updates, _ = tx.update(zero, tx.init(params), params)
        flat = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(updates))
        values = dict(jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params)))
        decayed = {jax.tree_util.keystr(p) for p, u in flat if np.any(np.asarray(u) != 0)}
        for path, u in flat:
            name = jax.tree_util.keystr(path)
            if name.endswith("bias']") or name.endswith("['scale']"):
                assert name not in decayed, name
            else:
                np.testing.assert_allclose(u, -1e-3 * 0.1 * values[path], rtol=1e-6, atol=1e-12)
        assert any("embedding" in n for n in decayed) and any("kernel" in n for n in decayed)
        assert any(n.endswith("bias']") for n, _ in [(jax.tree_util.keystr(p), u) for p, u in flat])


def test_bfloat16_params_train_and_stay_bfloat16():
    """param_dtype=bfloat16 (fine-tuning an imported model in its own dtype): Optax computes
    the update in the gradients' float32, and train_step's cond needs both branches in the
    stored dtypes, so params and Adam moments come back bfloat16 and the loss falls."""
    import functools

    import flax.linen as nn

    from tx_jax.model.config import variant
    from tx_jax.model.transformer import EncoderDecoder
    from tx_jax.training.state import TrainState
    from tx_jax.training.step import train_step

    cfg = variant(
        "tiny",
        vocab_size=16,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout_rate=0.0,
        param_dtype="bfloat16",
    )
    model = EncoderDecoder(cfg)
    ones = jnp.ones((1, 8), jnp.int32)
    params = nn.meta.unbox(EncoderDecoder(cfg).init(jax.random.key(0), ones, ones)["params"])
    train = _train_cfg(schedule="constant", peak_lr=1e-2, weight_decay=0.01, clip_grad_norm=1.0)
    tx, schedule = optim.make_optimizer(train, cfg.d_model)
    zero = jnp.zeros((), jnp.int32)
    state = TrainState(zero, params, tx.init(params), jax.random.PRNGKey(5), zero, zero)
    step = jax.jit(
        functools.partial(train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.1)
    )
    tokens = np.random.default_rng(0).integers(3, 16, size=(2, 4, 9))
    batch = {"inputs": jnp.asarray(tokens[0]), "targets": jnp.asarray(tokens[1])}
    losses = []
    for _ in range(5):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.nonfinite_total) == 0
    assert {x.dtype for x in jax.tree_util.tree_leaves(state.params)} == {jnp.dtype("bfloat16")}
    floats = {x.dtype for x in jax.tree_util.tree_leaves(state.opt_state) if x.ndim}
    assert floats == {jnp.dtype("bfloat16")}  # the moments keep optax's (the params') dtype
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_a_non_finite_step_leaves_the_state_as_it_was_on_each_backend(platform):
    """The skipped update is a conditional on XLA:CPU and a select per leaf on GPU and TPU
    (the model config resolved for each platform): a finite step gives the CPU's update,
    and a NaN loss leaves the params and Adam moments bit for bit and counts the skip."""
    import functools

    import flax.linen as nn

    from tx_jax.model.config import variant
    from tx_jax.model.transformer import EncoderDecoder
    from tx_jax.training.state import TrainState
    from tx_jax.training.step import train_step

    cfg = variant("tiny", vocab_size=16, num_encoder_layers=1, num_decoder_layers=1)
    ones = jnp.ones((1, 8), jnp.int32)
    params = nn.meta.unbox(EncoderDecoder(cfg).init(jax.random.key(0), ones, ones)["params"])
    tx, schedule = optim.make_optimizer(_train_cfg(schedule="constant", peak_lr=1e-2), cfg.d_model)
    zero = jnp.zeros((), jnp.int32)
    tokens = np.random.default_rng(0).integers(3, 16, size=(2, 4, 9))
    batch = {"inputs": jnp.asarray(tokens[0]), "targets": jnp.asarray(tokens[1])}
    state = TrainState(zero, params, tx.init(params), jax.random.PRNGKey(5), zero, zero)
    leaves = jax.tree_util.tree_leaves

    def step(state, platform):
        model = EncoderDecoder(cfg.resolved(platform).replace(kernels="generic"))
        fn = functools.partial(
            train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.1
        )
        return jax.jit(fn)(state, batch)[0], str(jax.make_jaxpr(fn)(state, batch))

    state, _ = step(state, "cpu")  # one good step: the moments are not zero

    after, program = step(state, platform)
    reference, cpu_program = step(state, "cpu")
    assert program.count("cond[") == cpu_program.count("cond[") - (platform != "cpu")
    assert (int(after.nonfinite_total), int(after.step)) == (0, 2)
    for a, b in zip(
        leaves((after.params, after.opt_state)), leaves((reference.params, reference.opt_state))
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert not all(np.array_equal(a, b) for a, b in zip(leaves(after.params), leaves(state.params)))

    # NaN layer-norm scales and biases poison the loss and every gradient
    poisoned = state.replace(
        params=jax.tree_util.tree_map(lambda x: x * jnp.nan if x.ndim == 1 else x, state.params)
    )
    skipped, _ = step(poisoned, platform)
    assert (int(skipped.nonfinite_total), int(skipped.nonfinite_run), int(skipped.step)) == (
        1,
        1,
        2,
    )
    for a, b in zip(
        leaves((skipped.params, skipped.opt_state)), leaves((poisoned.params, poisoned.opt_state))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
