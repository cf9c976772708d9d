"""Resuming a workdir under a changed config: resumable changes are listed, the others (the
vocabulary, the train state's shapes) refused in one line naming each key, on the library
and the command line, with the workdir's checkpoints untouched."""

import functools
import json
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, tiny_config, train_losses

from tx_jax import paths
from tx_jax.config import upgrade_stored
from tx_jax.data.tokenizer import Tokenizer
from tx_jax.inference import restore
from tx_jax.inference.locate import CheckpointError
from tx_jax.runner import resume
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.setup import state_shapes
from tx_jax.training.checkpoint import Checkpointer

STEPS = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tfds_dir):
    """A workdir trained for 2 steps (debug model: d_ff 64), checkpoint at step 2. Tests that
    resume it for real copy it first."""
    workdir = tmp_path_factory.mktemp("resume") / "run"
    train_and_evaluate(tiny_config(tfds_dir, **{"train.num_steps": STEPS}), workdir)
    return workdir


def _check(config, workdir):
    """resume.check_config as restore_or_init calls it, without preparing the data."""
    state_of = functools.partial(
        state_shapes,
        tokenizer=Tokenizer.load(workdir / "tokenizer.model"),
        platform="cpu",
    )
    ckpt = Checkpointer(workdir / "checkpoints", read_only=True)
    resume.check_config(config, ckpt, state_of(config), state_of)
    return ckpt


def _refusal(tfds_dir, workdir, **overrides) -> str:
    with pytest.raises(CheckpointError) as info:
        train_and_evaluate(tiny_config(tfds_dir, **overrides), workdir)
    return str(info.value)


def test_a_shape_change_is_refused_naming_the_key_and_leaves_the_checkpoints(
    trained, tfds_dir, capsys
):
    config_json = (trained / "config.json").read_text()
    message = _refusal(tfds_dir, trained, **{"model.d_ff": 128, "train.num_steps": 4})
    assert f"cannot resume {trained}/checkpoints/2 under this config: " in message
    assert "model.d_ff (64 in the checkpoint, 128 now) changes the train state's shapes" in message
    assert "train.num_steps" not in message  # resumable: not a cause
    assert "of its arrays differ, e.g. ['params']" in message
    assert "(64,) in the checkpoint, (128,) in the model" in message
    assert "resume with the stored values, or use a new workdir" in message
    assert "train.init_from" not in message  # the parameters would not fit either
    assert "\n" not in message and "Traceback" not in "".join(capsys.readouterr())
    # refused before anything was written: same checkpoints, still loadable, same config.json
    assert Checkpointer(trained / "checkpoints", read_only=True).all_steps() == [STEPS]
    loaded = restore.load(trained)
    assert loaded.step == STEPS and loaded.model_config.d_ff == 64
    assert (trained / "config.json").read_text() == config_json
    # two causes: both named, each with its values
    message = _refusal(tfds_dir, trained, **{"model.d_ff": 128, "model.num_encoder_layers": 2})
    assert (
        "model.d_ff (64 in the checkpoint, 128 now), model.num_encoder_layers (1 in the "
        "checkpoint, 2 now) change the train state's shapes"
    ) in message


def test_an_optimizer_structure_change_is_refused_with_init_from_advice(trained, tfds_dir):
    message = _refusal(tfds_dir, trained, **{"train.weight_decay": 0.01})
    assert (
        "train.weight_decay (0.0 in the checkpoint, 0.01 now) changes the train state's" in message
    )
    assert "['opt_state']" in message  # AdamW's decay moves the schedule's count
    assert f"with train.init_from={trained} to start from this run's parameters" in message
    message = _refusal(tfds_dir, trained, **{"train.clip_grad_norm": 0.0})  # Adam unchained
    assert (
        "train.clip_grad_norm (1.0 in the checkpoint, 0.0 now) changes the train state" in message
    )


def test_a_vocabulary_change_is_refused_naming_each_key(trained, tfds_dir):
    overrides = {"data.vocab_size": 200, "data.tokenizer_pairs": 300}
    message = _refusal(tfds_dir, trained, **overrides)
    assert (
        "data.tokenizer_pairs (400 in the checkpoint, 300 now), data.vocab_size (160 in the "
        f"checkpoint, 200 now) decide the vocabulary, which a resumed run keeps "
        f"({trained}/tokenizer.model)"
    ) in message
    assert "shapes" not in message and "train.init_from" not in message


def test_changes_that_keep_the_state_pass_the_check(trained, tfds_dir):
    """Dropout, the schedule and the data paths change neither the vocabulary nor a shape."""
    config = tiny_config(
        tfds_dir,
        **{
            "model.dropout_rate": 0.1,
            "train.schedule": "cosine",
            "data.max_train_len": 24,
            "checkpoint.keep": 5,
            "train.num_steps": STEPS,
        },
    )
    stored = resume.newest_readable(_check(config, trained))  # no error
    assert list(resume.differences(stored.config, config)) == [
        "checkpoint.keep",
        "data.max_train_len",
        "model.dropout_rate",
        "train.schedule",
    ]


def test_an_unreadable_meta_is_left_to_restore_latest(trained, tfds_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    for meta in (copy / "checkpoints" / str(STEPS) / "meta").rglob("*"):
        if meta.is_file():
            meta.write_text("{not json")
    _check(tiny_config(tfds_dir, **{"model.d_ff": 128}), copy)  # not compared: no error
    assert resume.newest_readable(Checkpointer(copy / "checkpoints", read_only=True)) is None


def test_resumable_changes_are_listed_and_the_run_continues(trained, tfds_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    capsys.readouterr()
    train_and_evaluate(tiny_config(tfds_dir, **{"train.num_steps": 4, "eval.every": 500}), copy)
    out = capsys.readouterr().out
    line = (
        "resuming from step 2 with config changes: eval.every 1000 -> 500, train.num_steps 2 -> 4"
    )
    assert out.count(line + "\n") == 1
    assert max(train_losses(copy)) == 4
    assert Checkpointer(copy / "checkpoints", read_only=True).all_steps()[-1] == 4
    assert json.loads((copy / "config.json").read_text())["train"]["num_steps"] == 4


def test_the_command_line_says_a_refusal_in_one_line(trained, tfds_dir):
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "tx_jax.main",
            "--config=configs/default.py:debug",
            f"--workdir={trained}",
            f"--config.data.data_dir={tfds_dir}",
            "--config.model.d_ff=128",
            "--config.eval.alpha=0.6",  # the length penalty's old name: read as the new
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert cli.returncode == 1, cli.stderr
    errors = [line for line in cli.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in cli.stderr, cli.stderr
    assert errors[0].startswith(f"error: cannot resume {trained}/checkpoints/2 under this config")
    assert "model.d_ff (64 in the checkpoint, 128 now)" in errors[0]
    warnings = [line for line in cli.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: --config.eval.alpha is --config.eval.length_penalty now"]
    print(errors[0])


def test_data_tokenizer_decides_the_vocabulary_and_an_old_config_reads_as_its_defaults(
    trained, tfds_dir
):
    """A checkpoint's config from before data.tokenizer existed compares as the options its
    tokenizer was trained with: no change under the defaults, a refused one otherwise."""
    stored = json.loads((trained / "config.json").read_text())
    old = json.loads(json.dumps(stored))
    del old["data"]["tokenizer"]
    same = {"train.num_steps": STEPS}
    assert resume.differences(old, tiny_config(tfds_dir, **same)) == {}
    changed = tiny_config(tfds_dir, **same, **{"data.tokenizer.byte_fallback": True})
    assert resume.differences(old, changed) == {"data.tokenizer.byte_fallback": (False, True)}
    assert resume._under("data.tokenizer.byte_fallback", resume.VOCABULARY_KEYS)
    new = tiny_config(tfds_dir, **same)
    del new["data"]["tokenizer"]  # a config that has none, against one that has the defaults
    assert resume.differences(stored, new) == {}
    message = _refusal(tfds_dir, trained, **{"data.tokenizer.model_type": "bpe"})
    assert (
        "data.tokenizer.model_type ('unigram' in the checkpoint, 'bpe' now) decides the "
        "vocabulary, which a resumed run keeps"
    ) in message


# Key names a stored config may hold from before they were renamed (config.RENAMED_KEYS), new
# name -> old; and the study keys configs/default.py held then, at its values.
OLD_NAMES = {
    "data.max_train_len": "data.max_len",
    "data.backtranslation": "data.synthetic_corpora",
    "data.backtranslation_tag": "data.synthetic_tag",
    "eval.score_test": "eval.test_split",
    "eval.length_penalty": "eval.alpha",
}
OLD_DEFAULTS = {
    "directions": "",
    "extra_eval_directions": "",
    "mixture": "uniform",
    "temperature": 5.0,
    "lm_side": "target",
    "max_train_pairs": 0,
    "backtranslation": [],
    "backtranslation_tag": "<BT>",
}


def _with_old_names(config: dict) -> dict:
    """A config as saved (a dict) as a run of before the renames would have saved it."""
    old = json.loads(json.dumps(config))
    old["data"].update(OLD_DEFAULTS)
    for new, was in OLD_NAMES.items():
        (section, name), (_, old_name) = new.split("."), was.split(".")
        value = old[section].pop(name)
        if new == "eval.score_test":  # then the split's name, '' for none
            value = old["data"]["test_split"] if value else ""
        old[section][old_name] = value
    return old


def _store_config(workdir, config: dict) -> None:
    """Write `config` into WORKDIR/config.json and every checkpoint's meta (checksums kept
    valid), as a run stored with it holds it."""
    (workdir / "config.json").write_text(json.dumps(config))
    for meta in (workdir / "checkpoints").glob("*/meta/metadata"):
        stored = json.loads(meta.read_text())
        meta.write_text(json.dumps({**stored, "config": config}))
        step_dir = meta.parent.parent
        sums = json.loads((step_dir / "checksums.json").read_text())
        sums["meta/metadata"] = paths.sha256(meta, meta.stat().st_size)
        (step_dir / "checksums.json").write_text(json.dumps(sums))


def test_a_config_stored_with_old_key_names_loads_under_the_new(trained, tfds_dir, tmp_path):
    """A run stored under old key names (config.json, the checkpoints' meta) reads under
    today's, with its values, in one warning; it resumes under today's config, whose default
    lacks the study keys it held, as no change."""
    stored = json.loads((trained / "config.json").read_text())
    old = _with_old_names(stored)
    # model fields since removed, at the value every config held: dropped without a word
    removed = {"residual_norm": "auto", "ffn_impl": "auto", "num_classes": 0, "pooling": "mean"}
    old["model"] = {**old["model"], **removed}
    renamed = ", ".join(f"{was} -> {new}" for new, was in OLD_NAMES.items())
    with pytest.warns(UserWarning, match=f"old key names, read as the new: {renamed}"):
        upgraded = upgrade_stored(old)
    for new, was in OLD_NAMES.items():  # the stored values, under the new names only
        (section, name), (_, old_name) = new.split("."), was.split(".")
        assert old_name in old[section] and old_name not in upgraded[section], was
        assert upgraded[section][name] == stored[section].get(name, OLD_DEFAULTS.get(name)), new
    assert upgraded["data"]["backtranslation_tag"] == "<BT>"
    assert not set(removed) & set(upgraded["model"])
    pallas = {**old, "model": {**old["model"], "ffn_impl": "pallas"}}
    with pytest.warns(UserWarning, match="model.ffn_impl is no longer a key"):
        assert "ffn_impl" not in upgrade_stored(pallas)["model"]
    assert (old["eval"]["test_split"], upgraded["eval"]["score_test"]) == ("", False)
    scored = {**old, "eval": {**old["eval"], "test_split": "test_2016_flickr"}}
    with pytest.warns(UserWarning, match="eval.test_split -> eval.score_test"):
        assert upgrade_stored(scored)["eval"]["score_test"] is True
    assert resume.differences(old, tiny_config(tfds_dir, **{"train.num_steps": STEPS})) == {}

    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    _store_config(copy, old)
    with pytest.warns(UserWarning, match="old key names"):
        loaded = restore.stored_config(copy)
    assert loaded.data.backtranslation_tag == "<BT>" and "synthetic_tag" not in loaded.data
    train_and_evaluate(tiny_config(tfds_dir, **{"train.num_steps": 2 * STEPS}), copy)
    assert max(train_losses(copy)) == 2 * STEPS  # resumed: the stored run went on
    assert "synthetic_tag" not in json.loads((copy / "config.json").read_text())["data"]
