"""Loading a checkpoint for inference: its config, tokenizer and parameters, on this machine.

    loaded = restore.load("runs/default")                       the latest checkpoint
    loaded = restore.load("runs/default", step=400)             a given step
    loaded = restore.load("runs/default", average_last=5)       the average of the last 5
    loaded = restore.load(checkpoint="runs/default/averaged/last5/600")   any checkpoint path
    loaded.params, loaded.model_config, loaded.tokenizer, loaded.config, loaded.step
    source = restore.open_init_source("runs/multi")              train.init_from: another
    source.load_params(abstract, config, vocab_size)              run's parameters, checked

Only what decoding needs is read: the `meta` item (config, SentencePiece model) and the
parameters of the `state` item (an Orbax partial restore: no optimizer moments, no iterator
state). Parameters are restored onto one local device whatever layout saved them (a pmap
replica, or a (data, fsdp, tensor) mesh of 8 devices), so any checkpoint evaluates on one CPU.

The config is the checkpoint's own, never a config file. `overrides` change it, e.g. the data
paths on another machine ({'data.data_dir': '/data/tfds'}; text values are converted to the
stored value's type). An override under which the stored parameters no longer fit the model
is a `CheckpointError` naming the config keys that differ from the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from etils import epath

from tx_jax import models
from tx_jax.checkpoint import Checkpointer, CorruptCheckpointError, absolute
from tx_jax.config_utils import convert_text, task_of
from tx_jax.data.tokenizer import Tokenizer

CHECKPOINTS_DIR = "checkpoints"  # WORKDIR/checkpoints/N: training's checkpoints
AVERAGED_DIR = "averaged"  # WORKDIR/averaged/<name>/N: averaged checkpoints (averaging.py)
# Model keys that change the computation but not the parameters; other model keys that
# differ from the checkpoint's (norm_position, positional, ...) earn a warning.
HARMLESS_MODEL_KEYS = frozenset({
    "attention_impl", "dtype", "dropout_rate", "attention_dropout_rate", "ffn_dropout_rate",
    "remat", "sow_attention_weights",
})  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, selected or loaded, said in plain words."""


@dataclasses.dataclass
class Loaded:
    """A checkpoint ready for decoding."""

    config: ml_collections.ConfigDict  # the checkpoint's config with the overrides applied
    tokenizer: Tokenizer  # the SentencePiece model stored in the checkpoint
    model_config: models.ModelConfig
    params: Any  # the 'params' collection, unboxed, on one local device
    step: int
    directory: epath.Path  # the checkpoint manager's directory (holds N/ subdirectories)
    workdir: epath.Path  # the run directory: evaluation outputs go here
    averaged_steps: list[int] | None = None  # the steps an averaged checkpoint holds

    @property
    def path(self) -> epath.Path:
        return self.directory / str(self.step)

    @property
    def task(self) -> str:
        return task_of(self.config)

    @property
    def model(self) -> models.EncoderDecoder | models.DecoderOnly:
        return make_model(self.model_config, self.task)


@dataclasses.dataclass
class Opened:
    """One checkpoint step with its meta read and its model built; no array read yet."""

    checkpointer: Checkpointer
    step: int
    meta: dict  # config (as stored), tokenizer bytes, versions, maybe 'averaged'
    config: ml_collections.ConfigDict  # with overrides
    tokenizer: Tokenizer
    model_config: models.ModelConfig
    abstract_params: Any  # ShapeDtypeStructs with a single-device sharding


# ---------------------------------------------------------------------- finding it


def locate(
    workdir: str | epath.Path | None = None, checkpoint: str | epath.Path | None = None
) -> tuple[epath.Path, int | None, epath.Path]:
    """-> (checkpoint manager directory, step the path names or None, run directory).

    `checkpoint` is a manager directory (WORKDIR/checkpoints, WORKDIR/averaged/last5) or one
    step of it (.../600); without it the checkpoints are WORKDIR/checkpoints."""
    if checkpoint is None:
        if workdir is None:
            raise CheckpointError("give a workdir or a checkpoint directory")
        workdir = absolute(workdir)
        return workdir / CHECKPOINTS_DIR, None, workdir
    path, step = absolute(checkpoint), None
    if path.name.isdigit() and (path / "state").exists():
        path, step = path.parent, int(path.name)
    return path, step, absolute(workdir) if workdir is not None else infer_workdir(path)


def infer_workdir(directory: epath.Path) -> epath.Path:
    """The run directory of a checkpoint manager directory (where eval outputs go)."""
    if directory.name == CHECKPOINTS_DIR:
        return directory.parent
    if directory.parent.name == AVERAGED_DIR:
        return directory.parent.parent
    return directory


def open_checkpoints(directory: str | epath.Path) -> Checkpointer:
    """A read-only Checkpointer over `directory`, which must hold at least one checkpoint."""
    directory = absolute(directory)
    if not directory.exists():
        raise CheckpointError(f"no checkpoint: {directory} does not exist")
    ckpt = Checkpointer(directory, read_only=True, best_metric=None)
    if not ckpt.all_steps():
        raise CheckpointError(f"no checkpoint in {directory} (no finished step directory)")
    return ckpt


def _latest_verified(ckpt: Checkpointer) -> int | None:
    steps = ckpt.all_steps()
    for step in reversed(steps):
        try:
            ckpt.verify(step)
            return step
        except CorruptCheckpointError as e:
            print(f"warning: {e}; falling back to an earlier checkpoint", file=sys.stderr)
    if steps:
        raise CheckpointError(f"every checkpoint in {ckpt.directory} is damaged: {steps}")
    return None


def select_step(ckpt: Checkpointer, step: int | None) -> int:
    """`step` if it exists (else an error listing the steps there are); None: the latest."""
    steps = ckpt.all_steps()
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(
            f"no checkpoint for step {step} in {ckpt.directory}; available steps: {steps}"
        )
    return step


# ---------------------------------------------------------------------- config


def parse_override_args(args: list[str]) -> dict[str, str]:
    """['--config.data.data_dir=/x', ...] -> {'data.data_dir': '/x'} (values stay text)."""
    out = {}
    for arg in args:
        key, sep, value = arg.removeprefix("--config.").partition("=")
        if not sep or not key:
            raise CheckpointError(f"config override {arg!r}: write --config.section.key=value")
        out[key] = value
    return out


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> None:
    """Set dotted keys in place; text values take the stored value's type."""
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for i, part in enumerate(parents):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                raise CheckpointError(
                    f"config override {dotted!r}: the checkpoint's config has no key "
                    f"{'.'.join(parents[: i + 1])!r}"
                )
            node = node[part]
        if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
            raise CheckpointError(f"config override {dotted!r}: the checkpoint's config has no "
                                  f"key {dotted!r}")  # fmt: skip
        try:
            node[leaf] = convert_text(value, node[leaf]) if isinstance(value, str) else value
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config override {dotted}={value!r}: {e}") from None


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """{'model': {'d_model': 32}} -> {'model.d_model': 32}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(stored: Mapping, current: Mapping) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (stored value, current value) for every key whose value differs."""
    a, b = flatten(stored), flatten(current)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


# ---------------------------------------------------------------------- parameters


def make_model(model_config: models.ModelConfig, task: str) -> nn.Module:
    return models.DecoderOnly(model_config) if task == "lm" else models.EncoderDecoder(model_config)


def abstract_params(
    model_config: models.ModelConfig, sharding: jax.sharding.Sharding, task: str = "translation"
) -> Any:
    """The model's unboxed parameters as ShapeDtypeStructs placed by `sharding`."""
    model = make_model(model_config, task)
    dummy = jnp.ones((1, 8), jnp.int32)
    args = (dummy,) if task == "lm" else (dummy, dummy)
    boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *args)["params"])
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), nn.meta.unbox(boxed)
    )


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in leaves}


def _describe(differences: Mapping[str, tuple[Any, Any]]) -> str:
    if not differences:
        return "no config key differs from the checkpoint's (did the model code change?)"
    keys = ", ".join(f"{k} ({a!r} in the checkpoint, {b!r} now)" for k, (a, b) in
                     differences.items())  # fmt: skip
    return f"the config keys that differ from the checkpoint's: {keys}"


def check_params_fit(
    abstract: Any, stored: Any, differences: Mapping[str, tuple[Any, Any]], where: Any
) -> None:
    """Raise CheckpointError, naming the differing config keys, when `stored` (the
    checkpoint's param metadata) and `abstract` (this config's model) differ in shape."""
    want, have = _shapes(abstract), _shapes(stored)
    if want == have:
        return
    bad = [
        f"{k}: {have.get(k, 'absent')} in the checkpoint, {want.get(k, 'absent')} in the model"
        for k in sorted(set(want) | set(have))
        if want.get(k) != have.get(k)
    ]
    raise CheckpointError(
        f"the parameters of {where} do not fit the model: {_describe(differences)}. "
        f"{len(bad)} parameter(s) differ, e.g. " + "; ".join(bad[:3])
    )


def open_step(
    ckpt: Checkpointer,
    step: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    device: jax.Device | None = None,
) -> Opened:
    """Read one checkpoint's meta, apply `overrides`, build the model and check that the
    stored parameters fit it (shapes from the checkpoint's metadata; no array is read)."""
    step = select_step(ckpt, step)
    meta = ckpt.restore_meta(step)
    config = ml_collections.ConfigDict(meta["config"])
    apply_overrides(config, overrides or {})
    differences = config_differences(meta["config"], config.to_dict())
    tokenizer = Tokenizer.from_bytes(meta["tokenizer"])
    try:
        model_config = models.ModelConfig.from_config(
            config.model, vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id
        )
    except ValueError as e:
        raise CheckpointError(
            f"the config does not fit {ckpt.directory / str(step)}: {e}; " + _describe(differences)
        ) from None
    sharding = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
    abstract = abstract_params(model_config, sharding, task_of(config))
    stored = ckpt.state_metadata(step)["params"]
    check_params_fit(abstract, stored, differences, ckpt.directory / str(step))
    risky = [k for k in differences if k.startswith("model.")
             and k.removeprefix("model.") not in HARMLESS_MODEL_KEYS]  # fmt: skip
    if risky:
        print(f"warning: model keys {risky} differ from the checkpoint's; its parameters fit "
              "but were trained with the stored values", file=sys.stderr)  # fmt: skip
    return Opened(ckpt, step, meta, config, tokenizer, model_config, abstract)


def load(
    workdir: str | epath.Path | None = None,
    *,
    checkpoint: str | epath.Path | None = None,
    step: int | None = None,
    average_last: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    device: jax.Device | None = None,
    task: str | None = None,
) -> Loaded:
    """Config, tokenizer, model config and parameters of one checkpoint.

    Args:
      workdir: a training run directory (its checkpoints are WORKDIR/checkpoints).
      checkpoint: instead, a checkpoint manager directory or one step directory of it.
      step: which step (default: the latest, or the one `checkpoint` names).
      average_last: average the last K checkpoints (up to `step` if given): computed once
        with averaging.average_checkpoints, saved under WORKDIR/averaged and reused.
      overrides: dotted config keys -> values (text is converted to the stored type).
      device: where the parameters go (default: the first local device).
      task: 'translation' or 'lm' to insist on (the stored config's `task` decides the model).
    """
    if average_last is not None:
        if checkpoint is not None or workdir is None:
            raise CheckpointError("average_last averages a workdir's checkpoints: give workdir")
        from tx_jax import averaging  # averaging builds on this module

        averaged = averaging.average_checkpoints(workdir, average_last, until=step)
        checkpoint, step = averaged.path, None
    directory, named_step, workdir = locate(workdir, checkpoint)
    if named_step is not None and step is not None and step != named_step:
        raise CheckpointError(f"{directory / str(named_step)} is step {named_step}, not {step}")
    ckpt = open_checkpoints(directory)
    wanted = named_step if step is None else step
    if wanted is None:  # the latest good one: damaged checkpoints are reported and skipped
        wanted = _latest_verified(ckpt)
    opened = open_step(ckpt, wanted, overrides, device)
    stored_task = task_of(opened.config)
    if task is not None and stored_task != task:
        ckpt.close()
        raise CheckpointError(
            f"{directory / str(opened.step)} holds a {stored_task!r} model (config.task), "
            f"not {task!r}"
        )
    try:
        params = ckpt.restore_params(opened.step, opened.abstract_params)
    except CorruptCheckpointError as e:
        ckpt.close()
        raise CheckpointError(str(e)) from None
    ckpt.close()
    averaged_steps = (opened.meta.get("averaged") or {}).get("steps")
    return Loaded(
        opened.config, opened.tokenizer, opened.model_config, params, opened.step, directory,
        workdir, averaged_steps,
    )  # fmt: skip


# ---------------------------------------------------------------------- init_from


@dataclasses.dataclass
class InitSource:
    """Another run's checkpoint whose parameters start a new run (`train.init_from`)."""

    checkpointer: Checkpointer
    step: int
    config: dict  # the checkpoint's config, as stored
    tokenizer: Tokenizer  # its SentencePiece model: the new run must use the same vocabulary

    @property
    def path(self) -> epath.Path:
        return self.checkpointer.directory / str(self.step)

    def load_params(self, abstract: Any, config: ml_collections.ConfigDict, vocab_size: int):
        """The checkpoint's parameters restored into `abstract` (this run's unboxed parameter
        ShapeDtypeStructs, with its shardings). A CheckpointError names the config keys when
        the vocabulary or a parameter shape differs."""
        where = f"train.init_from={str(self.path)!r}"
        if vocab_size != self.tokenizer.vocab_size:
            raise CheckpointError(
                f"{where}: its vocabulary has {self.tokenizer.vocab_size} pieces, this run's "
                f"{vocab_size} (data.vocab_size / data.tokenizer_path): use its tokenizer"
            )
        stored = {"model": self.config.get("model", {})}
        differences = config_differences(stored, {"model": config.model.to_dict()})
        try:
            check_params_fit(abstract, self.checkpointer.state_metadata(self.step)["params"],
                             differences, self.path)  # fmt: skip
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
        try:
            return self.checkpointer.restore_params(self.step, abstract)
        except CorruptCheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None


def open_init_source(path: str | epath.Path) -> InitSource:
    """`train.init_from`: a run directory (its latest good checkpoint), a checkpoint manager
    directory (WORKDIR/checkpoints, WORKDIR/averaged/last5) or one step of it (.../600)."""
    p = absolute(path)
    if (p / CHECKPOINTS_DIR).is_dir():
        directory, step, _ = locate(workdir=p)
    else:
        directory, step, _ = locate(checkpoint=p)
    try:
        ckpt = open_checkpoints(directory)
    except CheckpointError as e:
        raise CheckpointError(f"train.init_from={str(path)!r}: {e}") from None
    step = _latest_verified(ckpt) if step is None else select_step(ckpt, step)
    meta = ckpt.restore_meta(step)
    return InitSource(ckpt, step, meta["config"], Tokenizer.from_bytes(meta["tokenizer"]))
