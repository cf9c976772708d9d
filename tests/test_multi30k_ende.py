"""experiments/multi30k_ende.py end to end on a Multi30k-shaped fixture: the choice is made on
validation BLEU, the test split is decoded once per seed, and seeds are summarised."""

import json
import shutil
import statistics
import sys
import types

import pytest
from helpers import ROOT
from test_language_similarity import write_fixture

from tx_jax.training import logs

sys.path.insert(0, str(ROOT / "experiments"))
import multi30k_ende  # noqa: E402


def _common(root, data) -> list[str]:
    """The study's arguments shared by the tests: 12 steps, a checkpoint every 4 (all kept)."""
    return [
        "--debug",
        f"--root={root}",
        f"--manual_dir={data.raw}",
        f"--data_dir={data.tfds}",
        "--override=train.num_steps=12",
        "--override=checkpoint.keep=10",
        "--average_last=2",
        "--beam_size=2",
    ]


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    """The study with seeds 0 and 1 -> (its root, the fixture's files and TFDS dir)."""
    base = tmp_path_factory.mktemp("multi30k_ende")
    data = types.SimpleNamespace(raw=write_fixture(base / "raw"), tfds=base / "tfds")
    assert multi30k_ende.main([*_common(base / "study", data), "--seeds=0,1"]) == 0
    return base / "study", data


def test_two_seeds_choose_on_validation_and_score_test_once(two_seeds):
    root, _ = two_seeds
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
        # one validation decode per distinct candidate (best_validation may be the last)
        distinct = list(dict.fromkeys((c["step"], c["average_last"]) for c in row["candidates"]))
        assert splits == ["validation"] * len(distinct) + ["test_2016_flickr"]
        assert [(r["step"], r["averaged"] or 0) for r in records[:-1]] == distinct
        assert records[-1]["bleu"] == row["test_bleu"]
        # one process trained all 12 steps, on this CPU
        assert [(s["from_step"], s["to_step"]) for s in row["segments"]] == [(0, 12)]
        assert row["segments"][0]["cpu"] == logs.cpu() and row["segments"][0]["minutes"] > 0
    bleu = [r["test_bleu"] for r in result["seeds"]]
    assert result["summary"]["test_bleu_mean"] == round(statistics.mean(bleu), 2)
    assert result["summary"]["test_bleu_std"] == round(statistics.stdev(bleu), 2)
    report = (root / "RESULTS.md").read_text()
    assert "Signature: nrefs:1" in report
    assert f"Seed 1's segments: 0-12 on {logs.cpu()} (" in report
    # the two seeds trained differently
    losses = [(root / f"seed{s}" / "metrics.jsonl").read_text().splitlines()[0] for s in (0, 1)]
    assert json.loads(losses[0])["loss"] != json.loads(losses[1])["loss"]


def test_budgets_choose_among_the_checkpoints_saved_in_time(two_seeds, tmp_path):
    """--budgets: one choice and one test decode per budget, each over the checkpoints whose
    training minutes (kept in their meta) fit in it. Seed 0 is the two-seed study's (a copy:
    its run, its checkpoints 4, 8 and 12, its one test decode)."""
    study, data = two_seeds
    root = tmp_path / "study"
    shutil.copytree(study / "seed0", root / "seed0")
    common = _common(root, data)
    assert multi30k_ende.main(common) == 0  # seed 0's result, reused: the same protocol
    minutes = multi30k_ende.kept_minutes(root / "seed0")
    assert sorted(minutes) == [4, 8, 12]
    assert minutes[4] < minutes[8] < minutes[12]
    cut = (minutes[8] + minutes[12]) / 2  # checkpoints 4 and 8 fit, 12 does not
    argv = [*common, f"--budgets={cut!r},1000", "--beams=1,2", "--length_penalties=0.6,1.0"]
    assert multi30k_ende.main(argv) == 0  # the finished run is reused
    row = json.loads((root / "results.json").read_text())["seeds"][0]
    early, whole = row["budgets"]
    assert early["budget_minutes"] == cut and whole["budget_minutes"] == 1000
    assert {c["step"] for c in early["candidates"]} <= {4, 8}
    assert [c["step"] for c in whole["candidates"]][1:] == [12, 12]  # last, average to 12
    assert early["chosen_minutes"] <= cut
    # beam 1 once and beam 2 at both length penalties, on validation; the best point decodes
    # the test
    for b in (early, whole):
        grid = [(p["beam"], p["length_penalty"]) for p in b["decode_grid"]]
        assert grid == [(1, None), (2, 0.6), (2, 1.0)]
        best = max(b["decode_grid"], key=lambda p: p["bleu"])
        assert b["decode"]["beam_size"] == best["beam"]
    records = [
        json.loads(x) for x in (root / "seed0" / "eval_results.jsonl").read_text().splitlines()
    ]
    tests = [r for r in records if r["split"] == "test_2016_flickr"]
    assert len(tests) == 3  # the first main's one, then one per budget
    assert [r["bleu"] for r in tests[1:]] == [early["test_bleu"], whole["test_bleu"]]
    report = (root / "RESULTS.md").read_text()
    assert f"Within {cut:g} training minutes" in report and "Within 1000 training minutes" in report
    # the same arguments again: the seed's result is reused, nothing is decoded again
    assert multi30k_ende.main(argv) == 0
    again = (root / "seed0" / "eval_results.jsonl").read_text().splitlines()
    assert len(again) == len(records)
    assert json.loads((root / "results.json").read_text())["seeds"][0] == row
