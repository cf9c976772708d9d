"""Everything a run builds before its first step: devices, data, tokenizer, model, optimizer,
and the state it starts from (a checkpoint of its own, train.init_from's parameters, or fresh).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable

import flax.linen as nn
import jax
import ml_collections
import optax
from etils import epath

from tx_jax.config import task_of
from tx_jax.data import datasets, lengths, preparation, tasks
from tx_jax.data.shards import kept_train_pairs
from tx_jax.inference import restore
from tx_jax.model import ModelConfig, make_model
from tx_jax.runner import console, resume, sizing
from tx_jax.runner.validation import check_batch_divides, validate_config
from tx_jax.training import checkpoint as ckpt_lib
from tx_jax.training import optim, parallel
from tx_jax.training.freezing import EVERYTHING, Trainable
from tx_jax.training.state import TrainState, init_state
from tx_jax.training.step import train_step


@dataclasses.dataclass
class Sized:
    """size_from_data's result: a complete config and what it was sized from (build_run's input)."""

    config: ml_collections.ConfigDict  # nothing left to the data
    workdir: epath.Path
    strategy: parallel.Strategy
    task: tasks.Task
    # train.init_from's checkpoint when this run starts from it (None when resuming)
    source: restore.InitSource | None = None
    # the keys the data chose (runner/sizing.py): a budget refits the cadence among them
    chosen: tuple[str, ...] = ()
    # data.test_split, scored at the end; '' when eval.score_test is off or there is none
    test_split: str = ""


@dataclasses.dataclass
class Run:
    """What train_and_evaluate builds before the first step."""

    config: ml_collections.ConfigDict
    workdir: epath.Path
    strategy: parallel.Strategy
    task: tasks.Task
    model_config: ModelConfig
    model: nn.Module
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    init_fn: Callable[[], TrainState]
    # train.init_from's checkpoint when this run starts from it (None when resuming)
    init_source: restore.InitSource | None = None
    # train.time_budget_minutes' measurement and the steps it fixed (runner/budget.py)
    budget: dict | None = None
    # the keys the data chose (Sized.chosen): a budget refits the cadence among them
    sized: tuple[str, ...] = ()
    test_split: str = ""  # Sized.test_split
    # the part of the parameters that trains (training/freezing.py), and, when that is not
    # all of them, the base its checkpoints record (restore.base_reference)
    trainable: Trainable = EVERYTHING
    base: dict | None = None


def size_from_data(
    config: ml_collections.ConfigDict,
    workdir: str | epath.Path,
    strategy: parallel.Strategy | None = None,
) -> Sized:
    """The sizing step: `config` (not changed) completed from the data (runner/sizing.py; a
    resumed run's keys from its config.json), said in one line with what the length limits
    drop or truncate. Checked before any data is read, and again once sized. The task it
    prepared is the run's. `strategy`: default the config's (jax.distributed started first)."""
    workdir = ckpt_lib.absolute(workdir)
    config = sizing.begin(config, workdir)
    unset = tuple(sizing.unset_keys(config))
    validate_config(sizing.with_placeholders(config) if unset else config)
    if strategy is None:
        parallel.maybe_initialize_distributed(config.parallel)
        strategy = parallel.make_strategy(config.parallel)
    if not unset:  # before any data is read, where the sizes are known
        check_batch_divides(config, strategy)
    check_writable(workdir)
    source, task, train, evals = prepare_data(
        config, workdir, vocabulary="data.vocab_size" in unset
    )
    d = config.data
    test_split = d.test_split if config.eval.score_test else ""
    if test_split and not datasets.has_split(d, test_split):
        test_split = ""
    lines = []
    if unset:
        if train is None:
            raise ValueError(f"{sizing.unset_message(unset)} (sized for one translation pair)")
        multiple = strategy.global_batch_multiple * config.train.grad_accum_steps
        platform = jax.devices()[0].platform  # the run's devices: the strategy's are these
        choices = sizing.size_run(
            config, unset, train, evals, platform=platform, batch_multiple=multiple
        )
        lines.append(choices.line)
        validate_config(config)
        check_batch_divides(config, strategy)
    if train is not None:
        lines.append(lengths.describe_train(train, config.data.max_train_len))
        lines.append(lengths.describe_eval(evals, config.data.max_eval_len))
    for line in filter(None, lines):
        console.say(line)
    return Sized(config, workdir, strategy, task, source, chosen=unset, test_split=test_split)


def build_run(sized: Sized) -> Run:
    """Model and optimizer for a sized config (size_from_data), on its devices."""
    config, task = sized.config, sized.task
    platform = jax.devices()[0].platform  # the run's devices: the strategy's are these
    parts = build_model(config, task.tokenizer.vocab_size, task.tokenizer.bos_id, platform)
    trainable = Trainable.of(config.train)
    return Run(
        config,
        sized.workdir,
        sized.strategy,
        task,
        *parts,
        sized.source,
        sized=sized.chosen,
        test_split=sized.test_split,
        trainable=trainable,
    )


# ---------------------------------------------------------------- the seam to data/


def prepare_data(config: ml_collections.ConfigDict, workdir: epath.Path, *, vocabulary: bool):
    """(source, task, train lengths, evaluation lengths), prepared once. `source`:
    train.init_from's checkpoint (meta only), None when the workdir has its own checkpoints;
    `vocabulary`: choose data.vocab_size from the train pair count before the tokenizer is
    trained. The lengths are for one translation pair only, else None."""
    own = workdir / "checkpoints"
    resumed = own.exists() and any(p.name.isdigit() for p in own.iterdir())
    path = config.train.get("init_from")
    source = restore.open_init_source(path) if path and not resumed else None
    d = config.data
    if vocabulary:
        (pairs,) = preparation.open_train_splits([d], workdir)
        d.vocab_size = sizing.size_class(len(kept_train_pairs(d, pairs))).vocab_size
    tokenizer = source.tokenizer if source is not None else None
    task = tasks.prepare_task(
        d, workdir, seed=config.seed, tokenizer=tokenizer, lm=task_of(config) == "lm"
    )
    if not task.one_pair:
        return source, task, None, None
    splits = ["validation", *(["test"] if config.eval.score_test else [])]
    return (
        source,
        task,
        lengths.train_lengths(task, config.seed),
        lengths.eval_lengths(task, splits),
    )


def build_model(config: ml_collections.ConfigDict, vocab_size: int, bos_id: int, platform: str):
    """(model_config, model, tx, schedule, init_fn) of `config` on `platform` (tx_jax.planning
    builds it without data too)."""
    model_config = ModelConfig.of_run(config, platform, vocab_size=vocab_size, bos_id=bos_id)
    model = make_model(model_config, task_of(config))
    return model_config, model, *build_optimizer(config, model_config, model)


def build_optimizer(config: ml_collections.ConfigDict, model_config: ModelConfig, model):
    """(tx, schedule, init_fn) of `config.train` for `model`; runner/budget.py rebuilds it."""
    tx, schedule = optim.make_optimizer(config.train, model_config.d_model)
    trainable = Trainable.of(config.train)
    init_fn = functools.partial(init_state, model, tx, config.seed, trainable)
    return tx, schedule, init_fn


def state_shapes(config: ml_collections.ConfigDict, tokenizer, platform: str) -> TrainState:
    """The train state a checkpoint of `config` holds (trainable part only), as
    ShapeDtypeStructs."""
    init_fn = build_model(config, tokenizer.vocab_size, tokenizer.bos_id, platform)[-1]
    return Trainable.of(config.train).saved(nn.meta.unbox(jax.eval_shape(init_fn)))


def train_step_fn(config: ml_collections.ConfigDict, model: nn.Module, tx, schedule) -> Callable:
    """`train_step` bound to this run's model, optimizer and train settings (the loop and
    tx_jax.planning compile it)."""
    cfg = config.train
    return functools.partial(
        train_step,
        model=model,
        tx=tx,
        schedule=schedule,
        label_smoothing=cfg.label_smoothing,
        grad_accum_steps=cfg.grad_accum_steps,
        trainable=Trainable.of(cfg),
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
    """The newest good checkpoint placed for this run's devices (damaged ones skipped), or a
    fresh state. CheckpointError for a config it cannot resume under (runner/resume.py)."""
    if checkpointer.latest_step() is None and run.init_source is not None:
        return _init_from(run), {}
    if checkpointer.latest_step() is None:
        return run.strategy.init_state(run.init_fn), {}
    full = run.strategy.abstract_state(run.init_fn)
    abstract = run.trainable.saved(full)
    state_of = functools.partial(
        state_shapes, tokenizer=run.task.tokenizer, platform=run.model_config.platform
    )
    resume.check_config(run.config, checkpointer, abstract, state_of)
    step, state, data_state, meta = checkpointer.restore_latest(abstract)
    resume.announce(step, meta["config"], run.config)
    if not run.trainable.everything:  # the frozen part: the base's, as the run started
        where = str(checkpointer.directory / str(step))
        frozen = run.trainable.split(full.params)[1]
        frozen = restore.load_base(meta.get("base"), frozen, where)
        state = state.replace(params=run.trainable.merge(state.params, frozen))
        run.base = meta["base"]
    return run.strategy.place_restored(state), data_state


def _init_from(run: Run) -> TrainState:
    """A fresh state (step 0, new moments) holding train.init_from's parameters, placed."""
    source = run.init_source
    trainable = run.trainable
    abstract, _ = trainable.from_base(run.strategy.abstract_state(run.init_fn).params)
    params = source.load_params(abstract, run.config, run.task.tokenizer.vocab_size)
    source.checkpointer.close()
    logging.info("parameters from %s (train.init_from)", source.path)
    console.say(f"init_from: parameters of {source.path} (step {source.step})")
    # the base's buffers become the state's; only new adapters (B = 0: the base's outputs)
    # and the optimizer's moments are made
    state = run.strategy.init_state(run.init_fn, params)
    if not trainable.everything:
        one = run.strategy.for_checkpoint(state).params  # one replica under pmap
        run.base = restore.base_reference(source, trainable.split(one)[1])
        n, total = trainable.count(one)
        lora = run.model_config.lora
        what = [f"LoRA rank {lora.rank} (alpha {lora.alpha:g})"] if lora.rank else []
        what += [f"train.trainable={trainable.pattern!r}"] if trainable.pattern else []
        console.say(
            f"trainable: {n:,} of {total:,} parameters ({100 * n / total:.2f}%): "
            f"{', '.join(what)}; the rest frozen"
        )
    return state
