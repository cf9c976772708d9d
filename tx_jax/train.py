"""Training: the train state, `train_step`, `eval_step` and `train_and_evaluate`.

    train_step(state, batch) -> (state, metrics)    pure; jitted (mesh) or pmapped by parallel.py
    train_and_evaluate(config, workdir)              the library entry point (main.py: flags)

Batches are dicts of int32 arrays: 'inputs' [B, S], 'targets' [B, L], and with packing
'inputs_segmentation', 'inputs_position', 'targets_segmentation', 'targets_position'.
With config.task == 'lm' the model is a DecoderOnly and batches hold only the 'targets'
keys (the model shifts them right itself); validation gives loss and perplexity, no BLEU.
The loss is token-weighted: gradient and metric *sums* are reduced over micro-batches
(gradient accumulation) and devices, then divided by the global number of target tokens,
so every device layout computes the same update as one device would.

With data.directions set, one model learns several tagged directions from a mixed stream
(data/directions.py); validation and test BLEU are logged per direction (bleu/en-de, ...) and
'bleu' is their mean, so checkpoint.best_metric='bleu' works unchanged. train.init_from starts
a run from another run's parameters (and tokenizer) with a fresh optimizer at step 0.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from etils import epath
from flax import struct
from jax import lax

from tx_jax import checkpoint as ckpt_lib
from tx_jax import logs, losses, models, optim, parallel, restore
from tx_jax.config_utils import task_of
from tx_jax.data import directions, tasks

Array = jax.Array
TASKS = ("translation", "lm")
PACKING_KEYS = (
    "inputs_segmentation", "inputs_position", "targets_segmentation", "targets_position",
)  # fmt: skip


@struct.dataclass
class TrainState:
    """Everything that changes during training; all arrays, so Orbax saves it whole."""

    step: Array  # int32 scalar: number of train steps taken (skipped ones included)
    params: Any
    opt_state: Any
    rng: Array  # uint32[2] base dropout key; step s uses fold_in(rng, s)
    nonfinite_total: Array  # int32: updates skipped for a non-finite loss or gradient
    nonfinite_run: Array  # int32: consecutive skipped updates


def init_state(model: nn.Module, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """A fresh state with parameters boxed by logical axis names (parallel.py unboxes)."""
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))
    dummy = jnp.ones((1, 8), jnp.int32)
    args = (dummy,) if isinstance(model, models.DecoderOnly) else (dummy, dummy)
    params = model.init(init_rng, *args)["params"]
    zero = jnp.zeros((), jnp.int32)
    return TrainState(zero, params, tx.init(params), dropout_rng, zero, zero)


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
    if isinstance(model, models.DecoderOnly):  # 'targets' only; shifted inside the model
        args, kwargs = (batch["targets"],), lm_model_kwargs(batch)
    else:
        args, kwargs = (batch["inputs"], batch["targets"]), model_kwargs(batch)
    logits = model.apply(
        {"params": params}, *args, **kwargs, deterministic=deterministic, rngs=rngs
    )
    targets = batch["targets"]
    weights = (targets > 0).astype(jnp.float32)
    loss, weight = losses.smoothed_cross_entropy(logits, targets, weights, label_smoothing)
    nll, _ = losses.nll(logits, targets, weights)
    correct, _ = losses.accuracy(logits, targets, weights)
    return loss, {"loss": loss, "nll": nll, "correct": correct, "weight": weight}


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
) -> tuple[TrainState, dict[str, Array]]:
    """One optimizer update from one global batch (split into `grad_accum_steps` parts).

    A non-finite loss or gradient leaves params and optimizer state unchanged and is
    counted in `nonfinite_total` / `nonfinite_run` (the loop stops after too many).
    """
    rng = jax.random.fold_in(state.rng, state.step)
    if axis_name is not None:  # each device's slice of the batch gets its own dropout
        rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
    grad_fn = jax.grad(
        functools.partial(_loss_sums, model, label_smoothing=label_smoothing, deterministic=False),
        has_aux=True,
    )
    if grad_accum_steps == 1:
        grads, sums = grad_fn(state.params, batch, rng)
    else:
        k = grad_accum_steps
        micro = jax.tree_util.tree_map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)

        def accumulate(carry, xs):
            mb, i = xs
            g, s = grad_fn(state.params, mb, jax.random.fold_in(rng, i))
            return jax.tree_util.tree_map(jnp.add, carry, (g, s)), None

        first = jax.tree_util.tree_map(lambda x: x[0], micro)
        shapes = jax.eval_shape(grad_fn, state.params, first, rng)
        zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        (grads, sums), _ = lax.scan(accumulate, zeros, (micro, jnp.arange(k)))
    if axis_name is not None:  # averaging sums with pmean leaves their ratio exact
        grads, sums = lax.pmean((grads, sums), axis_name)
    denom = jnp.maximum(sums["weight"], 1.0)
    grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(sums["loss"])

    def update():
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    # A conditional, not a select per leaf: jnp.where(finite, new, old) over the params and
    # Adam moments made XLA copy every moment (186 copies of the small config, 18 MiB of
    # temporaries) so that the donated buffers could be written in place (BENCHMARKS.md).
    params, opt_state = lax.cond(finite, update, lambda: (state.params, state.opt_state))
    skipped = 1 - finite.astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1,
        params=params,
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


def eval_step(
    state: TrainState, batch: dict[str, Array], *, model: nn.Module, axis_name: str | None = None
) -> dict[str, Array]:
    """Sums of NLL, correct tokens and target tokens over a batch (padding rows weigh 0)."""
    _, sums = _loss_sums(model, state.params, batch, None, 0.0, True)
    sums = {k: sums[k] for k in ("nll", "correct", "weight")}
    if axis_name is not None:
        sums = lax.psum(sums, axis_name)
    return sums


# ---------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class Run:
    """What train_and_evaluate builds before the first step (also used by evaluate.py)."""

    config: ml_collections.ConfigDict
    workdir: epath.Path
    strategy: parallel.Strategy
    task: tasks.TranslationTask | tasks.LMTask | directions.MultilingualTask
    model_config: models.ModelConfig
    model: nn.Module
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    init_fn: Callable[[], TrainState]
    # train.init_from's checkpoint when this run starts from it (None when resuming)
    init_source: restore.InitSource | None = None


def build_run(config: ml_collections.ConfigDict, workdir: str | epath.Path) -> Run:
    """Devices, data, tokenizer, model and optimizer for `config` in `workdir`."""
    workdir = ckpt_lib.absolute(workdir)
    validate_config(config)
    parallel.maybe_initialize_distributed(config.parallel)
    strategy = parallel.make_strategy(config.parallel)
    _check_batch_divides(config, strategy)
    check_writable(workdir)
    is_lm = task_of(config) == "lm"
    prepare = tasks.prepare_lm_task if is_lm else tasks.prepare_translation_task
    if directions.is_multilingual(config.data):
        prepare = directions.prepare_multilingual_task
    source = _init_source(config, workdir)
    tokenizer = source.tokenizer if source is not None else None
    task = prepare(config.data, workdir, seed=config.seed, tokenizer=tokenizer)
    model_config = models.ModelConfig.from_config(
        config.model, vocab_size=task.tokenizer.vocab_size, bos_id=task.tokenizer.bos_id
    )
    model = models.DecoderOnly(model_config) if is_lm else models.EncoderDecoder(model_config)
    tx, schedule = optim.make_optimizer(config.train, model_config.d_model)
    init_fn = functools.partial(init_state, model, tx, config.seed)
    return Run(config, workdir, strategy, task, model_config, model, tx, schedule, init_fn,
               source)  # fmt: skip


def _init_source(config: ml_collections.ConfigDict, workdir: epath.Path):
    """train.init_from's checkpoint, opened (meta only), unless the workdir has checkpoints
    of its own: then the run resumes from those and init_from is not read again."""
    path = config.train.get("init_from")
    if not path:
        return None
    own = workdir / "checkpoints"
    if own.exists() and any(p.name.isdigit() for p in own.iterdir()):
        return None
    return restore.open_init_source(path)


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Every check that needs no device and no data, before anything compiles. Raises
    ValueError naming the key (unknown keys are caught by the locked ConfigDict / from_config).
    """
    models.ModelConfig.from_config(config.model)  # unknown keys, enums, divisibility
    if task_of(config) not in TASKS:
        raise ValueError(f"task={config.task!r}; expected one of {TASKS}")
    if task_of(config) == "lm":
        if config.data.get("lm_side", "target") not in tasks.LM_SIDES:
            raise ValueError(f"data.lm_side={config.data.lm_side!r}; expected one of "
                             f"{tasks.LM_SIDES}")  # fmt: skip
        if config.checkpoint.best_metric in ("bleu", "chrf"):
            raise ValueError(
                f"checkpoint.best_metric={config.checkpoint.best_metric!r}: a language model "
                "has no BLEU; use loss, accuracy or perplexity"
            )
    directions.validate_config(config.data, task_of(config))
    enums = {
        "train.schedule": optim.SCHEDULES,
        "parallel.strategy": parallel.STRATEGIES,
        "checkpoint.best_mode": ("min", "max"),
    }
    for key, allowed in enums.items():
        section, name = key.split(".")
        if config[section][name] not in allowed:
            raise ValueError(f"{key}={config[section][name]!r}; expected one of {allowed}")
    positive = (
        "train.num_steps", "train.warmup_steps", "train.grad_accum_steps", "train.log_every",
        "eval.every", "eval.beam_size", "checkpoint.every", "checkpoint.keep",
        "data.max_len", "data.tokens_per_batch", "data.vocab_size", "data.eval_batch_size",
    )  # fmt: skip
    for key in positive:
        section, name = key.split(".")
        if config[section][name] <= 0:
            raise ValueError(f"{key}={config[section][name]} must be positive")
    if config.data.max_len > config.data.tokens_per_batch:
        raise ValueError(
            f"data.tokens_per_batch={config.data.tokens_per_batch} is smaller than one row of "
            f"data.max_len={config.data.max_len} tokens"
        )
    if config.checkpoint.best_metric and config.checkpoint.best_metric not in (
        "bleu", "chrf", "loss", "accuracy", "perplexity",
    ):  # fmt: skip
        raise ValueError(
            f"checkpoint.best_metric={config.checkpoint.best_metric!r}; expected a validation "
            "metric: bleu, chrf, loss, accuracy or perplexity"
        )


def _check_batch_divides(config: ml_collections.ConfigDict, strategy: parallel.Strategy) -> None:
    """The smallest batch (rows at the longest bucket) must split over devices and micro-batches."""
    d = config.data
    longest = max(d.bucket_boundaries or [d.max_len]) if not d.packing else d.max_len
    rows = d.tokens_per_batch // longest  # the global batch (tasks.py)
    need = strategy.global_batch_multiple * config.train.grad_accum_steps
    if rows < need:
        raise ValueError(
            f"data.tokens_per_batch={d.tokens_per_batch} gives {rows} rows of {longest} tokens, "
            f"fewer than the {need} needed ({strategy.global_batch_multiple} "
            f"devices x train.grad_accum_steps={config.train.grad_accum_steps}); raise "
            "data.tokens_per_batch"
        )


def check_writable(workdir: epath.Path) -> None:
    """Fail at start, not at the first save, when the workdir cannot be written."""
    if jax.process_index() != 0:
        return
    probe = workdir / f".write_test_{os.getpid()}"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise OSError(f"workdir {workdir} is not writable: {e}") from e


def restore_or_init(run: Run, checkpointer: ckpt_lib.Checkpointer) -> tuple[TrainState, dict]:
    """The newest good checkpoint placed for this run's devices (damaged ones are reported
    and skipped), or a fresh state."""
    if checkpointer.latest_step() is None and run.init_source is not None:
        return _init_from(run), {}
    if checkpointer.latest_step() is None:
        return run.strategy.init_state(run.init_fn), {}
    abstract = run.strategy.abstract_state(run.init_fn)
    step, state, data_state, _ = checkpointer.restore_latest(abstract)
    logging.info("resuming from step %d", step)
    return run.strategy.place_restored(state), data_state


def _init_from(run: Run) -> TrainState:
    """A fresh state (step 0, new optimizer moments, the config's dropout key) holding the
    parameters of train.init_from's checkpoint, placed for this run's devices."""
    source = run.init_source
    abstract = run.strategy.abstract_state(run.init_fn).params
    params = source.load_params(abstract, run.config, run.task.tokenizer.vocab_size)
    source.checkpointer.close()
    logging.info("parameters from %s (train.init_from)", source.path)
    if jax.process_index() == 0:
        print(f"init_from: parameters of {source.path} (step {source.step})", flush=True)
    state = run.strategy.init_state(run.init_fn)
    return state.replace(params=run.strategy.place_restored(params))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Train `config` in `workdir` (resuming if it holds checkpoints); return final metrics."""
    run = build_run(config, workdir)
    cfg = config.train
    logs.write_json(run.workdir / "config.json", config.to_dict())
    logs.write_json(run.workdir / "versions.json", logs.versions())
    checkpointer = ckpt_lib.Checkpointer(
        run.workdir / "checkpoints", keep=config.checkpoint.keep,
        best_metric=config.checkpoint.best_metric, best_mode=config.checkpoint.best_mode,
        async_save=config.checkpoint.async_save,
    )  # fmt: skip
    state, data_state = restore_or_init(run, checkpointer)
    train_iter = run.task.train_iterator(  # global batches, the same on every process
        batch_multiple=run.strategy.global_batch_multiple * cfg.grad_accum_steps
    )
    if data_state and cfg.restore_data_iterator:
        train_iter.set_state(data_state)
    shardings = None
    if run.strategy.kind == "mesh":
        shardings = run.strategy.state_shardings(jax.eval_shape(run.init_fn))
    step_fn = functools.partial(
        train_step, model=run.model, tx=run.tx, schedule=run.schedule,
        label_smoothing=cfg.label_smoothing, grad_accum_steps=cfg.grad_accum_steps,
    )  # fmt: skip
    p_train = run.strategy.compile_step(step_fn, donate=True, state_shardings=shardings)
    evaluator = Evaluator(run, shardings)
    logger = logs.MetricLogger(run.workdir, cfg.num_steps)
    step = int(jax.device_get(run.strategy.for_checkpoint(state).step))
    save = functools.partial(_save, run, checkpointer, train_iter)
    pending: list[dict] = []
    last_log, final = time.time(), {}
    stop = StopSignal(checkpointer)
    while step < cfg.num_steps:
        if stop.requested(step):
            save(step, state)
            checkpointer.close()
            stop.restore()
            logger.close()
            print(f"{stop.name} at step {step}: checkpoint saved in {checkpointer.directory}; "
                  "rerun the same command to resume", flush=True)  # fmt: skip
            return {"stopped_at": float(step)}
        batch = next(train_iter)
        state, metrics = p_train(state, run.strategy.place_global_batch(batch))
        step += 1
        pending.append(metrics)
        if len(pending) > 1:  # at most one step in flight (see above StopSignal)
            jax.block_until_ready(pending[-2])
        is_last = step == cfg.num_steps
        if step % cfg.log_every == 0 or is_last:
            jax.block_until_ready(pending[-1])  # the window ends when its last step has run
            scalars = _summarise(run.strategy, pending, time.time() - last_log)
            pending, last_log = [], time.time()
            scalars.update({f"data_{k}": v for k, v in train_iter.stats().items()})
            logger.write(step, "train", scalars)
            logger.progress(step, scalars)
            _check_finite(scalars, cfg.max_nonfinite_steps, step)
        if step % config.eval.every == 0 or is_last:
            final = evaluator.evaluate(state, step, logger, bleu=True)
            save(step, state, metrics=final)
        elif step % config.checkpoint.every == 0:
            save(step, state)
    stop.restore()
    checkpointer.wait()
    if config.eval.test_split and step == cfg.num_steps:  # every process decodes (SPMD)
        final.update(evaluator.test_metrics(state, step, logger))
    checkpointer.close()
    logger.close()
    _print_summary(run, final)
    return final


# Bounded run-ahead: JAX dispatches asynchronously, so without a wait the loop could queue
# up to log_every steps before the logging device_get; a SIGTERM (TPU preemption notice,
# ~30 s of grace) then waited for all of them before the save (measured: 44 queued steps,
# ~7 min, on the CPU Multi30k run). Waiting for step N-1 when N is dispatched keeps the
# device busy (N is queued, the next batch is prepared meanwhile) and the reply to a stop
# within about one step.


class StopSignal:
    """SIGTERM / SIGINT ask the loop to save and exit cleanly at the next step boundary.

    A single process needs its own handler (Orbax's preemption sync only acts under
    jax.distributed). With several processes JAX's coordination service watches SIGTERM and
    Orbax's `reached_preemption` makes all of them agree on the step to save at; installing
    a Python handler there would replace that watcher. A second SIGINT interrupts at once.
    """

    def __init__(self, checkpointer: ckpt_lib.Checkpointer):
        self.checkpointer = checkpointer
        self.signum: int | None = None
        self._previous = {}
        if threading_is_main() and jax.process_count() == 1:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "preemption"

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1:
            return bool(self.checkpointer.manager.reached_preemption(step))
        return self.signum is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _save(run: Run, checkpointer, train_iter, step: int, state, *, metrics=None) -> None:
    metrics = {k: v for k, v in (metrics or {}).items() if k == run.config.checkpoint.best_metric}
    checkpointer.save(
        step, run.strategy.for_checkpoint(state), data_state=train_iter.get_state(),
        config=run.config.to_dict(), tokenizer_bytes=run.task.tokenizer.to_bytes(),
        versions=logs.versions(), metrics=metrics or None,
    )  # fmt: skip


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


def _print_summary(run: Run, final: dict[str, float]) -> None:
    if jax.process_index() != 0:
        return
    ckpt_dir = run.workdir / "checkpoints"
    print(f"checkpoints: {ckpt_dir}")
    print(
        f"logs:        {run.workdir / 'metrics.jsonl'} (TensorBoard: {run.workdir / 'tensorboard'})"
    )
    for key in ("perplexity", "test_perplexity"):
        if key in final and task_of(run.config) == "lm":
            print(f"{key}: {final[key]:.2f}")
    for key in ("bleu", "test_bleu"):
        if key in final:
            print(f"{key}: {final[key]:.2f}  {final.get(key + '_signature', '')}")


class Evaluator:
    """Validation loss/accuracy/perplexity and BLEU (greedy) during training; for a language
    model (config.task == 'lm') loss/accuracy/perplexity only, also on the test split."""

    def __init__(self, run: Run, shardings: Any):
        self.run = run
        fn = functools.partial(eval_step, model=run.model)
        self.p_eval = run.strategy.compile_step(
            fn, donate=False, state_shardings=shardings, returns_state=False
        )

    def _loss_metrics(self, state, batches: Iterable[dict]) -> dict[str, float]:
        totals = {"nll": 0.0, "correct": 0.0, "weight": 0.0}
        for batch in batches:
            sums = self.run.strategy.fetch_metrics(
                self.p_eval(state, self.run.strategy.place_batch(_model_inputs(batch)))
            )
            totals = {k: totals[k] + sums[k] for k in totals}
        w = max(totals["weight"], 1.0)
        loss = totals["nll"] / w
        return {
            "loss": loss,
            "accuracy": totals["correct"] / w,
            "perplexity": math.exp(min(loss, 50)),
        }

    def evaluate(self, state, step: int, logger, *, bleu: bool) -> dict[str, float]:
        run = self.run
        multiple = run.strategy.local_batch_multiple
        metrics = self._loss_metrics(state, run.task.eval_batches("validation", multiple))
        if bleu and run.config.eval.bleu_examples > 0 and task_of(run.config) != "lm":
            metrics.update(self._bleu(state, "validation", run.config.eval.bleu_examples))
        logger.write(step, "validation", {k: v for k, v in metrics.items() if _is_num(v)})
        if jax.process_index() == 0:
            print(
                f"eval  {step:>6}  loss {metrics['loss']:.4f}  acc {metrics['accuracy']:.3f}  "
                f"ppl {metrics['perplexity']:.2f}"
                + (f"  bleu {metrics['bleu']:.2f}" if "bleu" in metrics else "")
                + "".join(f"  {k} {v:.2f}" for k, v in metrics.items() if k.startswith("bleu/")),
                flush=True,
            )
        return metrics

    def _bleu(
        self, state, split: str, limit: int | None, beam_size: int | None = None
    ) -> dict[str, Any]:
        from tx_jax import evaluation

        params = self.run.strategy.for_checkpoint(state).params
        task = self.run.task
        if jax.process_count() > 1:  # the parameters span all processes: decode the same
            task = dataclasses.replace(task, shard_eval=False)  # examples everywhere
        return evaluation.bleu_metrics(  # multilingual: also bleu/<direction>, chrf/<direction>
            self.run.model_config, params, task, split, limit=limit,
            beam_size=beam_size or self.run.config.eval.beam_size,
            alpha=self.run.config.eval.alpha,
        )  # fmt: skip

    def test_metrics(self, state, step: int, logger) -> dict[str, Any]:
        """BLEU on the test split, or for a language model its loss and perplexity."""
        if task_of(self.run.config) != "lm":
            return self.test_bleu(state, step, logger)
        split, multiple = self.run.config.eval.test_split, self.run.strategy.local_batch_multiple
        result = self._loss_metrics(state, self.run.task.eval_batches(split, multiple))
        logger.write(step, split, result)
        if jax.process_index() == 0:
            print(f"test  {step:>6}  loss {result['loss']:.4f}  ppl {result['perplexity']:.2f}",
                  flush=True)  # fmt: skip
        return {f"test_{k}": v for k, v in result.items()}

    def test_bleu(self, state, step: int, logger) -> dict[str, Any]:
        split = self.run.config.eval.test_split
        result = self._bleu(state, split, None, self.run.config.eval.get("test_beam_size"))
        out = {f"test_{k}": v for k, v in result.items()}
        logger.write(step, split, {k: v for k, v in result.items() if _is_num(v)})
        return out


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float))


def _model_inputs(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drop the eval-only keys (example ids, masks) the step does not take."""
    keep = ("inputs", "targets", *PACKING_KEYS)
    return {k: v for k, v in batch.items() if k in keep}
