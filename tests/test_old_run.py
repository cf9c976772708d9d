"""A workdir written before the redesign (tests/fixtures/old_run: configs/default.py:debug
trained 8 steps under the pmap strategy, its config saying eval.alpha) still loads: it
translates and scores as the code that wrote it did, and resumes training to the same losses
and the same data position (tests/fixtures/old_run_expected.json, recorded by that code)."""

import json
import shutil

import pytest
from forked import run_modules
from helpers import ROOT, default_config

from tx_jax.runner.loop import train_and_evaluate

FIXTURE = ROOT / "tests" / "fixtures" / "old_run"
EXPECTED = json.loads((ROOT / "tests" / "fixtures" / "old_run_expected.json").read_text())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("old") / "run"
    shutil.copytree(FIXTURE, path)
    return path


def test_the_old_run_translates_and_scores_as_it_did(workdir, tmp_path):
    sources = "".join(source + "\n" for source, _ in EXPECTED["pairs"])
    (tmp_path / "src.txt").write_text(sources)
    (tmp_path / "tgt.txt").write_text("".join(target + "\n" for _, target in EXPECTED["pairs"]))
    commands = [
        # --alpha: the length penalty's name then, still read (as --length_penalty)
        ("tx_jax", ["translate", f"--workdir={workdir}", "--beam_size=4", "--alpha=0.6"], sources),
        (
            "tx_jax",
            [
                "score",
                f"--workdir={workdir}",
                f"--source={tmp_path}/src.txt",
                f"--target={tmp_path}/tgt.txt",
            ],
        ),
    ]
    (code, out, err), (score_code, scores, score_err) = run_modules(commands, cwd=ROOT)
    assert code == 0, err
    assert "warning: --alpha is --length_penalty now" in err.splitlines()
    assert out.split("\n")[: len(EXPECTED["pairs"])] == EXPECTED["beam4_translations"]
    assert score_code == 0, score_err
    got = [line.split("\t") for line in scores.splitlines()]
    assert [int(tokens) for _, tokens in got] == [tokens for _, tokens in EXPECTED["scores"]]
    assert [float(logprob) for logprob, _ in got] == pytest.approx(
        [logprob for logprob, _ in EXPECTED["scores"]], abs=1e-3
    )


def test_the_old_run_resumes_to_the_losses_and_data_position_it_would_have_had(workdir, tfds_dir):
    config = default_config.get_config("debug")
    config.data.data_dir = str(tfds_dir)
    config.checkpoint.keep = 1
    config.train.num_steps = 12
    config.eval.bleu_examples = 0  # evaluation does not change training; BLEU costs seconds
    config.eval.score_test = False
    train_and_evaluate(config, workdir)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    resumed = {r["step"]: r for r in records if r["split"] == "train"}
    assert sorted(resumed) == [10, 12]  # from step 8: nothing before it retrained
    for step, want in EXPECTED["resumed_train"].items():
        assert resumed[int(step)]["data_examples"] == want["data_examples"]
        assert resumed[int(step)]["loss"] == pytest.approx(want["loss"], rel=1e-5)
