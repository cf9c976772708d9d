"""Language modelling end to end: configs/lm.py:debug trains, checkpoints and generates."""

import json

import jax
import numpy as np
import pytest
from helpers import ROOT, train_losses

from tx_jax.cli import generate
from tx_jax.config import sibling_config
from tx_jax.data.streams import SideTexts
from tx_jax.inference import evaluation, generation, restore
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.setup import build_run, size_from_data
from tx_jax.training.checkpoint import Checkpointer

PAIRS = [("a b", "x y"), ("c", "z")]


def test_side_texts():
    assert list(SideTexts(PAIRS, "target")) == ["x y", "z"]
    assert list(SideTexts(PAIRS, "source")) == ["a b", "c"]
    assert list(SideTexts(PAIRS, "both")) == ["a b", "x y", "c", "z"]
    assert SideTexts(PAIRS, "both")[-1] == "z" and SideTexts(PAIRS, "both")[1:3] == ["x y", "c"]
    with pytest.raises(IndexError):
        SideTexts(PAIRS, "target")[2]
    with pytest.raises(ValueError, match="data.lm_side='middle'"):
        SideTexts(PAIRS, "middle")


def test_tiny_lm_trains_checkpoints_and_generates(tmp_path, tfds_dir, capsys):
    workdir = tmp_path / "lm"
    config = sibling_config(str(ROOT / "configs" / "lm.py"), "lm", "debug")
    config.data.data_dir = str(tfds_dir)
    config.train.update(num_steps=30, log_every=1)
    config.eval.every = 15
    config.checkpoint.update(every=15, async_save=False)
    final = train_and_evaluate(config, workdir)

    losses = train_losses(workdir)
    first = np.mean([losses[s] for s in (1, 2, 3)])
    last = np.mean([losses[s] for s in (28, 29, 30)])
    assert last < first - 0.5, (first, last)
    assert "bleu" not in final and "test_bleu" not in final
    assert final["perplexity"] == pytest.approx(np.exp(final["loss"]))
    assert final["perplexity"] < np.exp(first) and final["test_perplexity"] > 1
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in records if r["split"] == "validation"]
    assert [r["step"] for r in validation] == [15, 30] and "perplexity" in validation[-1]
    assert any(r["split"] == "test" and "perplexity" in r for r in records)
    assert Checkpointer(workdir / "checkpoints", read_only=True).all_steps()[-1] == 30
    assert (workdir / "tokenizer.model").exists()

    loaded = restore.load(workdir, task="lm")
    assert (loaded.step, loaded.task, type(loaded.model).__name__) == (30, "lm", "DecoderOnly")
    with pytest.raises(restore.CheckpointError, match="holds a 'lm' model"):
        restore.load(workdir, task="translation")
    (samples,) = generation.generate(
        loaded.model_config,
        loaded.params,
        loaded.tokenizer,
        ["ko"],
        num_samples=2,
        max_new_tokens=8,
        temperature=0.0,
    )
    assert len(samples) == 2 and samples[0].text == samples[1].text  # greedy: the same
    assert samples[0].tokens and all(0 < t < loaded.tokenizer.vocab_size for t in samples[0].tokens)

    capsys.readouterr()
    argv = [
        "generate",
        f"--workdir={workdir}",
        "--prompt=ko",
        "--num_samples=3",
        "--max_new_tokens=6",
        "--json",
    ]
    assert generate.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["sample"] for x in lines] == [0, 1, 2] and all(x["prompt"] == "ko" for x in lines)


def test_language_model_test_score_averages_the_last_checkpoints(tmp_path, tfds_dir):
    """eval.average_last for a DecoderOnly run: averaging builds the LM's own state (it was
    hard-wired to EncoderDecoder), and the final test loss is the averaged model's."""
    workdir = tmp_path / "lm_avg"
    config = sibling_config(str(ROOT / "configs" / "lm.py"), "lm", "debug")
    config.data.data_dir = str(tfds_dir)
    config.train.update(num_steps=8, log_every=4)
    config.eval.update(every=4, average_last=2)
    config.checkpoint.update(every=4, async_save=False)
    final = train_and_evaluate(config, workdir)
    assert final["test_average_last"] == 2
    assert (workdir / "averaged" / "last2" / "8").is_dir()

    averaged = restore.load(workdir, average_last=2, task="lm")
    assert averaged.averaged_steps == [4, 8]
    four, eight = (restore.load(workdir, step=s, task="lm").params for s in (4, 8))
    mean = jax.tree_util.tree_map(
        lambda a, b: ((np.float64(a) + np.float64(b)) / 2).astype(np.float32), four, eight
    )
    jax.tree_util.tree_map(np.testing.assert_array_equal, averaged.params, mean)

    batches = build_run(size_from_data(config, workdir)).task.eval_batches("test", 1)
    assert evaluation.loss_metrics(averaged, batches)["loss"] == pytest.approx(
        final["test_loss"], rel=1e-5
    )
    last = restore.load(workdir, task="lm")
    assert evaluation.loss_metrics(last, batches)["loss"] != pytest.approx(final["test_loss"])
