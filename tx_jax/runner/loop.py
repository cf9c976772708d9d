"""The training loop: `train_and_evaluate(config, workdir)`, the library entry point.

Every `eval.every` steps the run is evaluated (runner/evaluator.py) and checkpointed; at the
end the test split is scored (with the average of the last `eval.average_last` checkpoints
when set). SIGTERM / SIGINT save and stop at the next step boundary.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import ml_collections
import numpy as np

from tx_jax.inference import averaging, restore
from tx_jax.ops import backend
from tx_jax.runner import budget, console
from tx_jax.runner.evaluator import Evaluator
from tx_jax.runner.profiling import StepProfiler, profile_window
from tx_jax.runner.setup import Run, build_run, restore_or_init, size_from_data, train_step_fn
from tx_jax.runner.signals import StopSignal
from tx_jax.training import checkpoint as ckpt_lib
from tx_jax.training import logs, parallel


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Train `config` in `workdir` (resuming if it holds checkpoints); return final metrics."""
    started = time.time()
    if config.train.get("deterministic"):
        backend.require_deterministic_ops()
    # the sizing step: every key the config leaves to the data chosen, before the run is built
    run = build_run(size_from_data(config, workdir))
    config = run.config
    cfg, c = config.train, config.checkpoint
    checkpointer = ckpt_lib.Checkpointer(
        run.workdir / "checkpoints",
        keep=c.keep,
        best_metric=c.best_metric,
        best_mode=c.best_mode,
        async_save=c.async_save,
    )
    new = checkpointer.latest_step() is None
    run = budget.from_checkpoint(run, checkpointer)  # a budgeted run's steps, when resumed
    state, data_state = restore_or_init(run, checkpointer)
    train_iter = _train_iterator(run)
    if data_state and cfg.restore_data_iterator:
        train_iter.set_state(data_state)
    shardings = run.strategy.step_shardings(run.init_fn)
    if new and budget.minutes(run.config) > 0:  # its step timed: the steps it has time for
        run = budget.fit(run, state, shardings, started, _train_iterator(run))
    config, cfg = run.config, run.config.train
    step_fn = train_step_fn(run.config, run.model, run.tx, run.schedule)
    p_train = run.strategy.compile_step(step_fn, donate=True, state_shardings=shardings)
    evaluator = Evaluator(run, shardings)
    train_seconds, eval_seconds = _seconds_before(run, checkpointer, state)
    # after the restore (a config it refuses leaves the workdir's config.json as it was) and
    # the budget's fit (config.json holds the steps the run takes)
    logs.write_json(run.workdir / "config.json", config.to_dict())
    logs.write_json(run.workdir / "versions.json", logs.versions())
    logger = logs.MetricLogger(
        run.workdir,
        cfg.num_steps,
        train_seconds=train_seconds,
        eval_seconds=eval_seconds,
        started=started,
    )
    try:
        return _loop(run, config, checkpointer, state, train_iter, p_train, evaluator, logger)
    finally:  # on every way out: a gs:// workdir's last TensorBoard events are copied up
        failing = sys.exc_info()[1]
        # A storage error: the store is failing, so the last events stay where they are.
        logger.close(quiet=failing is not None, copy=not isinstance(failing, OSError))
        run.strategy.release()


def _loop(run: Run, config, checkpointer, state, train_iter, p_train, evaluator, logger):
    """The training steps, evaluations and saves from `state` on -> the final metrics."""
    cfg = config.train
    step = int(jax.device_get(run.strategy.for_checkpoint(state).step))
    save = functools.partial(_save, run, checkpointer, train_iter, logger)
    pending: list[dict] = []
    last_log, final = time.time(), {}
    clock = None  # the budget clock after the last update (runner/budget.py)
    paused = 0.0  # evaluation and its save since the last log: not in the tokens/s window
    stop = StopSignal(checkpointer)
    window = profile_window(cfg.get("profile_steps"), cfg.num_steps)
    profiler = StepProfiler(window, run.workdir / "tensorboard")
    if step < cfg.num_steps:
        logger.segment("start", step)
    while step < cfg.num_steps:
        if stop.requested(step):
            profiler.stop()
            save(step, state)
            checkpointer.close()
            stop.restore()
            logger.segment("stop", step)
            console.stopped(stop.name, step, checkpointer.directory)
            return {"stopped_at": float(step)}
        batch = next(train_iter)
        profiler.before(step + 1)
        state, metrics = p_train(state, run.strategy.place_process_rows(batch, train_iter.share))
        step += 1
        profiler.after(step, metrics)
        pending.append(metrics)
        # At most one step in flight, so a stop (a preemption notice gives ~30 s) waits for
        # about one step, not log_every of them; N queued behind N-1 keeps the device busy.
        if len(pending) > 1:
            jax.block_until_ready(pending[-2])
        is_last = step == cfg.num_steps
        if step % cfg.log_every == 0 or is_last:
            jax.block_until_ready(pending[-1])  # the window ends when its last step has run
            scalars = _summarise(run.strategy, pending, time.time() - last_log - paused)
            pending, last_log, paused = [], time.time(), 0.0
            scalars.update({f"data_{k}": v for k, v in train_iter.stats().items()})
            logger.write(step, "train", scalars)
            logger.progress(step, scalars)
            _check_finite(scalars, cfg.max_nonfinite_steps, step)
        if is_last:
            clock = logger.budget_clock()
        if step % config.eval.every == 0 or is_last:
            started = time.time()
            final = evaluator.evaluate(state, step, logger, bleu=True)
            logger.count_eval(time.time() - started)  # out of the budget clock, the save in it
            save(step, state, metrics=final)
            paused += time.time() - started
        elif step % config.checkpoint.every == 0:
            save(step, state)
        if is_last:
            logger.segment("stop", step)
    stop.restore()
    checkpointer.wait()
    checkpointer.close()
    wanted = config.data.test_split if config.eval.score_test else ""
    if wanted and not run.test_split:  # the data has no such split (setup.size_from_data)
        console.say(f"no test score: the data names no files for the test split {wanted!r}")
    elif run.test_split and step == cfg.num_steps:  # every process decodes (SPMD)
        k = config.eval.get("average_last", 0)
        test_state = _averaged(run, state, k) if k else state
        final.update(evaluator.test_metrics(test_state, step, logger))
        if k:
            final["test_average_last"] = float(k)
    console.summary(run, final, budget_clock=clock)
    return final


def _train_iterator(run: Run):
    """This process's rows of the run's global train batches, from the first batch."""
    return run.task.train_iterator(
        batch_multiple=run.strategy.global_batch_multiple * run.config.train.grad_accum_steps,
        spans=run.strategy.process_row_spans(),
    )


def _averaged(run: Run, state, k: int):
    """`state` holding the mean parameters of the last `k` checkpoints (as `evaluate
    --average_last` saves them), placed like `state`."""
    averaged = averaging.average_checkpoints(run.workdir, k)
    ckpt = restore.open_checkpoints(averaged.path.parent)
    abstract = run.strategy.abstract_state(run.init_fn).params
    params = ckpt.restore_params(averaged.step, abstract)
    ckpt.close()
    return state.replace(params=run.strategy.place_restored(params))


def _seconds_before(run: Run, checkpointer, state) -> tuple[float, float]:
    """(train_seconds, eval_seconds) of the segments before this one (0 for a new run)."""
    step = int(jax.device_get(run.strategy.for_checkpoint(state).step))
    if step == 0 or step not in checkpointer.all_steps():
        return 0.0, 0.0
    meta = checkpointer.restore_meta(step)
    return float(meta.get("train_seconds", 0.0)), float(meta.get("eval_seconds", 0.0))


def _save(run: Run, checkpointer, train_iter, logger, step: int, state, *, metrics=None) -> None:
    metrics = {k: v for k, v in (metrics or {}).items() if k == run.config.checkpoint.best_metric}
    checkpointer.save(
        step,
        run.trainable.saved(run.strategy.for_checkpoint(state)),
        data_state=train_iter.get_state(),
        config=run.config.to_dict(),
        tokenizer_bytes=run.task.tokenizer.to_bytes(),
        versions=logs.versions(),
        metrics=metrics or None,
        extra_meta={
            "train_seconds": round(logger.train_seconds(), 3),
            "eval_seconds": round(logger.eval_seconds(), 3),
            **({"budget": run.budget} if run.budget else {}),
            **({"base": run.base} if run.base else {}),
        },
    )


def _summarise(strategy: parallel.Strategy, pending: list, seconds: float) -> dict[str, float]:
    fetched = [strategy.fetch_metrics(m) for m in pending]
    tokens = sum(m["tokens"] for m in fetched)
    out = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[-1]}
    out.update(
        tokens_per_sec=tokens / max(seconds, 1e-9),
        lr=fetched[-1]["lr"],
        nonfinite_run=fetched[-1]["nonfinite_run"],
        nonfinite_total=fetched[-1]["nonfinite_total"],
    )
    return out


def _check_finite(scalars: dict[str, float], limit: int, step: int) -> None:
    if scalars["nonfinite_run"] >= limit:
        raise FloatingPointError(
            f"step {step}: {int(scalars['nonfinite_run'])} consecutive non-finite losses or "
            f"gradients (train.max_nonfinite_steps={limit}); updates were skipped and the "
            "last good checkpoint is kept. Lower the learning rate or check the data."
        )
