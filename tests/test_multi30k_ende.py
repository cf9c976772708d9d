"""experiments/multi30k_ende.py end to end on a Multi30k-shaped fixture: the choice is made on
validation BLEU, the test split is decoded once per seed, and seeds are summarised."""

import json
import statistics
import sys

from helpers import ROOT
from test_language_similarity import write_fixture

sys.path.insert(0, str(ROOT / "experiments"))
import multi30k_ende  # noqa: E402


def test_two_seeds_choose_on_validation_and_score_test_once(tmp_path):
    raw = write_fixture(tmp_path / "raw")
    root = tmp_path / "study"
    argv = [
        "--debug",
        "--seeds=0,1",
        f"--root={root}",
        f"--manual_dir={raw}",
        f"--data_dir={tmp_path / 'tfds'}",
        "--override=train.num_steps=12",
        "--average_last=2",
        "--beam_size=2",
    ]
    assert multi30k_ende.main(argv) == 0
    result = json.loads((root / "results.json").read_text())
    assert [r["seed"] for r in result["seeds"]] == [0, 1]
    for row in result["seeds"]:
        names = [c["name"] for c in row["candidates"]]
        assert names == ["best_validation", "last", "average_last2"]
        best = max(c["validation_bleu"] for c in row["candidates"])
        chosen = next(c for c in row["candidates"] if c["name"] == row["chosen"])
        assert chosen["validation_bleu"] == best
        assert "nrefs:1" in row["signature"] and 0 <= row["test_bleu"] <= 100
        assert row["steps"] == 12
        # the test split was decoded exactly once for this seed, after the validation ones
        records = [
            json.loads(x)
            for x in (root / f"seed{row['seed']}" / "eval_results.jsonl").read_text().splitlines()
        ]
        splits = [r["split"] for r in records]
        assert splits == ["validation"] * 3 + ["test_2016_flickr"]
        assert records[-1]["bleu"] == row["test_bleu"]
    bleu = [r["test_bleu"] for r in result["seeds"]]
    assert result["summary"]["test_bleu_mean"] == round(statistics.mean(bleu), 2)
    assert result["summary"]["test_bleu_std"] == round(statistics.stdev(bleu), 2)
    assert "Signature: nrefs:1" in (root / "RESULTS.md").read_text()
    # the two seeds trained differently
    losses = [(root / f"seed{s}" / "metrics.jsonl").read_text().splitlines()[0] for s in (0, 1)]
    assert json.loads(losses[0])["loss"] != json.loads(losses[1])["loss"]
