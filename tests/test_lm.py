"""Language modelling end to end: configs/lm.py:debug trains, checkpoints and generates."""

import json

import numpy as np
import pytest
from helpers import ROOT, train_losses

from tx_jax import generate, restore, train
from tx_jax.checkpoint import Checkpointer
from tx_jax.config_utils import sibling_config
from tx_jax.data.tasks import SideTexts

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
    final = train.train_and_evaluate(config, workdir)

    losses = train_losses(workdir)
    first = np.mean([losses[s] for s in (1, 2, 3)])
    last = np.mean([losses[s] for s in (28, 29, 30)])
    assert last < first - 0.5, (first, last)  # seen: 5.07 -> 4.2
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
    (samples,) = generate.generate(
        loaded.model_config, loaded.params, loaded.tokenizer, ["ko"], num_samples=2,
        max_new_tokens=8, temperature=0.0,
    )  # fmt: skip
    assert len(samples) == 2 and samples[0].text == samples[1].text  # greedy: the same
    assert samples[0].tokens and all(0 < t < loaded.tokenizer.vocab_size for t in samples[0].tokens)

    capsys.readouterr()
    argv = ["generate", f"--workdir={workdir}", "--prompt=ko", "--num_samples=3",
            "--max_new_tokens=6", "--json"]  # fmt: skip
    assert generate.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["sample"] for x in lines] == [0, 1, 2] and all(x["prompt"] == "ko" for x in lines)
