"""The two strategies of training/parallel.py behind one interface, in this process (one CPU
device): each initialises, places, steps, fetches and checkpoints the same values, and a
checkpoint one saves restores into the other. The multi-device and multi-process runs are in
test_train, test_elastic and test_multiprocess."""

from fractions import Fraction

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tx_jax.training import parallel
from tx_jax.training.checkpoint import Checkpointer


def init_fn():
    """A state boxed with logical axis names, as the model's init returns it: w [2, 3]."""
    w = nn.with_logical_partitioning(lambda: jnp.arange(6.0).reshape(2, 3), ("embed", "mlp"))()
    return {"w": w, "step": jnp.int32(0)}


def step_fn(state, batch, axis_name):
    """Adds the batch's sum to w; the sum over every device's rows is the metric."""
    total = batch["x"].sum()
    if axis_name:  # pmap: each device holds a slice of the rows
        total = jax.lax.psum(total, axis_name)
    return {"w": state["w"] + total, "step": state["step"] + 1}, {"total": total}


@pytest.mark.parametrize("kind, placed_shape", [("pmap", (1, 4, 2)), ("mesh", (4, 2))])
def test_both_strategies_step_and_checkpoint_the_same_values(kind, placed_shape):
    strategy = _strategy(kind)
    assert isinstance(strategy, parallel.Strategy) and strategy.kind == kind
    assert (strategy.global_batch_multiple, strategy.local_batch_multiple) == (1, 1)
    assert strategy.process_row_spans() == [(Fraction(0), Fraction(1))]
    assert strategy.abstract_state(init_fn)["w"].shape == (2, 3)  # pmap: one replica

    shardings = strategy.step_shardings(init_fn)
    assert (shardings is None) == (kind == "pmap")
    step = strategy.compile_step(step_fn, donate=False, state_shardings=shardings)
    batch = {"x": np.arange(8, dtype=np.float32).reshape(4, 2)}  # [B=4, 2], sum 28
    placed = strategy.place_batch(batch)
    assert placed["x"].shape == placed_shape
    assert strategy.place_process_rows(batch, Fraction(1))["x"].shape == placed_shape

    state, metrics = step(strategy.init_state(init_fn), placed)
    assert strategy.fetch_metrics(metrics) == {"total": 28.0}
    saved = strategy.for_checkpoint(state)
    np.testing.assert_array_equal(saved["w"], np.arange(6.0).reshape(2, 3) + 28)
    # restored: the step goes on from the saved values
    state, _ = step(strategy.place_restored(saved), placed)
    saved = strategy.for_checkpoint(state)
    assert int(saved["step"]) == 2
    np.testing.assert_array_equal(saved["w"], np.arange(6.0).reshape(2, 3) + 56)


def _strategy(kind: str) -> parallel.Strategy:
    return parallel.make_strategy(
        ml_collections.ConfigDict(dict(strategy=kind, mesh=dict(data=-1, fsdp=1, tensor=1)))
    )


@pytest.mark.parametrize("saver, loader", [("pmap", "mesh"), ("mesh", "pmap")])
def test_a_checkpoint_of_one_strategy_resumes_under_the_other(tmp_path, saver, loader):
    """Orbax stores the state as for_checkpoint gives it (pmap: one replica), so a run that
    changes parallel.strategy resumes from the values the other saved."""
    batch = {"x": np.arange(8, dtype=np.float32).reshape(4, 2)}  # sum 28
    s, other = _strategy(saver), _strategy(loader)
    state, _ = s.compile_step(step_fn, donate=False)(s.init_state(init_fn), s.place_batch(batch))
    ckpt = Checkpointer(tmp_path, best_metric=None, async_save=False)
    ckpt.save(1, s.for_checkpoint(state), data_state=None, config={}, tokenizer_bytes=b"")
    ckpt.wait()
    restored, _, _ = ckpt.restore(1, other.abstract_state(init_fn))
    step = other.compile_step(step_fn, donate=False, state_shardings=other.step_shardings(init_fn))
    state, metrics = step(other.place_restored(restored), other.place_batch(batch))
    saved = other.for_checkpoint(state)
    assert other.fetch_metrics(metrics) == {"total": 28.0} and int(saved["step"]) == 2
    np.testing.assert_array_equal(saved["w"], np.arange(6.0).reshape(2, 3) + 56)
    ckpt.close()


def test_make_strategy_names_an_unknown_strategy():
    with pytest.raises(ValueError, match="expected one of"):
        parallel.make_strategy(ml_collections.ConfigDict(dict(strategy="dp")))
