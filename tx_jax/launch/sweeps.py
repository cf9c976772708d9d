"""A sweep file (experiments/*.py) and its points: loading, expansion, validation, commands.

The file defines `sweep() -> list[dict]` of dotted overrides, `CONFIG` (the base config) and
optionally `NAME` (default root runs/sweeps/NAME) and `BASE` (overrides under every point; a
point's own win and only they name it). Every key is checked against the base config first.
Values absl's config flags cannot parse go through a generated WORKDIR/sweep_config.py.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from tx_jax import paths
from tx_jax.config import apply_overrides, convert_text, load_config, load_module, parse_assignments

# Types that `--config.k=v` parses (absl config_flags); the rest go through sweep_config.py.
FLAG_TYPES = (bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    config: str  # 'configs/x.py:arg', the base config
    points: list[dict[str, Any]]  # dotted overrides, one dict per point
    base: dict[str, Any] = dataclasses.field(default_factory=dict)  # under every point


@dataclasses.dataclass(frozen=True)
class Point:
    index: int
    name: str  # 'model.num_heads=16,model.d_model=256' ('baseline' for no overrides)
    overrides: dict[str, Any]
    workdir: epath.Path  # local or gs://


def load_sweep(path: str | os.PathLike) -> Sweep:
    """An experiments/*.py file -> Sweep (its NAME, CONFIG, BASE and sweep())."""
    path = pathlib.Path(path)
    module = load_module(path, f"tx_jax_sweep_{path.stem}")
    for attr in ("CONFIG", "sweep"):
        if not hasattr(module, attr):
            raise ValueError(f"{path}: a sweep file defines {attr}")
    points = [dict(p) for p in module.sweep()]
    base = getattr(module, "BASE", {})
    if not isinstance(base, Mapping):
        raise ValueError(f"{path}: BASE is a dict of dotted overrides, not {type(base).__name__}")
    return Sweep(getattr(module, "NAME", path.stem), module.CONFIG, points, dict(base))


def point_name(overrides: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={_flag_value(v)}" for k, v in overrides.items()) or "baseline"


def _slug(name: str, limit: int = 80) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", name)[:limit].strip("_") or "point"


def expand(
    sweep: Sweep, root: str | os.PathLike, extra: Mapping[str, Any] | None = None
) -> list[Point]:
    """The sweep's points (each with `extra` overrides added), validated against the base
    config: an unknown key or a value of the wrong type raises ValueError naming both."""
    base = load_config(sweep.config)
    points = []
    for i, overrides in enumerate(sweep.points):
        name = point_name(overrides)
        full = {**sweep.base, **overrides, **(extra or {})}
        try:
            apply_overrides(copy.deepcopy(base), full)
        except (KeyError, TypeError, ValueError) as e:
            message = e.args[0] if e.args else e
            raise ValueError(f"sweep point {i} ({name}): {message}") from None
        workdir = paths.Path(root) / f"{i:02d}_{_slug(name)}"
        points.append(Point(i, name, full, workdir))
    return points


def select(points: list[Point], only: Sequence[int] | None) -> list[Point]:
    """The points whose index `only` names (all when None); an unknown index is a ValueError."""
    if only is None:
        return points
    unknown = sorted(set(only) - {p.index for p in points})
    if unknown:
        raise ValueError(f"--only: no points {unknown} (the sweep has {len(points)})")
    return [p for p in points if p.index in set(only)]


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """['a.b=3', 'c=/x y'] -> {'a.b': 3, 'c': '/x y'} (Python literals, else strings)."""
    return {k: convert_text(v, None) for k, v in parse_assignments(items, "--override").items()}


def jsonable(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples as lists, other objects as their str)."""
    return json.loads(json.dumps(value, default=str))


def _flag_value(value: Any) -> str:
    return repr(value) if isinstance(value, (list, tuple, dict)) else str(value)


def command(point: Point, config: str, python: str = sys.executable) -> tuple[list[str], str]:
    """(argv of one point, text of WORKDIR/sweep_config.py or '' when every value is a flag)."""
    flag_items = {k: v for k, v in point.overrides.items() if isinstance(v, FLAG_TYPES)}
    other = {k: v for k, v in point.overrides.items() if k not in flag_items}
    wrapper = ""
    if other:
        path, _, arg = config.partition(":")
        base = os.path.abspath(path) + (f":{arg}" if arg else "")
        wrapper = (
            '"""Written by a sweep: the base config plus overrides flags cannot carry."""\n'
            "from tx_jax.config import apply_overrides, load_config\n\n\n"
            "def get_config():\n"
            f"    config = load_config({base!r})\n"
            f"    apply_overrides(config, {other!r})\n"
            "    return config\n"
        )
        config = config_file(point)
    argv = [python, "-m", "tx_jax", "train", f"--config={config}", f"--workdir={point.workdir}"]
    return argv + [f"--config.{k}={_flag_value(v)}" for k, v in flag_items.items()], wrapper


def config_file(point: Point) -> str:
    """Where the point's generated config is loaded from: its workdir, or, for a gs:// one, a
    local copy (a config is Python, imported from a file); the workdir keeps a copy too."""
    if not paths.is_remote(point.workdir):
        return str(point.workdir / "sweep_config.py")
    key = hashlib.sha256(str(point.workdir).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "tx_jax_sweeps", key, "sweep_config.py")
