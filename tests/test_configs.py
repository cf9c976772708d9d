"""Every config file and variant builds, and its model eval_shapes."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest

from tx_jax import models
from tx_jax.config_utils import apply_overrides, parse_arg

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.py"))
CASES = [(p, arg) for p in CONFIGS for arg in (None, "debug")]


def load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path,arg", CASES, ids=[f"{p.stem}:{a}" for p, a in CASES])
def test_config_builds_and_model_eval_shapes(path, arg):
    config = load(path).get_config(arg)
    cfg = models.ModelConfig.from_config(config.model)
    model = models.EncoderDecoder(cfg)
    tokens = jnp.ones((2, 8), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens, tokens)
    assert models.count_params(shapes["params"]) > 0


def test_parse_arg_types_and_errors():
    args = parse_arg(
        "pair=en-fr,steps=10,lr=0.5,big=true", pair="en-de", steps=1, lr=1.0, big=False
    )
    assert (args.pair, args.steps, args.lr, args.big) == ("en-fr", 10, 0.5, True)
    assert parse_arg("debug", variant="default").variant == "debug"
    with pytest.raises(ValueError, match="unknown config argument 'pear'"):
        parse_arg("pear=en-fr", pair="en-de")
    with pytest.raises(ValueError, match="unknown variant 'huge'"):
        load(CONFIGS[0]).get_config("huge")


def test_apply_overrides():
    config = load(CONFIGS[0]).get_config(None)
    apply_overrides(config, {"model.d_model": 64, "seed": 3})
    assert (config.model.d_model, config.seed) == (64, 3)
    with pytest.raises(KeyError, match="model.d_modle"):
        apply_overrides(config, {"model.d_modle": 1})
