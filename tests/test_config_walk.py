"""The static walk of `config` from train_and_evaluate (benchmarks/config_walk.py): how often
the config climbs back up the layers, and that the sizing step is the only place that asks
which keys the data must choose."""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import config_walk  # noqa: E402

# The walk's climbs with the sizing step before the run (docs/design.md gives the walk); a
# change that makes the config travel back up more often has to say why here.
MAX_CLIMBS = 10
# Who may ask which keys a config leaves to the data: the sizing step, and the check that
# refuses a config with such keys (validate_config, before anything compiles).
ASKERS = {
    ("tx_jax/runner/setup.py", "size_from_data"),
    ("tx_jax/runner/validation.py", "validate_config"),
}
ASKING = {"begin", "unset_keys", "with_placeholders"}


def test_the_walk_starts_at_train_and_evaluate_and_sizes_before_building():
    walk = config_walk.config_walk()
    names = [f"{s.file}:{s.function}" for s in walk]
    assert names[0] == "tx_jax/runner/loop.py:train_and_evaluate"
    assert names[1] == "tx_jax/runner/setup.py:size_from_data"
    sizing_done = names.index("tx_jax/runner/sizing.py:size_run")
    assert sizing_done < names.index("tx_jax/runner/setup.py:build_run")
    assert "tx_jax/runner/setup.py:build_model" in names  # build_run(sized) is followed


def test_the_walk_climbs_back_up_at_most_the_bound():
    walk = config_walk.config_walk()
    counts = config_walk.counts(walk)
    assert counts["stays"] == len(set(walk)) > 50
    assert counts["climbs"] <= MAX_CLIMBS, "\n".join(
        f"{a.file}:{a.function} ({a.layer}) -> {b.file}:{b.function} ({b.layer})"
        for a, b in config_walk.climbs(walk)
    )


def test_only_the_sizing_step_asks_which_keys_are_unset():
    found = set()
    for path in sorted((ROOT / "tx_jax").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "tx_jax/runner/sizing.py":
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "sizing"
                    and node.func.attr in ASKING
                ):
                    found.add((rel, fn.name))
    assert found == ASKERS


def test_a_climb_is_a_step_into_a_higher_layer():
    stays = [
        config_walk.Stay("tx_jax.runner.setup", "a"),
        config_walk.Stay("tx_jax.data.tasks", "b"),
        config_walk.Stay("tx_jax.config", "c"),
        config_walk.Stay("tx_jax.model.config", "d"),
        config_walk.Stay("tx_jax.runner.sizing", "e"),
        config_walk.Stay("tx_jax.runner.loop", "f"),
    ]
    assert [(a.function, b.function) for a, b in config_walk.climbs(stays)] == [
        ("c", "d"),
        ("d", "e"),
    ]
    assert config_walk.counts(stays) == {"stays": 6, "files": 6, "climbs": 2}


def test_a_name_bound_from_the_config_is_the_config():
    names = config_walk.Names({"config"})
    names.holders = {"run"}
    expr = lambda text: ast.parse(text, mode="eval").body  # noqa: E731
    assert config_walk.is_config(expr("config.train.get('x')"), names)
    assert config_walk.is_config(expr("run.config"), names)
    assert config_walk.is_config(expr("run"), names)  # passed whole, config and all
    assert not config_walk.is_config(expr("run.strategy"), names)
    assert not config_walk.is_config(expr("len(config)"), names)
