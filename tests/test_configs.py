"""Every config file and variant builds, passes validation, and its model eval_shapes."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from tx_jax.config import (
    STUDY_KEYS,
    apply_overrides,
    parse_arg,
    study_value,
    upgrade_section,
    upgrade_stored,
)
from tx_jax.inference import restore
from tx_jax.model import TASKS
from tx_jax.model.config import ModelConfig
from tx_jax.model.transformer import DecoderOnly, EncoderDecoder, count_params
from tx_jax.runner import sizing
from tx_jax.runner.validation import validate_config

CONFIG_DIR = pathlib.Path(__file__).parent.parent / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.py"))
# The documented variants and arguments of each config (module docstrings, README).
DOCUMENTED = {
    "default": ["default"],
    "lm": ["default", "multi30k", "long", "variant=long,length=32768"],
    "multi30k": [
        "small",
        "base",
        "pair=fr-cs",
        "pair=de-en,variant=base",
        "pair=cs-en,debug",
        "reader=text",
    ],
    "text": ["default"],
    "wmt14_ende": ["base", "big", "direction=de-en", "variant=big,direction=de-en"],
    "multilingual": [
        "default",
        "directions=en-de+en-fr+en-cs,mixture=temperature,temperature=2",
        "directions=en-de+de-en,extra=de-fr+fr-de,debug",
    ],
}
# Configs built from another run (their arguments name it): tests/test_import_model.py.
FROM_A_RUN = {"finetune"}
CASES = [
    (p, arg)
    for p in CONFIGS
    if p.stem not in FROM_A_RUN
    for arg in (None, "debug", *DOCUMENTED.get(p.stem, []))
]


def load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path,arg", CASES, ids=[f"{p.stem}:{a}" for p, a in CASES])
def test_config_builds_and_model_eval_shapes(path, arg):
    config = load(path).get_config(arg)
    if sizing.unset_keys(config):  # sized from the data (tests/test_sizing.py): the rest checked
        config = sizing.with_placeholders(config)
    validate_config(config)
    task = restore.task_of(config)
    assert task in TASKS
    cfg = ModelConfig.of_run(config, "cpu")
    model = restore.make_model(cfg, task)
    assert isinstance(model, DecoderOnly if task == "lm" else EncoderDecoder)
    tokens = jnp.ones((2, 8), jnp.int32)
    inputs = (tokens,) if task == "lm" else (tokens, tokens)
    shapes = jax.eval_shape(model.init, jax.random.key(0), *inputs)
    assert count_params(shapes["params"]) > 0


def test_config_values():
    m30k = load(CONFIG_DIR / "multi30k.py")
    c = m30k.get_config("pair=fr-cs")
    assert (c.data.source_lang, c.data.target_lang, c.model.d_model) == ("fr", "cs", 256)
    assert (c.data.test_split, c.eval.test_beam_size, c.eval.length_penalty) == (
        "test_2016_flickr",
        4,
        0.6,
    )
    assert c.model.num_encoder_layers == c.model.num_decoder_layers == 3
    assert load(CONFIG_DIR / "multi30k.py").get_config("base").model.d_model == 512
    # manual_dir is absolute and names the shared data whatever the working directory.
    here = os.getcwd()
    try:
        os.chdir("/")
        assert m30k.get_config(None).data.manual_dir == c.data.manual_dir
    finally:
        os.chdir(here)
    assert pathlib.Path(c.data.manual_dir).is_absolute()
    assert c.data.manual_dir.endswith(os.path.join("shared", "data", "multi30k"))

    wmt = load(CONFIG_DIR / "wmt14_ende.py")
    base, big = wmt.get_config(None), wmt.get_config("big")
    assert (base.data.source_lang, base.data.target_lang) == ("en", "de")
    assert wmt.get_config("direction=de-en").data.source_lang == "de"
    assert (base.data.vocab_size, base.train.warmup_steps, base.train.lr_scale) == (37000, 4000, 1)
    assert (base.train.beta2, base.train.eps, base.train.label_smoothing) == (0.98, 1e-9, 0.1)
    assert (base.model.dropout_rate, big.model.dropout_rate) == (0.1, 0.3)
    assert (base.train.num_steps, big.train.num_steps) == (100_000, 300_000)
    assert (base.eval.average_last, big.eval.average_last) == (5, 20)
    assert big.checkpoint.keep >= big.eval.average_last
    assert (base.model.dtype, base.parallel.strategy, base.data.download) == (
        "bfloat16",
        "mesh",
        True,
    )
    # ~25k real tokens per side: the padded budget of packed rows (~96% real).
    assert 25_000 <= 0.96 * base.data.tokens_per_batch <= 26_000

    lm = load(CONFIG_DIR / "lm.py")
    c = lm.get_config("multi30k")
    assert (c.task, c.data.lm_side, c.data.source_lang) == ("lm", "source", "en")
    assert (lm.get_config(None).model.positional, lm.get_config(None).model.norm_position) == (
        "rope",
        "pre",
    )
    assert load(CONFIG_DIR / "default.py").get_config(None).task == "translation"


@pytest.mark.parametrize(
    "stem,arg,match",
    [
        ("multi30k", "pair=en-en", r"pair='en-en'.*two different languages of en, de, fr, cs"),
        ("multi30k", "pair=en-xx", r"pair='en-xx'"),
        ("multi30k", "pair=ende", r"pair='ende'"),
        ("multi30k", "huge", r"unknown variant 'huge' \(small, base, debug\)"),
        ("multi30k", "lang=en", r"unknown config argument 'lang'"),
        ("wmt14_ende", "direction=en-fr", r"direction='en-fr'; expected one of en-de, de-en"),
        ("wmt14_ende", "variant=huge", r"unknown variant 'huge' \(base, big, debug\)"),
        ("wmt14_ende", "pair=en-de", r"unknown config argument 'pair'"),
        ("lm", "huge", r"unknown variant 'huge' \(default, multi30k, debug, long\)"),
        ("multilingual", "huge", r"unknown variant 'huge' \(default, debug\)"),
        ("multilingual", "directions=en-xx", r"en-xx is not a pair of en, de, fr, cs"),
        ("multilingual", "directions=en-de,de-en", r"variant 'de-en' .*join directions with '\+'"),
        ("multilingual", "directions=en-en", r"'en-en' is not SRC-TGT with two different"),
        ("multilingual", "mixture=zipf", r"mixture='zipf' \(uniform, temperature\)"),
        ("multilingual", "extra=de", r"extra='de'"),
        ("finetune", None, r"needs the model to start from: .*finetune.py:init_from=WORKDIR"),
        ("finetune", "debug", r"needs the model to start from"),
        ("finetune", "init_from=/nonexistent/run", r"/nonexistent/run"),
    ],
)
def test_config_argument_errors(stem, arg, match):
    with pytest.raises(ValueError, match=match):
        load(CONFIG_DIR / f"{stem}.py").get_config(arg)


def test_lm_config_validation_errors():
    config = load(CONFIG_DIR / "lm.py").get_config("debug")
    config.checkpoint.best_metric = "bleu"
    with pytest.raises(ValueError, match="checkpoint.best_metric='bleu': a language model"):
        validate_config(config)
    config = load(CONFIG_DIR / "lm.py").get_config("debug")
    config.data.lm_side = "middle"
    with pytest.raises(ValueError, match="data.lm_side='middle'"):
        validate_config(config)
    config.task = "classification"
    with pytest.raises(ValueError, match="task='classification'"):
        validate_config(config)


def test_parse_arg_types_and_errors():
    args = parse_arg(
        "pair=en-fr,steps=10,lr=0.5,big=true", pair="en-de", steps=1, lr=1.0, big=False
    )
    assert (args.pair, args.steps, args.lr, args.big) == ("en-fr", 10, 0.5, True)
    assert parse_arg("debug", variant="default").variant == "debug"
    with pytest.raises(ValueError, match="unknown config argument 'pear'"):
        parse_arg("pear=en-fr", pair="en-de")
    with pytest.raises(ValueError, match="unknown variant 'huge'"):
        load(CONFIG_DIR / "default.py").get_config("huge")


def test_apply_overrides():
    config = load(CONFIG_DIR / "default.py").get_config(None)
    apply_overrides(config, {"model.d_model": 64, "seed": 3})
    assert (config.model.d_model, config.seed) == (64, 3)
    with pytest.raises(KeyError, match="model.d_modle"):
        apply_overrides(config, {"model.d_modle": 1})


def test_study_keys_live_in_their_study_s_config():
    """configs/default.py holds what every run needs: a study's key is defined by the config
    STUDY_KEYS names (the back-translation study's: tests/test_backtranslation_study.py), and
    a config without it reads its neutral value."""
    default = load(CONFIG_DIR / "default.py").get_config(None)
    for dotted, key in STUDY_KEYS.items():
        section, name = dotted.split(".")
        assert name not in default[section], dotted
        assert study_value(default[section], name) == key.neutral, dotted
        if key.home.startswith("configs/"):
            assert name in load(CONFIG_DIR.parent / key.home).get_config(None)[section], dotted
    assert study_value({"directions": "en-de"}, "directions") == "en-de"


def test_an_override_of_an_old_name_sets_the_new_key_with_a_warning():
    default = load(CONFIG_DIR / "default.py").get_config(None)
    with pytest.warns(UserWarning, match="'eval.alpha': the key is 'eval.length_penalty' now"):
        apply_overrides(default, {"eval.alpha": "0.8", "eval.beam_size": "2"}, from_text=True)
    assert (default.eval.length_penalty, default.eval.beam_size) == (0.8, 2)
    assert "alpha" not in default.eval and default.train.lora.alpha == 32.0  # LoRA's, apart


def test_a_moved_or_renamed_key_is_refused_naming_where_it_is():
    default = load(CONFIG_DIR / "default.py").get_config(None)
    with pytest.raises(KeyError, match=r"no key 'data.lm_side'; configs/lm.py defines it"):
        apply_overrides(default, {"data.lm_side": "both"})
    renamed = r"no key 'data.synthetic_corpora': it is 'data.backtranslation' now; "
    with pytest.raises(KeyError, match=renamed + "experiments/backtranslation.py defines"):
        apply_overrides(default, {"data.synthetic_corpora": "[]"}, from_text=True)
    multilingual = load(CONFIG_DIR / "multilingual.py").get_config("debug")
    overrides = {"data.directions": "en-de,fr-en", "data.temperature": "2"}
    apply_overrides(multilingual, overrides, from_text=True)
    apply_overrides(multilingual, {"data.max_train_pairs": "en-de=30"})
    data = multilingual.data
    assert (data.directions, data.temperature, data.max_train_pairs) == (
        "en-de,fr-en",
        2.0,
        "en-de=30",
    )


def test_a_stored_config_reads_through_the_one_table_of_renames():
    """A stored config's renamed keys, removed keys and replaced values all come from
    tx_jax/config.py's tables, each said in a warning; the model section reads the same way
    whether it came from a stored config (upgrade_stored) or a config file (from_config)."""
    stored = {
        "data": {"max_len": 32},
        "model": {"attention_impl": "cudnn_jax", "ffn_impl": "pallas", "d_model": 64},
        "eval": {"beam_size": 4},
    }
    with pytest.warns(UserWarning) as caught:
        out = upgrade_stored(stored)
    assert out == {
        "data": {"max_train_len": 32},
        "model": {"attention_impl": "cudnn", "d_model": 64},
        "eval": {"beam_size": 4},
    }
    assert stored["model"]["attention_impl"] == "cudnn_jax"  # the stored dict is not changed
    said = " | ".join(str(w.message) for w in caught)
    assert "data.max_len -> data.max_train_len" in said
    assert "model.ffn_impl is no longer a key; loading the 'xla' way" in said
    assert "model.attention_impl='cudnn_jax' is no longer a choice" in said
    with pytest.warns(UserWarning, match="model.attention_impl='cudnn_jax'"):
        from_file = ModelConfig.from_config(stored["model"], num_heads=4)
    assert from_file == ModelConfig.from_config(out["model"], num_heads=4)
    assert from_file.attention_impl == "cudnn"
    assert upgrade_section("model", {"d_model": 64}) == {"d_model": 64}  # nothing to say


def test_the_command_line_names_the_config_that_has_a_moved_key(tmp_path):
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "tx_jax.main",
            "--config=configs/default.py:debug",
            f"--workdir={tmp_path / 'run'}",
            "--config.data.directions=en-de,de-en",
        ],
        capture_output=True,
        text=True,
        cwd=CONFIG_DIR.parent,
        timeout=300,
    )
    assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr
    assert cli.stderr.strip().splitlines()[-1] == (
        "error: configs/default.py has no key 'data.directions'; configs/multilingual.py defines it"
    )
    assert not (tmp_path / "run").exists()
