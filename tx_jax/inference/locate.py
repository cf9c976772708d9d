"""Finding and opening a checkpoint for inference: which directory and step, its config (with
overrides), its model, and whether its stored parameters fit that model. No array is read here;
restore.load reads the parameters, averaging.py averages them.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import ml_collections
from etils import epath

from tx_jax import config as config_lib
from tx_jax.config import task_of
from tx_jax.data.tokenizer import Tokenizer
from tx_jax.model import ModelConfig, init_params, make_model
from tx_jax.training.checkpoint import Checkpointer, CorruptCheckpointError, absolute
from tx_jax.training.freezing import Trainable

CHECKPOINTS_DIR = "checkpoints"  # WORKDIR/checkpoints/N: training's checkpoints
AVERAGED_DIR = "averaged"  # WORKDIR/averaged/<name>/N: averaged checkpoints (averaging.py)
# Model keys that change the computation but not the parameters; other model keys that
# differ from the checkpoint's (norm_position, positional, ...) earn a warning.
HARMLESS_MODEL_KEYS = frozenset(
    {
        "attention_impl",
        "kernels",
        "dropout_bits",
        "loss_impl",
        "loss_block",
        "dtype",
        "dropout_rate",
        "attention_dropout_rate",
        "ffn_dropout_rate",
        "remat",
        "sow_attention_weights",
    }
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, selected or loaded, said in plain words."""


@dataclasses.dataclass
class Opened:
    """One checkpoint step with its meta read and its model built; no array read yet."""

    checkpointer: Checkpointer
    step: int
    meta: dict  # config (as stored), tokenizer bytes, versions, maybe 'averaged'
    config: ml_collections.ConfigDict  # with overrides
    tokenizer: Tokenizer
    model_config: ModelConfig
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


def latest_verified(ckpt: Checkpointer) -> int | None:
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


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> None:
    """Set dotted keys of a checkpoint's config in place; text values take the stored type."""
    try:
        config_lib.apply_overrides(config, overrides, from_text=True)
    except KeyError as e:
        raise CheckpointError(f"{e.args[0]} in the checkpoint's config") from None
    except ValueError as e:
        raise CheckpointError(str(e)) from None


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


def abstract_params(
    model_config: ModelConfig, sharding: jax.sharding.Sharding, task: str = "translation"
) -> Any:
    """The model's unboxed parameters as ShapeDtypeStructs placed by `sharding`, kept per
    (config, sharding, task): tracing init is the slow part of opening a checkpoint."""
    return jax.tree_util.tree_map(lambda x: x, _abstract_params(model_config, sharding, task))


@functools.lru_cache(maxsize=16)
def _abstract_params(model_config: ModelConfig, sharding: jax.sharding.Sharding, task: str):
    model = make_model(model_config, task)
    boxed = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0)))
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), nn.meta.unbox(boxed)
    )


def leaf_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """Leaf path -> shape, every key written as a dict key ("['params']['encoder']...") as
    Orbax's metadata writes them; leaves without a shape are left out."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {_path(p): tuple(x.shape) for p, x in leaves if hasattr(x, "shape")}


def _path(path: tuple) -> str:
    names = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return "".join(f"[{str(name)!r}]" for name in names)


def shape_mismatches(want: Mapping[str, tuple], have: Mapping[str, tuple]) -> list[str]:
    """'PATH: SHAPE in the checkpoint, SHAPE in the model' for every leaf whose shape differs
    between `have` (the checkpoint's leaf_shapes) and `want` (the model's)."""
    return [
        f"{k}: {have.get(k, 'absent')} in the checkpoint, {want.get(k, 'absent')} in the model"
        for k in sorted(set(want) | set(have))
        if want.get(k) != have.get(k)
    ]


def describe_keys(differences: Mapping[str, tuple[Any, Any]]) -> str:
    """'model.d_ff (64 in the checkpoint, 128 now), ...'."""
    return ", ".join(
        f"{k} ({a!r} in the checkpoint, {b!r} now)" for k, (a, b) in differences.items()
    )


def _describe(differences: Mapping[str, tuple[Any, Any]]) -> str:
    if not differences:
        return "no config key differs from the checkpoint's (did the model code change?)"
    return f"the config keys that differ from the checkpoint's: {describe_keys(differences)}"


def check_params_fit(
    abstract: Any, stored: Any, differences: Mapping[str, tuple[Any, Any]], where: Any
) -> None:
    """Raise CheckpointError, naming the differing config keys, when `stored` (the
    checkpoint's param metadata) and `abstract` (this config's model) differ in shape."""
    bad = shape_mismatches(leaf_shapes(abstract), leaf_shapes(stored))
    if not bad:
        return
    raise CheckpointError(
        f"the parameters of {where} do not fit the model: {_describe(differences)}. "
        f"{len(bad)} parameter(s) differ, e.g. " + "; ".join(bad[:3])
    )


def read_meta(ckpt: Checkpointer, step: int) -> dict:
    """One checkpoint's meta, its config under today's key names (config.upgrade_stored)."""
    meta = ckpt.restore_meta(step)
    return {**meta, "config": config_lib.upgrade_stored(meta["config"])}


def open_step(
    ckpt: Checkpointer,
    step: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    device: jax.Device | None = None,
) -> Opened:
    """Read one checkpoint's meta, apply `overrides`, build the model and check that the
    stored parameters fit it (shapes from the checkpoint's metadata; no array is read)."""
    step = select_step(ckpt, step)
    meta = read_meta(ckpt, step)
    config = ml_collections.ConfigDict(meta["config"])
    apply_overrides(config, overrides or {})
    differences = config_differences(meta["config"], config.to_dict())
    tokenizer = Tokenizer.from_bytes(meta["tokenizer"])
    try:
        model_config = ModelConfig.of_run(
            config,
            (device or jax.local_devices()[0]).platform,
            vocab_size=tokenizer.vocab_size,
            bos_id=tokenizer.bos_id,
        )
    except ValueError as e:
        raise CheckpointError(
            f"the config does not fit {ckpt.directory / str(step)}: {e}; " + _describe(differences)
        ) from None
    sharding = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
    abstract = abstract_params(model_config, sharding, task_of(config))
    stored = ckpt.state_metadata(step)["params"]
    own = Trainable.of(config.train).split(abstract)[0]  # what it stores: freezing.py
    check_params_fit(own, stored, differences, ckpt.directory / str(step))
    risky = [
        k
        for k in differences
        if k.startswith("model.") and k.removeprefix("model.") not in HARMLESS_MODEL_KEYS
    ]
    if risky:
        print(
            f"warning: model keys {risky} differ from the checkpoint's; its parameters fit "
            "but were trained with the stored values",
            file=sys.stderr,
        )
    return Opened(ckpt, step, meta, config, tokenizer, model_config, abstract)
