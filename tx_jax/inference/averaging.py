"""Checkpoint averaging: one model from the mean parameters of the last K checkpoints, as the
paper evaluates its models (section 6.1: the last 5, or 20 for the big ones).

    averaged = average_checkpoints("runs/default", 5)   # -> Averaged(path, step, steps)
    tx_jax evaluate --workdir=runs/default --average_last=5
    tx_jax evaluate --checkpoint=runs/default/averaged/last5/600

Parameters are summed on the host in float64, one checkpoint at a time, divided by K and
rounded once to their dtype, so the mean of K equal checkpoints is that checkpoint bit for
bit. The result is a real Orbax checkpoint (training's items; the last checkpoint's state
with the averaged parameters, its meta plus 'averaged': {'steps', 'k'}) at

    WORKDIR/averaged/last<K>/<last step>              the last K checkpoints
    WORKDIR/averaged/steps_<a>_<b>_.../<last step>    explicit steps

and a later call for the same steps reuses it. Training never reads WORKDIR/averaged.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from etils import epath

from tx_jax.config import task_of
from tx_jax.inference import locate
from tx_jax.model import make_model
from tx_jax.training import optim
from tx_jax.training.checkpoint import Checkpointer, absolute
from tx_jax.training.freezing import Trainable
from tx_jax.training.state import init_state


class Averaged(NamedTuple):
    path: epath.Path  # the averaged checkpoint's step directory
    step: int  # its step: the last averaged one
    steps: list[int]  # the averaged steps, ascending


def choose_steps(
    available: Sequence[int],
    k: int | None = None,
    steps: Sequence[int] | None = None,
    until: int | None = None,
) -> list[int]:
    """The last `k` of `available` (those <= `until` if given), or exactly `steps`."""
    available = sorted(available)
    if steps is not None:
        missing = sorted(set(steps) - set(available))
        if missing:
            raise locate.CheckpointError(
                f"no checkpoint for step(s) {missing}; available steps: {available}"
            )
        return sorted(set(steps))
    if k is None or k < 1:
        raise locate.CheckpointError(f"average_last={k}: give K >= 1 (or explicit steps)")
    if until is not None:
        if until not in available:
            raise locate.CheckpointError(
                f"no checkpoint for step {until}; available steps: {available}"
            )
        available = [s for s in available if s <= until]
    if len(available) < k:
        raise locate.CheckpointError(
            f"cannot average the last {k} checkpoints: only {len(available)} (steps {available})"
        )
    return available[-k:]


def average_params(ckpt: Checkpointer, steps: Sequence[int], abstract: Any) -> Any:
    """Mean of `state.params` over `steps` (a float64 sum, one checkpoint at a time), in
    `abstract`'s dtypes and placement."""
    total = None
    for step in steps:
        params = jax.device_get(ckpt.restore_params(step, abstract))
        if total is None:
            total = jax.tree_util.tree_map(lambda x: np.array(x, np.float64), params)
        else:
            jax.tree_util.tree_map(
                lambda t, x: np.add(t, x, out=t, dtype=np.float64), total, params
            )
    return jax.tree_util.tree_map(
        lambda t, a: jax.device_put((t / len(steps)).astype(a.dtype), a.sharding), total, abstract
    )


def _abstract_state(opened: locate.Opened) -> Any:
    """The full TrainState of the run as ShapeDtypeStructs on the params' device."""
    config, model_config = opened.config, opened.model_config
    tx, _ = optim.make_optimizer(config.train, model_config.d_model)
    model = make_model(model_config, task_of(config))
    init_fn = functools.partial(init_state, model, tx, config.seed)
    sharding = jax.tree_util.tree_leaves(opened.abstract_params)[0].sharding
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        nn.meta.unbox(jax.eval_shape(init_fn)),
    )


def _reusable(directory: epath.Path, step: int, steps: list[int]) -> bool:
    if not (directory / str(step) / "meta").exists():
        return False
    try:
        ckpt = Checkpointer(directory, read_only=True, best_metric=None)
        ok = step in ckpt.all_steps() and ckpt.restore_meta(step).get("averaged", {}).get(
            "steps"
        ) == list(steps)
        ckpt.close()
        return ok
    except (OSError, ValueError, KeyError):
        return False


def average_checkpoints(
    workdir: str | epath.Path,
    k: int | None = None,
    *,
    steps: Sequence[int] | None = None,
    until: int | None = None,
    reuse: bool = True,
) -> Averaged:
    """Average the last `k` checkpoints of WORKDIR/checkpoints (those <= `until` if given),
    or the given `steps`, and save the result (module docstring); reuse it if saved."""
    workdir = absolute(workdir)
    ckpt = locate.open_checkpoints(workdir / locate.CHECKPOINTS_DIR)
    chosen = choose_steps(ckpt.all_steps(), k, steps, until)
    name = f"last{k}" if steps is None else "steps_" + "_".join(map(str, chosen))
    out_dir, last = workdir / locate.AVERAGED_DIR / name, chosen[-1]
    if reuse and _reusable(out_dir, last, chosen):
        return Averaged(out_dir / str(last), last, chosen)
    opened = locate.open_step(ckpt, last)
    if not Trainable.of(opened.config.train).everything:
        ckpt.close()
        raise locate.CheckpointError(
            f"{workdir} trained a part of its model (train.lora / train.trainable): its "
            "checkpoints are not averaged; evaluate one step"
        )
    params = average_params(ckpt, chosen, opened.abstract_params)
    state, data_state, meta = ckpt.restore(last, _abstract_state(opened))
    ckpt.close()
    out = Checkpointer(out_dir, keep=3, best_metric=None, async_save=False)
    if last in out.all_steps():
        out.manager.delete(last)
    out.save(
        last,
        state.replace(params=params),
        data_state=data_state,
        config=meta["config"],
        tokenizer_bytes=meta["tokenizer"],
        versions=meta.get("versions"),
        extra_meta={"averaged": {"steps": chosen, "k": len(chosen), "source": str(ckpt.directory)}},
    )
    out.close()
    return Averaged(out_dir / str(last), last, chosen)
