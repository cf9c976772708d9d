"""Resuming a workdir under a config that differs from its checkpoint's. Refused before the
restore, naming each key with its stored and new values and what to do instead: a key that
decides the vocabulary (VOCABULARY_KEYS), or one that changes the train state's shapes or
structure (model sizes, weight_decay 0 -> > 0, ...). Every other change is listed once.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
from etils import epath

from tx_jax.config import upgrade_stored, with_study_defaults
from tx_jax.data.run_tokenizer import TOKENIZER_DEFAULTS, TOKENIZER_FILE
from tx_jax.inference.locate import (
    CheckpointError,
    config_differences,
    describe_keys,
    leaf_shapes,
    shape_mismatches,
)
from tx_jax.runner import console
from tx_jax.training.checkpoint import Checkpointer

# The keys (and the keys under them) that decide WORKDIR/tokenizer.model, which a resumed run
# keeps, so a new value would be silently ignored.
VOCABULARY_KEYS = (
    "data.vocab_size",
    "data.tokenizer_path",
    "data.tokenizer_pairs",
    "data.tokenizer",
    "data.user_defined_symbols",
    "data.dataset",
    "data.synthetic",
    "data.source_lang",
    "data.target_lang",
    "data.directions",
    "data.extra_eval_directions",
    "data.lm_side",
    "data.max_train_pairs",
    "data.backtranslation_tag",
)
# What the train state is built from (setup.build_model: the task's model, its optimizer):
# when the state's shapes differ, each differing key of these is tried alone to name the cause.
STATE_KEYS = ("task", "model", "train")

# a config -> its unboxed train state as ShapeDtypeStructs (setup.state_shapes)
StateOf = Callable[[ml_collections.ConfigDict], Any]


@dataclasses.dataclass
class Stored:
    """The newest readable checkpoint of a workdir, what a resumed config is compared with."""

    path: epath.Path  # WORKDIR/checkpoints/STEP
    config: dict  # as saved (through JSON)
    state: Any  # Orbax's metadata of the train state: shapes and dtypes, no array


def check_config(
    config: ml_collections.ConfigDict, checkpointer: Checkpointer, abstract: Any, state_of: StateOf
) -> None:
    """Raise CheckpointError when the checkpoints cannot be resumed under `config` (train state
    `abstract`, ShapeDtypeStructs): a changed vocabulary key, or differing state shapes (each
    cause named). No readable checkpoint: nothing compared (restore_latest reports it)."""
    stored = newest_readable(checkpointer)
    if stored is None:
        return
    changes = differences(stored.config, config)
    vocabulary = {k: v for k, v in changes.items() if _under(k, VOCABULARY_KEYS)}
    mismatched = shape_mismatches(leaf_shapes(abstract), leaf_shapes(stored.state))
    if not vocabulary and not mismatched:
        return
    workdir = checkpointer.directory.parent
    parts = []
    if vocabulary:
        verb = "decides" if len(vocabulary) == 1 else "decide"
        parts.append(
            f"{describe_keys(vocabulary)} {verb} the vocabulary, which a resumed run keeps "
            f"({workdir / TOKENIZER_FILE})"
        )
    params = [m for m in mismatched if m.startswith("['params']")]
    if mismatched:
        causes = _state_causes(stored, changes, state_of)
        example = f"{len(mismatched)} of its arrays differ, e.g. {(params or mismatched)[0]}"
        if not causes:
            parts.append(
                "the train state's shapes or structure differ with no task, model or train key "
                f"changed (did the model code change?): {example}"
            )
        else:
            verb = "changes" if len(causes) == 1 else "change"
            parts.append(
                f"{describe_keys(causes)} {verb} the train state's shapes or structure ({example})"
            )
    raise CheckpointError(_refusal(stored, workdir, parts, init_from=not vocabulary and not params))


def _refusal(stored: Stored, workdir: epath.Path, parts: list[str], init_from: bool) -> str:
    """The one-line error: what is refused, and what to do instead (train.init_from only where
    it would work: it keeps the vocabulary and needs the parameters to fit)."""
    advice = "resume with the stored values, or use a new workdir for this config"
    if init_from:
        advice += (
            f" (with train.init_from={workdir} to start from this run's parameters: step 0, "
            "a new optimizer state)"
        )
    return f"cannot resume {stored.path} under this config: {'; '.join(parts)}. To go on: {advice}"


def newest_readable(checkpointer: Checkpointer) -> Stored | None:
    """The newest checkpoint whose meta and state metadata read (reading no array), or None."""
    for step in reversed(checkpointer.all_steps()):
        try:
            config = checkpointer.restore_meta(step)["config"]
            state = checkpointer.state_metadata(step)
        except Exception as e:  # noqa: BLE001 - damage reads as Orbax's, JSON's or OS errors
            logging.warning("checkpoint step %d unreadable, not compared: %s", step, e)
            continue
        return Stored(checkpointer.directory / str(step), upgrade_stored(config), state)
    return None


def differences(stored: Mapping, config: ml_collections.ConfigDict) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (stored, new) for the keys of `config` that differ from the saved config
    `stored`, both as _complete reads them; a key unset on both sides (None, '', 0, [], absent)
    is no change."""
    current = json.loads(json.dumps(config.to_dict()))
    changed = config_differences(_complete(stored), _complete(current))
    return {k: (a, b) for k, (a, b) in changed.items() if a or b}


def _complete(config: Mapping) -> Mapping:
    """A saved `config` as today's code reads it: today's key names, absent study keys at
    their neutral values, TOKENIZER_DEFAULTS where data.tokenizer lacks a key."""
    config = with_study_defaults(upgrade_stored(config))
    data = config.get("data")
    if not isinstance(data, Mapping):
        return config
    tokenizer = {**TOKENIZER_DEFAULTS, **(data.get("tokenizer") or {})}
    return {**config, "data": {**data, "tokenizer": tokenizer}}


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _state_causes(
    stored: Stored, changes: Mapping[str, tuple[Any, Any]], state_of: StateOf
) -> dict[str, tuple[Any, Any]]:
    """The changed keys of STATE_KEYS that, set alone in the stored config, change its train
    state's shapes; all changed keys of STATE_KEYS when no single one does."""
    candidates = {k: v for k, v in changes.items() if _under(k, STATE_KEYS)}
    try:
        base = leaf_shapes(state_of(ml_collections.ConfigDict(stored.config)))
    except (ValueError, KeyError, TypeError):  # a stored config this code no longer builds
        return candidates
    alone = {}
    for key, (old, new) in candidates.items():
        try:
            shapes = leaf_shapes(state_of(_with(stored.config, key, new)))
        except (ValueError, KeyError, TypeError):  # invalid alone (d_model with num_heads, ...)
            continue
        if shapes != base:
            alone[key] = (old, new)
    return alone or candidates


def _with(config: Mapping, key: str, value: Any) -> ml_collections.ConfigDict:
    """A copy of the saved config `config` with the dotted `key` set to `value`."""
    tree = copy.deepcopy(dict(config))
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return ml_collections.ConfigDict(tree)


def announce(step: int, stored_config: Mapping, config: ml_collections.ConfigDict) -> None:
    """Log (and print on process 0) the keys that differ from the restored checkpoint's config."""
    changes = ", ".join(
        f"{k} {a!r} -> {b!r}" for k, (a, b) in differences(stored_config, config).items()
    )
    logging.info(
        "resuming from step %d%s", step, f" with config changes: {changes}" if changes else ""
    )
    if changes:
        console.say(f"resuming from step {step} with config changes: {changes}")
