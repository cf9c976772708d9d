"""The train state: everything that changes during training, saved whole by Orbax."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct, traverse_util

from tx_jax.model import init_params
from tx_jax.training.freezing import EVERYTHING, Trainable

Array = jax.Array


@struct.dataclass
class TrainState:
    """Everything that changes during training; all arrays, so Orbax saves it whole."""

    step: Array  # int32 scalar: number of train steps taken (skipped ones included)
    params: Any  # all of them, frozen ones included (freezing.py)
    opt_state: Any  # of the trainable parameters
    rng: Array  # uint32[2] base dropout key; step s uses fold_in(rng, s)
    nonfinite_total: Array  # int32: updates skipped for a non-finite loss or gradient
    nonfinite_run: Array  # int32: consecutive skipped updates


def init_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    seed: int,
    trainable: Trainable = EVERYTHING,
    base: Any = None,
) -> TrainState:
    """A fresh state with parameters boxed by logical axis names (parallel.py unboxes); the
    optimizer's state covers the trainable parameters only (freezing.py). `base` (unboxed
    parameters, e.g. train.init_from's) gives the values of the parameters it holds; only the
    others (new adapters) are initialised: under jit the initialisers of the rest are dead
    code, so the model is never held twice."""
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))
    params = init_params(model, init_rng)
    if base is not None:
        params = _with_values(params, base)
    params = trainable.cast_frozen(params)
    zero = jnp.zeros((), jnp.int32)
    opt_state = tx.init(trainable.split(params)[0])
    return TrainState(zero, params, opt_state, dropout_rng, zero, zero)


def _with_values(boxed: Any, values: Any) -> Any:
    """`boxed` (parameters in their logical-axis boxes) with the leaves `values` holds."""
    flat = traverse_util.flatten_dict(boxed, sep="/")
    for path, value in traverse_util.flatten_dict(values, sep="/").items():
        box = flat[path]
        flat[path] = box.replace_boxed(value) if isinstance(box, nn.meta.AxisMetadata) else value
    return traverse_util.unflatten_dict(flat, sep="/")
