"""`train_step(state, batch) -> (state, metrics)` and `eval_step`, pure (parallel.py compiles).

Batches are dicts of int32 arrays: 'inputs' [B, S], 'targets' [B, L], and with packing
'inputs_segmentation', 'inputs_position', 'targets_segmentation', 'targets_position'.
A DecoderOnly model (task 'lm') takes only the 'targets' keys and shifts them itself.
The loss is token-weighted: gradient and metric *sums* are reduced over micro-batches
(gradient accumulation) and devices, then divided by the global number of target tokens,
so every device layout computes the same update as one device would.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from tx_jax.model import DecoderOnly
from tx_jax.training import losses
from tx_jax.training.freezing import EVERYTHING, Trainable
from tx_jax.training.state import TrainState

Array = jax.Array
PACKING_KEYS = (
    "inputs_segmentation",
    "inputs_position",
    "targets_segmentation",
    "targets_position",
)


def model_kwargs(batch: dict[str, Array]) -> dict[str, Array]:
    """The packing arrays of a batch, renamed to the model's keyword arguments."""
    names = {
        "inputs_segmentation": "inputs_segmentation",
        "targets_segmentation": "targets_segmentation",
        "inputs_position": "inputs_positions",
        "targets_position": "targets_positions",
    }
    return {names[k]: batch[k] for k in PACKING_KEYS if k in batch}


def lm_model_kwargs(batch: dict[str, Array]) -> dict[str, Array]:
    """The packing arrays of an LM batch, renamed to DecoderOnly's keyword arguments."""
    names = {"targets_segmentation": "segment_ids", "targets_position": "positions"}
    return {name: batch[k] for k, name in names.items() if k in batch}


def _loss_sums(model, params, batch, rng, label_smoothing, deterministic):
    """Sums over one (micro-)batch: smoothed loss, NLL, correct tokens, target tokens."""
    rngs = None if deterministic else {"dropout": rng}
    if isinstance(model, DecoderOnly):  # 'targets' only; shifted inside the model
        args, kwargs = (batch["targets"],), lm_model_kwargs(batch)
    else:
        args, kwargs = (batch["inputs"], batch["targets"]), model_kwargs(batch)
    targets = batch["targets"]
    weights = (targets > 0).astype(jnp.float32)
    variables = {"params": params}
    if model.config.loss_impl == "blocked":  # no [B, L, V] logits: the loss projects blocks
        hidden = model.apply(
            variables, *args, **kwargs, deterministic=deterministic, rngs=rngs, return_hidden=True
        )
        table, bias = model.apply(variables, method="output_weights")
        sums = losses.output_loss(
            hidden, table, bias, targets, weights, label_smoothing, model.config.loss_block
        )
    else:
        logits = model.apply(variables, *args, **kwargs, deterministic=deterministic, rngs=rngs)
        sums = losses.loss_sums(logits, targets, weights, label_smoothing)
    return sums["loss"], sums


def train_step(
    state: TrainState,
    batch: dict[str, Array],
    *,
    model: nn.Module,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    label_smoothing: float,
    grad_accum_steps: int = 1,
    axis_name: str | None = None,
    trainable: Trainable = EVERYTHING,
) -> tuple[TrainState, dict[str, Array]]:
    """One optimizer update of the `trainable` parameters from one global batch (in
    `grad_accum_steps` parts). A non-finite loss or gradient leaves params and optimizer
    state unchanged and is counted in `nonfinite_total` / `nonfinite_run`."""
    rng = jax.random.fold_in(state.rng, state.step)
    if axis_name is not None:  # each device's slice of the batch gets its own dropout
        rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
    params, frozen = trainable.split(state.params)

    def loss_fn(params, batch, rng):
        merged = trainable.merge(params, frozen)
        return _loss_sums(model, merged, batch, rng, label_smoothing, deterministic=False)

    grad_fn = jax.grad(loss_fn, has_aux=True)
    grads, sums = _gradient_sums(grad_fn, params, batch, rng, grad_accum_steps)
    if axis_name is not None:  # averaging sums with pmean leaves their ratio exact
        grads, sums = lax.pmean((grads, sums), axis_name)
    denom = jnp.maximum(sums["weight"], 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(sums["loss"])
    update = functools.partial(_optimizer_update, tx, grads, params, state.opt_state)
    skip = _update_if_cond if model.config.platform == "cpu" else _update_if_select
    params, opt_state = skip(finite, update, (params, state.opt_state))
    skipped = 1 - finite.astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1,
        params=trainable.merge(params, frozen),
        opt_state=opt_state,
        nonfinite_total=state.nonfinite_total + skipped,
        nonfinite_run=jnp.where(finite, 0, state.nonfinite_run + 1),
    )
    n_dev = 1 if axis_name is None else lax.psum(1, axis_name)
    metrics = {
        "loss": sums["loss"] / denom,
        "nll": sums["nll"] / denom,
        "accuracy": sums["correct"] / denom,
        "tokens": sums["weight"] * n_dev,
        "grad_norm": grad_norm,
        # Optax's count advances only on applied updates: step - skipped.
        "lr": schedule(state.step - state.nonfinite_total),
        "nonfinite_run": new_state.nonfinite_run.astype(jnp.float32),
        "nonfinite_total": new_state.nonfinite_total.astype(jnp.float32),
    }
    return new_state, metrics


def _gradient_sums(grad_fn, params, batch: dict[str, Array], rng: Array, steps: int):
    """grad_fn(params, batch, rng) -> (gradient sums, loss sums) of the whole batch, computed
    over `steps` micro-batches of B / steps rows (micro-batch i's dropout from fold_in(rng, i))
    and added up, so that only one micro-batch's activations are alive at a time."""
    if steps == 1:
        return grad_fn(params, batch, rng)
    micro = jax.tree_util.tree_map(lambda x: x.reshape(steps, -1, *x.shape[1:]), batch)

    def accumulate(carry, xs):
        mb, i = xs
        g, s = grad_fn(params, mb, jax.random.fold_in(rng, i))
        return jax.tree_util.tree_map(jnp.add, carry, (g, s)), None

    first = jax.tree_util.tree_map(lambda x: x[0], micro)
    shapes = jax.eval_shape(grad_fn, params, first, rng)
    zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
    (grads, sums), _ = lax.scan(accumulate, zeros, (micro, jnp.arange(steps)))
    return grads, sums


def _optimizer_update(tx: optax.GradientTransformation, grads, params, opt_state):
    """The optimizer's step from `grads` -> (new params, new optimizer state), each leaf in
    the dtype it is stored in."""
    old_state = opt_state
    updates, opt_state = tx.update(grads, opt_state, params)
    # Optax computes in the gradients' float32; each leaf keeps its stored dtype, or the
    # cond's branches (the select's sides) differ for param_dtype=bfloat16.
    opt_state = jax.tree_util.tree_map(lambda new, old: new.astype(old.dtype), opt_state, old_state)
    params = jax.tree_util.tree_map(
        lambda new, old: new.astype(old.dtype), optax.apply_updates(params, updates), params
    )
    return params, opt_state


# update() where `finite`, else `old` (params and optimizer state), as each backend compiles best
def _update_if_cond(finite: Array, update, old):
    # XLA:CPU copies every Adam moment to write a select's result into the donated buffers
    return lax.cond(finite, update, lambda: old)


def _update_if_select(finite: Array, update, old):
    # XLA:GPU and XLA:TPU copy every leaf out of a conditional's result into the donated
    # buffers; a select writes them in place, and discards a non-finite update whatever it holds
    return jax.tree_util.tree_map(functools.partial(jnp.where, finite), update(), old)


def eval_sums(params, batch: dict[str, Array], *, model: nn.Module) -> dict[str, Array]:
    """Sums of NLL, correct tokens and target tokens over a batch (padding rows weigh 0)."""
    _, sums = _loss_sums(model, params, batch, None, 0.0, True)
    return {k: sums[k] for k in ("nll", "correct", "weight")}


def eval_step(
    state: TrainState, batch: dict[str, Array], *, model: nn.Module, axis_name: str | None = None
) -> dict[str, Array]:
    """`eval_sums` of the state's parameters, summed over devices."""
    sums = eval_sums(state.params, batch, model=model)
    if axis_name is not None:
        sums = lax.psum(sums, axis_name)
    return sums


def model_inputs(batch: Mapping[str, Array]) -> dict[str, Array]:
    """The keys a step takes: drops eval-only keys (example ids, masks)."""
    keep = ("inputs", "targets", *PACKING_KEYS)
    return {k: v for k, v in batch.items() if k in keep}


def loss_metrics(sums: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Per-batch `eval_sums` (host floats) -> loss (NLL per target token), accuracy and
    perplexity over all of them."""
    totals = {"nll": 0.0, "correct": 0.0, "weight": 0.0}
    for s in sums:
        totals = {k: totals[k] + float(s[k]) for k in totals}
    w = max(totals["weight"], 1.0)
    loss = totals["nll"] / w
    return {"loss": loss, "accuracy": totals["correct"] / w, "perplexity": math.exp(min(loss, 50))}
