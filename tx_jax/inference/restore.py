"""Loading a checkpoint for inference: its config, tokenizer and parameters, on this machine.

    loaded = restore.load("runs/default")                       the latest checkpoint
    loaded = restore.load("runs/default", step=400)             a given step
    loaded = restore.load("runs/default", average_last=5)       the average of the last 5
    loaded = restore.load(checkpoint="runs/default/averaged/last5/600")   any checkpoint path
    loaded.params, loaded.model_config, loaded.tokenizer, loaded.config, loaded.step
    source = restore.open_init_source("runs/multi")              train.init_from: another
    source.load_params(abstract, config, vocab_size)              run's parameters, checked

Only the `meta` item and the parameters are read (an Orbax partial restore), onto one local
device whatever layout saved them. The config is the checkpoint's own; `overrides` change it
({'data.data_dir': '/data/tfds'}), and one under which the stored parameters no longer fit is
a `CheckpointError` naming the config keys that differ from the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from flax import traverse_util
from jax.experimental import multihost_utils

from tx_jax.config import task_of
from tx_jax.data.tokenizer import Tokenizer
from tx_jax.inference import averaging
from tx_jax.inference.locate import (
    CHECKPOINTS_DIR,
    CheckpointError,
    check_params_fit,
    config_differences,
    latest_verified,
    locate,
    open_checkpoints,
    open_step,
    read_meta,
    select_step,
)
from tx_jax.model import DecoderOnly, EncoderDecoder, ModelConfig, make_model
from tx_jax.model import lora as lora_lib
from tx_jax.training.checkpoint import Checkpointer, CorruptCheckpointError, absolute
from tx_jax.training.freezing import Trainable


@dataclasses.dataclass
class Loaded:
    """A checkpoint ready for decoding."""

    config: ml_collections.ConfigDict  # the checkpoint's config with the overrides applied
    tokenizer: Tokenizer  # the SentencePiece model stored in the checkpoint
    model_config: ModelConfig
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
    def model(self) -> EncoderDecoder | DecoderOnly:
        return make_model(self.model_config, self.task)


def stored_config(workdir: str | epath.Path) -> ml_collections.ConfigDict:
    """The config of a run's latest checkpoint, as stored (no array is read)."""
    directory, _, _ = locate(workdir)
    ckpt = open_checkpoints(directory)
    try:
        return ml_collections.ConfigDict(read_meta(ckpt, ckpt.all_steps()[-1])["config"])
    finally:
        ckpt.close()


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
    """Config, tokenizer, model config and parameters of one checkpoint: a run's `workdir`
    (WORKDIR/checkpoints) or a `checkpoint` manager or step directory; `step` (default the
    latest, or the one `checkpoint` names); `average_last` K: the average of the last K
    (up to `step`), saved under WORKDIR/averaged and reused; `overrides`: dotted config keys
    -> values; `device` (default the first local one); `task` ('translation' or 'lm') to
    insist on."""
    if average_last is not None:
        if checkpoint is not None or workdir is None:
            raise CheckpointError("average_last averages a workdir's checkpoints: give workdir")
        averaged = averaging.average_checkpoints(workdir, average_last, until=step)
        checkpoint, step = averaged.path, None
    directory, named_step, workdir = locate(workdir, checkpoint)
    if named_step is not None and step is not None and step != named_step:
        raise CheckpointError(f"{directory / str(named_step)} is step {named_step}, not {step}")
    ckpt = open_checkpoints(directory)
    wanted = named_step if step is None else step
    if wanted is None:  # the latest good one: damaged checkpoints are reported and skipped
        wanted = latest_verified(ckpt)
    opened = open_step(ckpt, wanted, overrides, device)
    stored_task = task_of(opened.config)
    if task is not None and stored_task != task:
        ckpt.close()
        raise CheckpointError(
            f"{directory / str(opened.step)} holds a {stored_task!r} model (config.task), "
            f"not {task!r}"
        )
    try:
        params = restore_params(ckpt, opened)
    except CorruptCheckpointError as e:
        raise CheckpointError(str(e)) from None
    finally:
        ckpt.close()
    averaged_steps = (opened.meta.get("averaged") or {}).get("steps")
    return Loaded(
        opened.config,
        opened.tokenizer,
        opened.model_config,
        params,
        opened.step,
        directory,
        workdir,
        averaged_steps,
    )


def merged(loaded: Loaded) -> Loaded:
    """`loaded` with its LoRA adapters folded into the weights (model/lora.py's merge) and a
    model config without them: what export writes. A checkpoint without adapters as it is."""
    lora = loaded.model_config.lora
    if not lora.rank:
        return loaded
    params = lora_lib.merge(jax.device_get(loaded.params), lora)
    return dataclasses.replace(
        loaded, params=params, model_config=loaded.model_config.replace(lora_rank=0)
    )


def restore_params(ckpt: Checkpointer, opened) -> Any:
    """The parameters of an opened checkpoint: as stored, or, for a run that froze part of
    them (training/freezing.py), its trainable part merged with its base's frozen part."""
    trainable = Trainable.of(opened.config.train)
    if trainable.everything:
        return ckpt.restore_params(opened.step, opened.abstract_params)
    own, frozen = trainable.split(opened.abstract_params)
    where = str(ckpt.directory / str(opened.step))
    frozen = load_base(opened.meta.get("base"), trainable.in_frozen_dtype(frozen), where)
    return trainable.merge(ckpt.restore_params(opened.step, own), frozen)


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
            check_params_fit(
                abstract,
                self.checkpointer.state_metadata(self.step)["params"],
                differences,
                self.path,
            )
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
    step = latest_verified(ckpt) if step is None else select_step(ckpt, step)
    meta = read_meta(ckpt, step)
    return InitSource(ckpt, step, meta["config"], Tokenizer.from_bytes(meta["tokenizer"]))


# ---------------------------------------------------------------------- a frozen base


def params_digest(params: Any) -> str:
    """SHA-256 of a parameter tree's values (path, dtype, shape and bytes of every leaf, in
    path order), however it is stored or sharded: the content a frozen base is checked by."""
    digest = hashlib.sha256()
    for path, leaf in sorted(traverse_util.flatten_dict(params, sep="/").items()):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        array = np.asarray(jax.device_get(leaf))
        digest.update(f"{path} {array.dtype} {array.shape}\n".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def base_reference(source: InitSource, frozen: Any) -> dict:
    """What an adapted run's checkpoints record of its base (train.init_from): the step it
    read and the digest of the frozen parameters, as the run holds them."""
    return {"path": str(source.path), "step": source.step, "digest": params_digest(frozen)}


def load_base(reference: dict | None, abstract: Any, where: str) -> Any:
    """The frozen parameters of an adapted run's checkpoint `where` from the base its meta
    records (`base_reference`), restored into `abstract` and checked against the digest. A
    missing or changed base is a CheckpointError in one line."""
    if not reference:
        raise CheckpointError(
            f"{where} holds only the trainable parameters but records no base (train.init_from)"
        )
    path = reference["path"]
    try:
        ckpt = open_checkpoints(absolute(path).parent)
    except CheckpointError:
        ckpt = None
    if ckpt is None or reference["step"] not in ckpt.all_steps():
        raise CheckpointError(
            f"the base of {where} is missing: {path} (train.init_from, step "
            f"{reference['step']}) holds no checkpoint; its frozen parameters were read there"
        )
    try:
        frozen = ckpt.restore_params(reference["step"], abstract)
    except CorruptCheckpointError as e:
        raise CheckpointError(f"the base of {where}: {e}") from None
    finally:
        ckpt.close()
    digest = params_digest(frozen)
    if digest != reference["digest"]:
        raise CheckpointError(
            f"the base of {where} changed: {path} now holds other parameters (digest "
            f"{digest[:12]}, trained on {reference['digest'][:12]}); its adapters fit only the "
            "base they were trained on"
        )
    return frozen
