"""train.time_budget_minutes: a run's schedule fitted to a wall-clock budget (docs/training.md
"A time budget"). A new run times its step on a copy of its state with a second iterator's
batches (its own untouched; the devices hold the state twice meanwhile), then fixes

    num_steps = floor((budget - clock - compile) / step_seconds), at least 1

`clock`: train_seconds minus eval_seconds when the timing ends; with several processes,
process 0's figures. A resumed run takes its schedule's keys from its checkpoint
(`from_checkpoint`), so it continues the uninterrupted run to the bit.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from tx_jax.runner import console, sizing
from tx_jax.runner.setup import Run, build_optimizer, train_step_fn

KEY = "train.time_budget_minutes"
# The schedule's keys a budget fixes (and a resumed run takes from its checkpoint).
FIXED_KEYS = ("num_steps", "warmup_steps", "cooldown_steps")
# Untimed updates: the first compiles, the others pass one-time costs (buffers, prefetch).
UNTIMED = 3
# Timed updates at least: the mean of fewer is one sample's noise.
MIN_TIMED = 3
# Seconds of timing: a CPU's first updates after compiling run slower, so a longer mean fits
# the budget closer; a short budget (a smoke run) spends at most TIMING_SHARE of itself.
MAX_TIMING_SECONDS = 30.0
TIMING_SHARE = 0.05


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of the first update (compilation included) and of one update after it."""

    first_seconds: float
    step_seconds: float
    updates: int  # timed together


def minutes(config: ml_collections.ConfigDict) -> float:
    """The config's budget in minutes (0: none)."""
    return float(config.train.get("time_budget_minutes", 0.0) or 0.0)


def fitted_steps(budget_seconds: float, spent_seconds: float, step_seconds: float) -> int:
    """floor((budget - spent) / step), at least 1: the updates that fill what the set-up left
    of the budget. ValueError when the set-up spent it all."""
    left = budget_seconds - spent_seconds
    if left <= 0:
        raise ValueError(
            f"{KEY}={budget_seconds / 60:g}: its {_secs(budget_seconds)} are spent by set-up, "
            f"compilation and timing ({_secs(spent_seconds)}) before the first update; raise it"
        )
    return max(1, math.floor(left / step_seconds))


def schedule_steps(train: ml_collections.ConfigDict, num_steps: int) -> dict[str, int]:
    """The schedule's keys for `num_steps` fitted updates: warmup_steps kept but at most half
    of them (at least 1), cooldown_steps' share of the config's num_steps kept."""
    warmup = max(1, min(int(train.warmup_steps), num_steps // 2))
    share = int(train.get("cooldown_steps", 0)) / int(train.num_steps)
    cooldown = min(num_steps, round(share * num_steps))
    return {"num_steps": num_steps, "warmup_steps": warmup, "cooldown_steps": cooldown}


def time_updates(
    step: Callable,
    state: Any,
    batches: Iterator,
    *,
    target_seconds: float,
    clock: Callable[[], float] = time.perf_counter,
    agree: Callable[[int], int] | None = None,
) -> Timing:
    """Time a donating `step(state, batch) -> (state, metrics)` (`state` is used up): UNTIMED
    updates, then max(MIN_TIMED, target / the last one's time) timed together with one in
    flight, as the loop runs them. `agree`: the timed count every process uses (process 0's)."""
    agree = agree or _process_0s
    seconds = []
    for _ in range(UNTIMED):
        batch = next(batches)
        started = clock()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        seconds.append(clock() - started)
    n = agree(max(MIN_TIMED, math.ceil(target_seconds / max(seconds[-1], 1e-6))))
    pending = None
    started = clock()
    for _ in range(n):
        state, metrics = step(state, next(batches))
        if pending is not None:
            jax.block_until_ready(pending)
        pending = metrics
    jax.block_until_ready((state, pending))
    return Timing(seconds[0], (clock() - started) / n, n)


def fit(run: Run, state: Any, shardings: Any, started: float, train_iter: Any) -> Run:
    """`run` with its schedule fitted to its budget, timed on a copy of `state` with
    `train_iter`'s batches (used up); the line printed. `started`: the logger's time.time()."""
    budget_seconds = 60 * minutes(run.config)
    step_fn = train_step_fn(run.config, run.model, run.tx, run.schedule)
    p_step = run.strategy.compile_step(step_fn, donate=True, state_shardings=shardings)
    batches = (run.strategy.place_process_rows(b, train_iter.share) for b in train_iter)
    copied = jax.tree_util.tree_map(lambda x: jax.device_put(x, x.sharding, may_alias=False), state)
    target = min(MAX_TIMING_SECONDS, TIMING_SHARE * budget_seconds)
    timing = time_updates(p_step, copied, batches, target_seconds=target)
    del p_step, copied, batches  # the timed program and state copy are freed
    clock = time.time() - started  # a new run: no segment before this one
    measured = np.asarray([timing.first_seconds, timing.step_seconds, clock], np.float32)
    first, step_seconds, clock = (float(x) for x in _process_0s(measured))
    compile_seconds = max(first - step_seconds, 0.0)
    num_steps = fitted_steps(budget_seconds, clock + compile_seconds, step_seconds)
    values = schedule_steps(run.config.train, num_steps)
    cadence = refit_cadence(run.sized, num_steps, run.config.eval.every)
    record = {
        "minutes": minutes(run.config),
        "step_seconds": step_seconds,
        "timed_updates": timing.updates,
        "setup_seconds": clock,  # the budget clock when the timing ended
        "compile_seconds": compile_seconds,  # expected for the run's own step
        **values,
    }
    said = "".join(f", {key} {value:,}" for key, value in cadence.items())
    _say(
        f"time budget {record['minutes']:g} min: {step_seconds:.3g} s/update measured over "
        f"{timing.updates} updates after {_secs(clock)} of set-up, compilation and timing "
        f"(+{_secs(compile_seconds)} to compile the run's step) -> {num_steps:,} updates "
        f"(warmup {values['warmup_steps']:,}, cooldown {values['cooldown_steps']:,}{said})"
    )
    return _with_train(run, values, record, cadence=cadence)


def refit_cadence(sized: tuple[str, ...], num_steps: int, eval_every: int) -> dict[str, int]:
    """The evaluation and checkpoint cadence for the fitted steps, of the keys the data chose
    (`sized`); `eval_every` is the run's when the config set it."""
    cadence = {}
    if "eval.every" in sized:
        cadence["eval.every"] = eval_every = sizing.eval_every(num_steps)
    if "checkpoint.every" in sized:
        cadence["checkpoint.every"] = sizing.checkpoint_every(eval_every)
    return cadence


def from_checkpoint(run: Run, checkpointer: Any) -> Run:
    """A resumed run with FIXED_KEYS and Run.budget from its newest readable checkpoint,
    whatever the config says (a changed budget is said, not applied); `run` for a new run."""
    stored = _stored_meta(checkpointer)
    if stored is None:
        return run
    stored_train = stored["config"].get("train", {})
    old, new = float(stored_train.get("time_budget_minutes", 0.0) or 0.0), minutes(run.config)
    record = stored.get("budget")
    if record is None:  # started without a budget: the config's steps, as always
        if new > 0:
            _say(
                f"{KEY}={new:g} not applied: this run started without a budget and a budget "
                f"is fitted only when a run starts; it resumes with train.num_steps="
                f"{run.config.train.num_steps:,}"
            )
            return _with_train(run, {}, None, budget_minutes=old)
        return run
    if new != old:
        _say(
            f"{KEY}={new:g} not applied: this run's budget of {old:g} min fixed its schedule "
            f"({record['num_steps']:,} updates) when it started, and a resumed run keeps it "
            "(train.init_from starts a new run from its parameters)"
        )
    values = {k: int(stored_train[k]) for k in FIXED_KEYS}
    return _with_train(run, values, record, budget_minutes=old)


def _with_train(
    run: Run,
    values: dict[str, int],
    record: dict | None,
    budget_minutes: float | None = None,
    cadence: dict[str, int] | None = None,
) -> Run:
    """`run` with a config copy holding `values` in train (and `budget_minutes`, `cadence`),
    its optimizer rebuilt and `record` as its budget."""
    config = copy.deepcopy(run.config)
    for key, value in values.items():
        config.train[key] = value
    for key, value in (cadence or {}).items():
        section, name = key.split(".")
        config[section][name] = value
    if budget_minutes is not None:
        config.train.time_budget_minutes = budget_minutes
    tx, schedule, init_fn = build_optimizer(config, run.model_config, run.model)
    return dataclasses.replace(
        run, config=config, tx=tx, schedule=schedule, init_fn=init_fn, budget=record
    )


def _stored_meta(checkpointer: Any) -> dict | None:
    """The meta of the newest checkpoint whose meta reads (no array read), or None."""
    for step in reversed(checkpointer.all_steps()):
        try:
            return checkpointer.restore_meta(step)
        except Exception as e:  # noqa: BLE001 - damage reads as Orbax's, JSON's or OS errors
            logging.warning("checkpoint step %d: meta unreadable (%s)", step, e)
    return None


def _process_0s(value: Any) -> Any:
    """Process 0's `value` on every process (it is, with one process)."""
    if jax.process_count() == 1:
        return value
    out = multihost_utils.broadcast_one_to_all(np.asarray(value))
    return out.item() if np.ndim(out) == 0 else out


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:,.0f} s"


def _say(line: str) -> None:
    logging.info("%s", line)
    console.say(line)
