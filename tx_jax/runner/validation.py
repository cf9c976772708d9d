"""Config checks that need no device and no data: run before anything compiles, each error
naming the key (unknown keys are caught by the locked ConfigDict and ModelConfig.from_config).
"""

from __future__ import annotations

import math

import ml_collections

from tx_jax.config import study_value, task_of
from tx_jax.data import backtranslation, directions, shards, streams
from tx_jax.model import TASKS, ModelConfig
from tx_jax.model.lora import LoRA
from tx_jax.runner import sizing
from tx_jax.runner.profiling import profile_window
from tx_jax.training import optim, parallel
from tx_jax.training.freezing import Trainable


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the key of the first check `config` fails."""
    unset = sizing.unset_keys(config)
    if unset:
        raise ValueError(sizing.unset_message(unset))
    ModelConfig.from_config(config.model)  # unknown keys, enums, divisibility
    if task_of(config) not in TASKS:
        raise ValueError(f"task={config.task!r}; expected one of {TASKS}")
    if task_of(config) == "lm":
        side = study_value(config.data, "lm_side")
        if side not in streams.LM_SIDES:
            raise ValueError(f"data.lm_side={side!r}; expected one of {streams.LM_SIDES}")
        if config.checkpoint.best_metric in ("bleu", "chrf"):
            raise ValueError(
                f"checkpoint.best_metric={config.checkpoint.best_metric!r}: a language model "
                "has no BLEU; use loss, accuracy or perplexity"
            )
    directions.validate_config(config.data, task_of(config))
    backtranslation.validate_config(config.data, task_of(config))
    d = config.data
    shards.check_shape_rule(d.get("input_shards", 1), d.packing, d.bucket_boundaries)
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
        "train.num_steps",
        "train.warmup_steps",
        "train.grad_accum_steps",
        "train.log_every",
        "eval.every",
        "eval.beam_size",
        "checkpoint.every",
        "checkpoint.keep",
        "data.max_train_len",
        "data.tokens_per_batch",
        "data.vocab_size",
        "data.eval_batch_size",
    )
    for key in positive:
        section, name = key.split(".")
        if config[section][name] <= 0:
            raise ValueError(f"{key}={config[section][name]} must be positive")
    profile_window(config.train.get("profile_steps"), config.train.num_steps)
    cooldown = config.train.get("cooldown_steps", 0)
    if not 0 <= cooldown <= config.train.num_steps:
        raise ValueError(
            f"train.cooldown_steps={cooldown} must be in [0, train.num_steps="
            f"{config.train.num_steps}]"
        )
    minutes = config.train.get("time_budget_minutes", 0.0)
    if not (math.isfinite(minutes) and minutes >= 0):
        raise ValueError(
            f"train.time_budget_minutes={minutes} must be >= 0 (0: no budget, the run takes "
            "train.num_steps updates)"
        )
    k = config.eval.get("average_last", 0)
    if not 0 <= k <= config.checkpoint.keep:
        raise ValueError(
            f"eval.average_last={k} must be in [0, checkpoint.keep={config.checkpoint.keep}] "
            "(the checkpoints it averages must be kept)"
        )
    _check_freezing(config)
    if config.data.max_train_len > config.data.tokens_per_batch:
        raise ValueError(
            f"data.tokens_per_batch={config.data.tokens_per_batch} is smaller than one row of "
            f"data.max_train_len={config.data.max_train_len} tokens"
        )
    best = config.checkpoint.best_metric
    if best and best not in ("bleu", "chrf", "loss", "accuracy", "perplexity"):
        raise ValueError(
            f"checkpoint.best_metric={best!r}; expected a validation "
            "metric: bleu, chrf, loss, accuracy or perplexity"
        )


def _check_freezing(config: ml_collections.ConfigDict) -> None:
    """train.lora and train.trainable: what they need (training/freezing.py)."""
    trainable = Trainable.of(config.train)
    lora = config.train.get("lora")
    if lora is not None:
        LoRA(**lora.to_dict()).validate()
    if trainable.everything:
        return
    which = "train.lora.rank" if trainable.adapters else "train.trainable"
    if not config.train.get("init_from"):
        raise ValueError(
            f"{which} freezes parameters, which come from train.init_from: set it to the "
            "pretrained run or imported model (configs/finetune.py)"
        )
    if config.eval.get("average_last", 0):
        raise ValueError(
            f"eval.average_last={config.eval.average_last} with {which}: averaging a run's "
            "checkpoints is for full training; set it to 0"
        )


def check_batch_divides(config: ml_collections.ConfigDict, strategy: parallel.Strategy) -> None:
    """The smallest batch (rows at the longest bucket) must split over devices and micro-batches."""
    d = config.data
    longest = max(d.bucket_boundaries or [d.max_train_len]) if not d.packing else d.max_train_len
    shards = d.get("input_shards", 1)
    need = strategy.global_batch_multiple * config.train.grad_accum_steps
    # each input shard's rows are a multiple of this, so that the global batch divides
    per_shard = need // math.gcd(need, shards)
    rows = d.tokens_per_batch // shards // longest
    if rows < per_shard:
        raise ValueError(
            f"data.tokens_per_batch={d.tokens_per_batch} gives {rows} rows of {longest} tokens "
            f"per input shard (data.input_shards={shards}), fewer than the {per_shard} needed "
            f"for {strategy.global_batch_multiple} devices x train.grad_accum_steps="
            f"{config.train.grad_accum_steps}; raise data.tokens_per_batch"
        )
