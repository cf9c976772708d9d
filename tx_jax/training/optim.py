"""Learning-rate schedules and the optimiser (paper section 5.3), built on Optax.

    rsqrt (the paper): lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    linear_rsqrt:       linear warmup to peak_lr, then peak_lr * sqrt(warmup / step)
    cosine:             linear warmup to peak_lr, cosine decay to peak_lr * final_lr_fraction

train.cooldown_steps = C > 0 multiplies any of them by a linear ramp from 1 down to 1/C over
the last C updates, so a run's earlier checkpoints are the same as a longer run's. `step`
counts optimizer updates from 1 (Optax's count + 1).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("rsqrt", "linear_rsqrt", "cosine", "constant")


def rsqrt_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
    """The paper's eq. (3), as a function of Optax's 0-based update count."""

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

    return schedule


def make_schedule(train: Any, d_model: int) -> optax.Schedule:
    """`train` is the config's train section (schedule, warmup_steps, peak_lr, ...), with
    its cooldown (train.cooldown_steps) applied."""
    base = _base_schedule(train, d_model)
    cooldown = int(train.get("cooldown_steps", 0))
    if cooldown <= 0:
        return base
    end = int(train.num_steps)

    def schedule(count):
        ramp = jnp.clip((end - jnp.asarray(count, jnp.float32)) / cooldown, 0.0, 1.0)
        return base(count) * ramp

    return schedule


def _base_schedule(train: Any, d_model: int) -> optax.Schedule:
    kind, warmup = train.schedule, int(train.warmup_steps)
    if kind == "rsqrt":
        return rsqrt_schedule(d_model, warmup, train.lr_scale)
    if kind == "linear_rsqrt":
        peak = float(train.peak_lr)  # read now: the schedule must not see later config edits

        def schedule(count):
            step = jnp.asarray(count, jnp.float32) + 1.0
            return peak * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

        return schedule
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=train.peak_lr,
            warmup_steps=warmup,
            decay_steps=max(int(train.num_steps), warmup + 1),
            end_value=train.peak_lr * train.final_lr_fraction,
        )
    if kind == "constant":
        return optax.constant_schedule(train.peak_lr)
    raise ValueError(f"train.schedule={kind!r}; expected one of {SCHEDULES}")


def _weight_decay_mask(params: Any) -> Any:
    """True on every weight matrix and embedding, False on biases and norms' scales
    (shifting those toward 0 regularises nothing: they set offsets and scales)."""

    def decays(path: tuple, _) -> bool:
        names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        name = names[-1] if names else ""
        return not (name.endswith("bias") or name == "scale")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(train: Any, d_model: int) -> tuple[optax.GradientTransformation, Any]:
    """Adam(beta1, beta2, eps) (paper: 0.9, 0.98, 1e-9), optional decoupled weight decay (on
    weight matrices and embeddings only) and global-norm clipping. Returns
    (transformation, schedule)."""
    schedule = make_schedule(train, d_model)
    if train.weight_decay > 0:
        opt = optax.adamw(
            schedule,
            b1=train.beta1,
            b2=train.beta2,
            eps=train.eps,
            weight_decay=train.weight_decay,
            mask=_weight_decay_mask,
        )
    else:
        opt = optax.adam(schedule, b1=train.beta1, b2=train.beta2, eps=train.eps)
    if train.clip_grad_norm > 0:
        opt = optax.chain(optax.clip_by_global_norm(train.clip_grad_norm), opt)
    return opt, schedule
