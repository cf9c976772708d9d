"""Config plumbing shared by configs/*.py: the `get_config(arg)` argument and overrides.

`--config=configs/multi30k.py:pair=en-fr,variant=small` hands "pair=en-fr,variant=small" to
`get_config`; `parse_arg` turns it into typed values, naming any unknown key.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import types
from collections.abc import Mapping, Sequence
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
            key, text = split_assignment(item)
        if key not in defaults:
            raise ValueError(
                f"unknown config argument {key!r}; valid arguments: {sorted(defaults)}"
            )
        try:
            values[key] = convert_text(text.strip(), defaults[key])
        except ValueError as e:
            raise ValueError(f"config argument {key}={text.strip()!r}: {e}") from None
    return ml_collections.ConfigDict(values)


def split_assignment(item: str, what: str = "config argument") -> tuple[str, str]:
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
    return dict(split_assignment(item.removeprefix(prefix), what) for item in items)


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Mapping[str, Any], *, from_text: bool = False
) -> None:
    """Set dotted keys ('model.d_model': 256) in place. With `from_text`, text values are
    converted to the type of the value they replace (`convert_text`). KeyError names an
    unknown key, ValueError a value that does not convert."""
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for i, part in enumerate(parents):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                raise KeyError(f"config override {dotted!r}: no key {'.'.join(parents[: i + 1])!r}")
            node = node[part]
        if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
            raise KeyError(f"config override {dotted!r}: no key {dotted!r}")
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
    """configs/NAME.py, the config file next to `here` (a config's `__file__`), as a module:
    configs build on each other without being a package."""
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
