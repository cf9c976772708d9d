"""Defaults sized by the corpus (tx_jax/runner/sizing.py, configs/text.py): each size class
gets its model at config time without training; lengths, steps and the vocabulary follow the
data; every value the user sets wins; a run records what it chose, and a resumed run keeps it;
the printed counts of what data.max_train_len drops and data.max_eval_len truncates."""

from __future__ import annotations

import json

import numpy as np
import pytest
from etils import epath
from forked import run_modules
from helpers import ROOT
from test_data_text import write, write_prefix

from tx_jax.config import apply_overrides, load_config
from tx_jax.data import lengths as lengths_lib
from tx_jax.runner import setup, sizing
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.setup import size_from_data
from tx_jax.runner.validation import validate_config


def corpus_lengths(total: int, seed: int = 0, sample: int = 5_000) -> lengths_lib.Lengths:
    """A sample of sentence lengths standing for `total` pairs: 1..60 ids, 1% at 80."""
    rng = np.random.default_rng(seed)
    source = rng.integers(5, 40, size=sample)
    target = source + rng.integers(-3, 4, size=sample)
    target[: sample // 100] = 80  # the long tail the 99th percentile leaves out
    return lengths_lib.Lengths(source, np.maximum(target, 2), total)


def evaluation_lengths(longest: int) -> dict[str, lengths_lib.Lengths]:
    source = np.array([10, 20, longest])
    return {"validation": lengths_lib.Lengths(source, source + 1, 3)}


def sized(total: int, **overrides) -> tuple:
    config = load_config("configs/text.py")
    apply_overrides(config, overrides)
    unset = sizing.unset_keys(config)
    if config.data.vocab_size is None:  # before the tokenizer, as setup.prepare_data does
        config.data.vocab_size = sizing.size_class(total).vocab_size
    train = corpus_lengths(total)
    choices = sizing.size_run(config, unset, train, evaluation_lengths(70), platform="tpu")
    return config, choices, train


@pytest.mark.parametrize(
    "total, name, d_model, layers, vocab, dropout",
    [
        (2_000, "small", 256, 3, 8_000, 0.3),
        (29_000, "small", 256, 3, 8_000, 0.3),
        (160_000, "medium", 512, 6, 10_000, 0.3),
        (4_500_000, "base", 512, 6, 32_000, 0.1),
        (36_000_000, "big", 1024, 6, 32_000, 0.1),
    ],
)
def test_each_size_class_gets_its_model_at_config_time(
    total, name, d_model, layers, vocab, dropout
):
    config, choices, train = sized(total)
    assert sizing.size_class(total).name == name
    m = config.model
    assert (m.d_model, m.num_encoder_layers, m.num_decoder_layers) == (d_model, layers, layers)
    assert (config.data.vocab_size, m.dropout_rate) == (vocab, dropout)
    assert m.dtype == "bfloat16"  # on a TPU
    assert sizing.unset_keys(config) == []
    validate_config(config)  # a complete, valid config
    # lengths: the 99th percentile of the longer side, rounded up to 8 (at least 64 for packed
    # rows); evaluation: the longest
    assert sizing.round_up(train.percentile(99), 8) == 48
    assert config.data.max_train_len == 64 and config.data.bucket_boundaries == [64]
    assert config.data.max_eval_len == 72
    # steps: the class's epochs of the packed train split, within the bounds
    cls = sizing.size_class(total)
    rows = config.data.tokens_per_batch // 64
    per_batch = sizing.packed_pairs_per_batch(train.source, train.target, 64, rows)
    steps = sizing.clamp(sizing.round_up(cls.epochs * total / per_batch, 100), sizing.STEPS_RANGE)
    assert config.train.num_steps == steps
    assert config.train.cooldown_steps == round(0.2 * steps)
    assert config.train.warmup_steps == max(1, min(cls.warmup_steps, steps // 4))
    assert f"{total:,} train pairs, 99th percentile {train.percentile(99)} ids -> {name} model" in (
        choices.line
    )
    assert f"{steps:,} steps" in choices.line and "bfloat16 (tpu)" in choices.line
    assert choices.values["model.d_model"] == d_model


def test_the_rule_at_the_small_end_is_the_measured_recipe():
    """29,000 Multi30k-like pairs of ~238 a batch: configs/multi30k.py's 9,000 updates."""
    small = sizing.size_class(29_000)
    per_batch = 238
    assert sizing.round_up(small.epochs * 29_000 / per_batch, 100) == 9_200
    multi30k = load_config("configs/multi30k.py")
    for key, value in small.model.items():
        assert multi30k.model[key] == value, key
    assert (multi30k.data.vocab_size, multi30k.train.warmup_steps) == (8_000, 1_000)


def test_values_the_user_sets_win_and_are_named():
    config, choices, _ = sized(29_000, **{"model.d_model": 512, "data.max_train_len": 48})
    assert (config.model.d_model, config.data.max_train_len) == (512, 48)
    assert config.model.num_heads == 4  # the rest from the class
    assert "model.d_model" not in choices.values and "data.max_train_len" not in choices.values
    assert "set in the config, kept: model.d_model, data.max_train_len" in choices.line
    assert config.data.bucket_boundaries == [48]
    # unpacked batches: the percentile itself, and geometric buckets up to it
    config, _, _ = sized(29_000, **{"data.packing": False})
    assert config.data.max_train_len == 48 and config.data.bucket_boundaries[-1] == 48


def test_packing_simulation_counts_pairs_per_batch():
    # pairs of 10 + 10 ids in rows of 32: 3 a row; 4 rows a batch -> 12 a batch
    s = np.full(120, 10)
    assert sizing.packed_pairs_per_batch(s, s, 32, 4) == pytest.approx(12.0)
    # pairs over max_train_len are dropped as the pipeline drops them
    long = np.concatenate([s, np.full(10, 40)])
    assert sizing.packed_pairs_per_batch(long, long, 32, 4) == pytest.approx(12.0)


def test_counts_of_what_max_train_len_drops_and_max_eval_len_truncates():
    train = lengths_lib.Lengths(np.array([5, 9, 30, 12]), np.array([6, 8, 10, 40]), 4)
    assert train.dropped(16) == (2, 0.5)
    assert lengths_lib.describe_train(train, 16) == (
        "train: data.max_train_len=16 drops 2 of 4 pairs (50.00%)"
    )
    estimated = lengths_lib.Lengths(train.source, train.target, 4_000)
    assert estimated.dropped(16) == (2_000, 0.5)
    assert "drops ~2,000 of 4,000 pairs (50.00%, estimated from 4 sampled)" in (
        lengths_lib.describe_train(estimated, 16)
    )
    evals = {
        "validation": lengths_lib.Lengths(np.array([3, 20]), np.array([3, 3]), 2),
        "test": lengths_lib.Lengths(np.array([3, 4, 5]), np.array([3, 3, 3]), 3),
    }
    assert lengths_lib.describe_eval(evals, 16) == (
        "evaluation: data.max_eval_len=16 truncates 1 of 2 validation sources (50.00%), "
        "0 of 3 test sources (0.00%)"
    )


def test_a_config_left_to_the_data_is_not_planned_without_it():
    config = load_config("configs/text.py")
    with pytest.raises(
        ValueError, match="model.d_model, .* are left to the data .* `tx_jax prepare`"
    ):
        validate_config(config)
    validate_config(sizing.with_placeholders(config))  # the rest is checked before the data
    assert sizing.unset_keys(config)  # the placeholders were put in a copy
    assert sizing.unset_keys(load_config("configs/text.py:debug")) == []
    assert sizing.unset_keys(load_config("configs/default.py")) == []


def corpus(tmp_path):
    words = ["red", "blue", "cat", "dog", "big", "small", "house", "tree", "sun", "sea"]
    german = ["rot", "blau", "Katze", "Hund", "gross", "klein", "Haus", "Baum", "Sonne", "See"]
    pairs = [
        (
            " ".join(words[(i * k) % 10] for k in range(1, 3 + i % 5)),
            " ".join(german[(i * k) % 10] for k in range(1, 3 + i % 5)),
        )
        for i in range(300)
    ]
    pairs[7] = (" ".join(words * 12), " ".join(german * 12))  # one pair over max_train_len
    root = tmp_path / "corpus"
    write_prefix(root / "train", pairs)
    write(root / "dev.tsv", [f"{a}\t{b}" for a, b in pairs[:20]])
    write_prefix(root / "test", [(" ".join(words * 3), " ".join(german * 3)), *pairs[20:30]])
    return {
        "data.train": str(root / "train"),
        "data.validation": str(root / "dev.tsv"),
        "data.test": str(root / "test"),
        "data.data_dir": str(tmp_path / "tfds"),
    }


def test_prepare_prints_the_choices_and_a_run_records_and_keeps_them(tmp_path, capsys):
    """`tx_jax prepare` prints what a run of configs/text.py would choose (and as flags); a
    run with the model shrunk by hand chooses the same data sizes, prints them with the
    counts, records them in config.json, and keeps them when resumed."""
    files = corpus(tmp_path)
    ((code, out, err),) = run_modules(
        [
            (
                "tx_jax",
                ["prepare", "--config=configs/text.py", f"--workdir={tmp_path / 'prep'}"]
                + [f"--config.{k}={v}" for k, v in files.items()],
            )
        ],
        cwd=ROOT,
    )
    assert code == 0, err
    assert "sized from the data: 300 train pairs, 99th percentile" in out
    assert "-> small model (d_model 256, 3+3 layers" in out
    assert "train: data.max_train_len=64 drops 1 of 300 pairs (0.33%)" in out
    assert "evaluation: data.max_eval_len=" in out and "0 of 20 validation sources" in out
    flags = next(line for line in out.splitlines() if line.startswith("as flags: "))
    assert "--config.model.d_model=256" in flags and "--config.data.max_train_len=64" in flags

    config = load_config("configs/text.py")
    tiny = {"model.d_model": 32, "model.num_heads": 2, "model.d_ff": 64}
    tiny.update({"model.num_encoder_layers": 1, "model.num_decoder_layers": 1})
    tiny.update({"eval.bleu_examples": 4, "data.vocab_size": 300})
    # a time budget (as test_budget.py's): the budget line and config.json carry the cadence
    # chosen for the fitted steps (test_budget.py checks the rule)
    tiny.update({"train.time_budget_minutes": 0.4, "train.log_every": 1000})
    apply_overrides(config, {**files, **tiny})
    workdir = tmp_path / "run"
    train_and_evaluate(config, workdir)
    out = capsys.readouterr().out
    assert sizing.unset_keys(config)  # the caller's config is left as it was
    assert "set in the config, kept: model.d_model, model.num_heads, model.d_ff" in out
    assert "train: data.max_train_len=64 drops 1 of 300 pairs" in out
    recorded = json.loads((workdir / "config.json").read_text())
    assert recorded["data"]["max_train_len"] == 64 and recorded["model"]["dropout_rate"] == 0.3
    assert recorded["data"]["vocab_size"] == 300
    steps = recorded["train"]["num_steps"]
    every = recorded["eval"]["every"]
    assert steps >= 1 and every == max(100, -(-steps // 1000) * 100)  # ~10 evaluations
    assert recorded["checkpoint"]["every"] == every // 2
    assert f"-> {steps:,} updates" in out
    assert f", eval.every {every:,}, checkpoint.every {every // 2:,})" in out
    evaluated = [
        r["step"]
        for r in map(json.loads, (workdir / "metrics.jsonl").open())
        if r["split"] == "validation"
    ]
    assert evaluated == [*range(every, steps, every), steps]

    # resumed: the recorded choices win over the rule (here: a value the rule would not pick)
    recorded["data"]["max_eval_len"] = 40
    (workdir / "config.json").write_text(json.dumps(recorded))
    again = sizing.begin(config, epath.Path(workdir))
    assert again.data.max_eval_len == 40 and again.model.dropout_rate == 0.3
    assert again.data.max_train_len == 64 and sizing.unset_keys(again) == []


def test_the_sizing_step_completes_a_copy_once_and_the_run_reads_no_data_again(
    tmp_path, capsys, monkeypatch
):
    """size_from_data: the keys left to the data chosen in a copy (said in one line), the task
    prepared once, a test split the corpus lacks found; build_run builds from that alone."""
    files = corpus(tmp_path)
    del files["data.test"]  # configs/text.py scores a test split: this corpus has none
    config = load_config("configs/text.py")
    tiny = {"model.d_model": 32, "model.num_heads": 2, "model.d_ff": 64}
    tiny.update({"model.num_encoder_layers": 1, "model.num_decoder_layers": 1})
    apply_overrides(config, {**files, **tiny, "data.vocab_size": 300})
    unset = sizing.unset_keys(config)
    sized = size_from_data(config, tmp_path / "run")
    out = capsys.readouterr().out
    assert sizing.unset_keys(config) == unset and "model.d_model" not in unset
    assert sized.chosen == tuple(unset) and sizing.unset_keys(sized.config) == []
    assert sized.config.data.max_train_len == 64 and sized.config.model.d_model == 32
    assert out.count("sized from the data: 300 train pairs") == 1
    assert config.eval.score_test and sized.test_split == ""

    def prepared_again(*args, **kwargs):
        raise AssertionError("build_run prepared the data a second time")

    monkeypatch.setattr(setup.tasks, "prepare_task", prepared_again)
    monkeypatch.setattr(setup.preparation, "open_train_splits", prepared_again)
    run = setup.build_run(sized)
    assert (run.config, run.task, run.sized) == (sized.config, sized.task, sized.chosen)
    assert run.model_config.vocab_size == sized.task.tokenizer.vocab_size == 300
    assert run.test_split == "" and capsys.readouterr().out == ""
