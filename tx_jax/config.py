"""Config plumbing shared by configs/*.py: the `get_config(arg)` argument (`parse_arg`:
`configs/multi30k.py:pair=en-fr,variant=small`), overrides, and the tables that keep old runs
readable: STUDY_KEYS (keys only a study's configs define, with their neutral values), and
every rename of a stored config in this module alone: RENAMED_KEYS (`upgrade_stored`),
REMOVED_KEYS and REPLACED_VALUES (`upgrade_section`, also applied by ModelConfig.from_config).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import os
import pathlib
import types
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ml_collections


def convert_text(text: str, like: Any) -> Any:
    """Command-line text -> a value of the type `like` has (bool, int, float, str); for None,
    lists and dicts a Python literal, else the text itself. ValueError names what was wrong."""
    if isinstance(like, bool):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if isinstance(like, int):
        return int(text)
    if isinstance(like, float):
        return float(text)
    if isinstance(like, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
    """'a=1,b=x' -> ConfigDict(a=1, b='x'), typed like `defaults`; a bare word `w` sets
    `variant=w` when `variant` is a default (so `:debug` works as `:variant=debug`)."""
    values = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        if "=" not in item and "variant" in defaults:
            key, text = "variant", item
        else:
            key, text = _split_assignment(item)
        if key not in defaults:
            raise ValueError(
                f"unknown config argument {key!r}; valid arguments: {sorted(defaults)}"
            )
        try:
            values[key] = convert_text(text.strip(), defaults[key])
        except ValueError as e:
            raise ValueError(f"config argument {key}={text.strip()!r}: {e}") from None
    return ml_collections.ConfigDict(values)


def _split_assignment(item: str, what: str = "config argument") -> tuple[str, str]:
    """'key=value' -> ('key', 'value'), both stripped; ValueError naming `what` otherwise."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{what} {item!r} is not key=value")
    return key.strip(), text.strip()


def parse_assignments(
    items: Sequence[str], what: str = "override", prefix: str = ""
) -> dict[str, str]:
    """['a.b=3', 'c=x y'] -> {'a.b': '3', 'c': 'x y'} (values stay text); `prefix` (e.g.
    '--config.') is removed from each item first."""
    return dict(_split_assignment(item.removeprefix(prefix), what) for item in items)


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Mapping[str, Any], *, from_text: bool = False
) -> None:
    """Set dotted keys ('model.d_model': 256) in place; `from_text`: convert text values like
    the value they replace. An old name of RENAMED_KEYS sets its new key, with a warning.
    KeyError names an unknown key, ValueError a value that does not convert."""
    for dotted, value in overrides.items():
        new = new_name(dotted)
        if new and missing_keys(config, [dotted]) and not missing_keys(config, [new]):
            warnings.warn(f"config override {dotted!r}: the key is {new!r} now", stacklevel=2)
            dotted = new
        node = config
        *parents, leaf = dotted.split(".")
        for i, part in enumerate(parents):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                raise KeyError(
                    f"config override {dotted!r}: "
                    + unknown_key_message(".".join(parents[: i + 1]))
                )
            node = node[part]
        if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
            raise KeyError(f"config override {dotted!r}: {unknown_key_message(dotted)}")
        if from_text and isinstance(value, str):
            try:
                value = convert_text(value, node[leaf])
            except (TypeError, ValueError) as e:
                raise ValueError(f"config override {dotted}={value!r}: {e}") from None
        node[leaf] = value


def load_module(path: str | os.PathLike, name: str) -> types.ModuleType:
    """Execute the Python file `path` as a module called `name` (configs, sweep files)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not pathlib.Path(path).is_file():
        raise FileNotFoundError(f"cannot load {path}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_config(spec: str) -> ml_collections.ConfigDict:
    """'configs/x.py:arg' -> x.get_config(arg), as `--config=` would load it."""
    path, _, arg = spec.partition(":")
    module = load_module(path, f"_tx_jax_config_{pathlib.Path(path).stem}")
    return module.get_config(arg or None) if arg else module.get_config()


def sibling_module(here: str, name: str) -> types.ModuleType:
    """configs/NAME.py next to `here` (a config's `__file__`), as a module (configs are no
    package)."""
    path = pathlib.Path(here).resolve().parent / f"{name}.py"
    return load_module(path, f"_tx_jax_config_{name}")


def sibling_config(here: str, name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of configs/NAME.py next to `here` (see `sibling_module`)."""
    return sibling_module(here, name).get_config(arg)


def repo_path(here: str, *parts: str) -> str:
    """An absolute path from the repository root of the config file `here` (configs/x.py),
    so that configs mean the same data whatever the working directory."""
    return str(pathlib.Path(here).resolve().parent.parent.joinpath(*parts).resolve())


def task_of(config: Any) -> str:
    """config.task: 'translation' (EncoderDecoder; also when the key is absent) or 'lm'."""
    return config.get("task", "translation") or "translation"


# ---------------------------------------------------------------------- study keys and renames


@dataclasses.dataclass(frozen=True)
class StudyKey:
    neutral: Any  # what a config without the key means: the run does without the study
    home: str  # a config that defines it, named when a config without it is given it


# Keys only a study's configs define (configs/default.py holds what every run needs): code reads
# an absent one as its neutral value through `study_value`, so the neutral values live here only.
STUDY_KEYS = {
    "data.lm_side": StudyKey("target", "configs/lm.py"),
    "data.directions": StudyKey("", "configs/multilingual.py"),
    "data.extra_eval_directions": StudyKey("", "configs/multilingual.py"),
    "data.mixture": StudyKey("uniform", "configs/multilingual.py"),
    "data.temperature": StudyKey(5.0, "configs/multilingual.py"),
    "data.max_train_pairs": StudyKey(0, "configs/multilingual.py"),
    "data.backtranslation": StudyKey([], "experiments/backtranslation.py"),
    "data.backtranslation_tag": StudyKey("<BT>", "experiments/backtranslation.py"),
}


def _same(value: Any) -> Any:
    return value


# Old key -> (new key, the old value as the new one's), for stored configs (`upgrade_stored`);
# an override of an old name renamed with its values (`_same`) sets the new key.
RENAMED_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "data.max_len": ("data.max_train_len", _same),  # not model.max_len, the table's size
    "data.synthetic_corpora": ("data.backtranslation", _same),
    "data.synthetic_tag": ("data.backtranslation_tag", _same),
    # a split to score at the end, '' for none: every config named data.test_split's
    "eval.test_split": ("eval.score_test", bool),
    "eval.alpha": ("eval.length_penalty", _same),  # alpha is LoRA's scale (train.lora.alpha)
}
# Keys that are gone -> the values that meant what the code now does; `upgrade_section` drops
# them (another value with a warning).
REMOVED_KEYS = {
    "model.residual_norm": ("auto", "xla"),
    "model.ffn_impl": ("auto", "xla"),
    # EncoderOnly's head, which no task built (an imported model's config stores every field)
    "model.num_classes": (0,),
    "model.pooling": ("first", "mean"),
}
# (key, old value) -> the value loaded in its place: values timed runs beat on a GPU, mapped to
# the one that beat them, and renamed values (BENCHMARKS.md, "Implementation choices").
REPLACED_VALUES = {
    ("model.attention_impl", "cudnn_native"): "cudnn",  # cuDNN's packed masks: slower than the bias
    ("model.attention_impl", "cudnn_jax"): "cudnn",  # renamed: jax.nn's cuDNN call is 'cudnn'
    ("model.attention_impl", "cudnn_broadcast"): "cudnn",  # never ran on a GPU
    ("model.attention_impl", "cudnn_nodbias"): "cudnn",  # never ran on a GPU
    ("model.dropout_bits", "rbg"): "bernoulli",  # XLA's RngBitGenerator: slower than Threefry
    ("model.dropout_bits", "hash"): "auto",  # never ran on a GPU or TPU
    ("model.loss_impl", "onepass"): "auto",  # never ran on a GPU or TPU
    ("model.loss_impl", "fused"): "auto",  # Pallas kernels that never ran on a GPU
}


def study_value(data: Any, name: str) -> Any:
    """config.data's study key `name` ('directions'; a ConfigDict or a stored dict), its
    neutral value (STUDY_KEYS) when the config does not define it."""
    return data.get(name, STUDY_KEYS[f"data.{name}"].neutral)


def with_study_defaults(config: Mapping) -> dict:
    """A plain-dict config with every absent study key at its neutral value: how a run that
    lacks one reads it, so that configs with and without it compare equal."""
    out = copy.deepcopy(dict(config))
    for dotted, key in STUDY_KEYS.items():
        section, name = dotted.split(".")
        if isinstance(out.get(section), Mapping) and name not in out[section]:
            out[section] = {**out[section], name: copy.deepcopy(key.neutral)}
    return out


def upgrade_section(name: str, section: Mapping) -> dict:
    """A copy of config section `name` ('model') with its REMOVED_KEYS dropped and
    REPLACED_VALUES replaced, warning for each that changes what loads (stacklevel 1, so a
    process says each once)."""
    out = dict(section)
    for dotted, kept in REMOVED_KEYS.items():
        where, key = dotted.split(".")
        if where == name and key in out and out.pop(key) not in kept:
            warnings.warn(
                f"{dotted} is no longer a key; loading the {kept[-1]!r} way", stacklevel=1
            )
    for key, value in out.items():
        new = REPLACED_VALUES.get((f"{name}.{key}", value)) if isinstance(value, str) else None
        if new is not None:
            warnings.warn(
                f"{name}.{key}={value!r} is no longer a choice; loading {name}.{key}={new!r}",
                stacklevel=1,
            )
            out[key] = new
    return out


def upgrade_stored(config: Mapping) -> dict:
    """A copy of a stored config (plain dict) with RENAMED_KEYS' old names read as the new
    (one warning) and each section upgraded (`upgrade_section`)."""
    out = copy.deepcopy(dict(config))
    for name, section in out.items():
        if isinstance(section, Mapping):
            out[name] = upgrade_section(name, section)
    renamed = []
    for old, (new, convert) in RENAMED_KEYS.items():
        (old_section, old_name), (new_section, new_name) = old.split("."), new.split(".")
        section = out.get(old_section)
        if not isinstance(section, Mapping) or old_name not in section:
            continue
        section = dict(section)
        value = section.pop(old_name)
        out[old_section] = section
        out.setdefault(new_section, {})
        if new_name not in out[new_section]:
            out[new_section] = {**out[new_section], new_name: convert(value)}
        renamed.append(f"{old} -> {new}")
    if renamed:
        warnings.warn(
            f"a config stored with old key names, read as the new: {', '.join(renamed)}",
            stacklevel=1,
        )
    return out


def new_name(dotted: str) -> str | None:
    """The key's name now if RENAMED_KEYS renamed it with its values unchanged, else None."""
    new, convert = RENAMED_KEYS.get(dotted, (None, None))
    return new if convert is _same else None


def unknown_key_message(dotted: str, where: str = "this config") -> str:
    """Why `dotted` is not a key of a config: renamed (RENAMED_KEYS), one a study's config
    defines (STUDY_KEYS), or neither."""
    out, key = f"{where} has no key {dotted!r}", dotted
    if dotted in RENAMED_KEYS:
        key = RENAMED_KEYS[dotted][0]
        out += f": it is {key!r} now"
    if key in STUDY_KEYS:
        out += f"; {STUDY_KEYS[key].home} defines " + ("it" if key == dotted else repr(key))
    return out


def missing_keys(config: ml_collections.ConfigDict, dotted_keys: Iterable[str]) -> list[str]:
    """The keys of `dotted_keys` that `config` lacks (a key under a plain dict value counts as
    present: such a dict is free-form)."""
    out = []
    for dotted in dotted_keys:
        node = config
        for part in dotted.split("."):
            if isinstance(node, dict) and not isinstance(node, ml_collections.ConfigDict):
                break
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                out.append(dotted)
                break
            node = node[part]
    return out
