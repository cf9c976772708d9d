"""Config plumbing shared by configs/*.py: the `get_config(arg)` argument and overrides.

`--config=configs/multi30k.py:pair=en-fr,variant=small` hands "pair=en-fr,variant=small" to
`get_config`; `parse_arg` turns it into typed values, naming any unknown key.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
from collections.abc import Mapping
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
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            if "variant" not in defaults:
                raise ValueError(f"config argument {item!r} is not key=value")
            key, text = "variant", item
        if key not in defaults:
            raise ValueError(
                f"unknown config argument {key!r}; valid arguments: {sorted(defaults)}"
            )
        try:
            values[key] = convert_text(text.strip(), defaults[key])
        except ValueError as e:
            raise ValueError(f"config argument {key}={text.strip()!r}: {e}") from None
    return ml_collections.ConfigDict(values)


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> None:
    """Set dotted keys ('model.d_model': 256) in place; an unknown key is an error naming it."""
    for dotted, value in overrides.items():
        node = config
        *parents, leaf = dotted.split(".")
        for i, part in enumerate(parents):
            if part not in node:
                raise KeyError(f"config override {dotted!r}: no key {'.'.join(parents[: i + 1])!r}")
            node = node[part]
        if leaf not in node:
            raise KeyError(f"config override {dotted!r}: no key {dotted!r}")
        node[leaf] = value


def sibling_config(here: str, name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of configs/NAME.py, the config file next to `here` (a config's
    `__file__`): configs build on configs/default.py without being a package."""
    path = pathlib.Path(here).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_tx_jax_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def repo_path(here: str, *parts: str) -> str:
    """An absolute path from the repository root of the config file `here` (configs/x.py),
    so that configs mean the same data whatever the working directory."""
    return str(pathlib.Path(here).resolve().parent.parent.joinpath(*parts).resolve())


def task_of(config: Any) -> str:
    """config.task: 'translation' (EncoderDecoder; also when the key is absent) or 'lm'."""
    return config.get("task", "translation") or "translation"
