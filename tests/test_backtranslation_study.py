"""experiments/backtranslation.py: the runs' configs, the A/B split, the second-seed rule,
a run reused from its record (seconds, in CI), and the `--debug` study end to end, then
rebuilt from its record alone (~3-5 minutes on the 2-core CPU, so it runs only with
TX_JAX_STUDY_SMOKE=1). The end-to-end test reads the real
Multi30k files with the debug size's limits when ../shared/data/multi30k exists, otherwise a
Multi30k-shaped en/de fixture written here (word-for-word translations of invented words)."""

import gzip
import json
import math
import os
import pathlib
import random
import sys

import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import backtranslation as study  # noqa: E402

WORDS = {
    "en": "man woman dog cat house tree car boat red blue green small big runs sits eats",
    "de": "mann frau hund katze haus baum auto boot rot blau gruen klein gross laeuft sitzt isst",
}
SPLITS = {"train": 300, "val": 20, "test_2016_flickr": 20}


def write_fixture(directory: pathlib.Path) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for prefix, n in SPLITS.items():
        sentences = [[rng.randrange(16) for _ in range(rng.randint(3, 6))] for _ in range(n)]
        for lang, words in WORDS.items():
            lexicon = words.split()
            with gzip.open(directory / f"{prefix}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.writelines(" ".join(lexicon[i] for i in s) + "\n" for s in sentences)
    return directory


def test_configs_hold_the_design(tmp_path):
    """Six runs of one model, schedule, vocabulary and real data; only B's source differs."""
    size = study.SIZES["default"]
    configs = {
        name: study.make_config(
            size, tmp_path, "en-de", 0, study.synthetic_corpora(tmp_path, name), {}
        )
        for name in study.SETTINGS
    }
    configs["de_en"] = study.make_config(size, tmp_path, "de-en", 0, [], {})
    base = configs["a_only"]
    for name, c in configs.items():
        assert c.model.to_dict() == base.model.to_dict(), name
        assert c.train.to_dict() == base.train.to_dict(), name
        assert c.data.tokenizer_path == str(tmp_path / "tokenizer.model")
        assert c.data.manual_dir == str(tmp_path / "data" / "A")
        assert c.data.data_dir == str(tmp_path / "tfds")  # never the full dataset's
        assert (c.data.eval_split, c.eval.score_test) == ("validation", False)
    assert (base.data.source_lang, base.data.target_lang) == ("en", "de")
    assert (configs["de_en"].data.source_lang, configs["de_en"].data.target_lang) == ("de", "en")
    assert base.train.num_steps == 600 and base.model.d_model == 256
    assert base.model.dropout_rate == 0.1 and base.data.tokens_per_batch == 4096
    peak = base.train.lr_scale * (base.model.d_model * base.train.warmup_steps) ** -0.5
    assert math.isclose(peak, 2e-3)
    assert list(base.data.backtranslation) == [] and base.data.backtranslation_tag == "<BT>"
    german = str(tmp_path / "data" / "B.de")
    english = {
        "bt_beam": (str(tmp_path / "bt" / "beam" / "B.de"), False),
        "bt_sample": (str(tmp_path / "bt" / "topk10" / "B.de"), False),
        "bt_tagged": (str(tmp_path / "bt" / "beam" / "B.de"), True),
        "a_plus_b": (str(tmp_path / "data" / "B.en"), False),
    }
    for name, (source, tag) in english.items():
        (corpus,) = configs[name].data.backtranslation
        assert corpus == {"source": source, "target": german, "ratio": 1.0, "tag": tag}


def test_split_is_seeded_disjoint_and_reused(tmp_path):
    raw = write_fixture(tmp_path / "raw")
    size = study.SIZES["debug"]
    done = study.split_corpus(raw, tmp_path / "one", size)
    assert (done["pairs"], done["a"], done["b"]) == (300, 150, 150)
    data = tmp_path / "one" / "data"
    a = list(zip(*(study._read_gz(data / "A" / f"train.{x}.gz") for x in ("en", "de"))))
    b = list(zip(*(study._lines(data / f"B.{x}") for x in ("en", "de"))))
    train = list(zip(*(study._read_gz(raw / f"train.{x}.gz") for x in ("en", "de"))))
    # A and B are the train pairs, each once, in their original order, aligned
    assert sorted(a + b) == sorted(train) and len(a) == len(b) == 150
    assert a == [p for p in train if p in set(a)] and a[:5] != train[:5]
    assert study._read_gz(data / "A" / "val.de.gz") == study._read_gz(raw / "val.de.gz")
    study.split_corpus(raw, tmp_path / "two", size)  # same seed, same bytes
    for name in ("A/train.en.gz", "A/train.de.gz", "B.de", "B.en"):
        assert (data / name).read_bytes() == (tmp_path / "two" / "data" / name).read_bytes()
    assert study.split_corpus(raw, tmp_path / "one", size) == done  # reused
    with pytest.raises(SystemExit, match="another split"):
        study.split_corpus(raw, tmp_path / "one", study.SIZES["default"])


def test_a_stored_run_is_reused_unless_a_key_it_had_changed(tmp_path):
    """A finished run's fingerprint: options added to the code since (keys it lacked) do not
    orphan it; a key it had with another value does, named in the error."""
    size = study.SIZES["default"]
    config = study.make_config(size, tmp_path, "en-de", 0, [], {})
    stored = json.loads(study._fingerprint(config))
    del stored["parallel"]["mesh_by_platform"], stored["model"]["dropout_bits"]
    assert study.config_changes(json.dumps(stored), config) == []
    stored["parallel"]["strategy"] = "pmap"  # the records made when pmap was the default
    assert study.config_changes(json.dumps(stored), config) == []
    stored["model"]["d_model"] = 512
    stored["train"]["gone"] = 1
    assert study.config_changes(json.dumps(stored), config) == ["model.d_model", "train.gone"]
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / study.RESULT).write_text(json.dumps({"fingerprint": json.dumps(stored)}))
    with pytest.raises(SystemExit, match=r"another config \(model.d_model, train.gone differ\)"):
        study.train_and_score(config, workdir, "label")


def test_a_recorded_run_is_reused_under_another_root(tmp_path):
    """A finished run kept in --record (the repository) is not trained again when ROOT is
    gone: its config is compared with ROOT written as $ROOT; another config is refused."""
    size = study.SIZES["default"]
    one, two = tmp_path / "one", tmp_path / "two"
    config = study.make_config(size, one, "en-de", 0, study.synthetic_corpora(one, "bt_beam"), {})
    fingerprint = study._fingerprint(config, one)
    assert str(one) not in fingerprint and "$ROOT/bt/beam/B.de" in fingerprint
    record = tmp_path / "record" / "en_de" / "bt_beam" / "seed0"
    record.parent.mkdir(parents=True)
    kept = {"seed": 0, "bleu": 12.5, "chrf": 40.0, "fingerprint": fingerprint}
    record.with_suffix(".json").write_text(json.dumps(kept))
    again = study.make_config(size, two, "en-de", 0, study.synthetic_corpora(two, "bt_beam"), {})
    workdir = two / "en_de" / "bt_beam" / "seed0"  # never created: nothing trains
    result = study.train_and_score(again, workdir, "x", root=two, record=record)
    assert result == kept and not workdir.exists()
    table = study.status_table(tmp_path / "record")  # --status: the record alone
    assert "| A + BT(B), beam 4 | 12.50 | 40.00 |" in table
    assert "| A alone | not run |  |" in table and len(table) == 2 + 1 + len(study.SETTINGS)
    other = study.make_config(size, two, "en-de", 1, [], {})
    with pytest.raises(SystemExit, match=r"another config \(data.backtranslation, seed"):
        study.train_and_score(other, workdir, "x", root=two, record=record)


def test_second_seed_rule():
    first = {"a_only": 20.0, "bt_beam": 22.5, "bt_sample": 22.9, "bt_tagged": 24.0, "a_plus_b": 30}
    assert study.second_seed_settings(first, "close") == ["bt_beam", "bt_sample"]
    assert study.second_seed_settings(first, "all") == list(first)
    assert study.second_seed_settings(first, "none") == []
    assert study.second_seed_order(list(first)) == [
        "bt_beam",
        "bt_sample",
        "bt_tagged",
        "a_only",
        "a_plus_b",
    ]
    assert study.second_seed_order(["a_plus_b", "a_only", "bt_sample"]) == [
        "bt_sample",
        "a_only",
        "a_plus_b",
    ]


def test_conclusion_weighs_each_difference_against_the_noise():
    """Differences under 1 BLEU (or the seed spread) are no difference; when B's real pairs
    add nothing measurable over A, the report says that this size cannot show an effect."""

    def results(bleu: dict[str, list[float]]) -> dict:
        settings = {
            k: study.summarise([{"bleu": b, "chrf": 50.0, "seed": i} for i, b in enumerate(v)])
            for k, v in bleu.items()
        }
        return {
            "settings": settings,
            "split": {"a": 14500},
            "de_en": {"bleu": 33.6},
            "size": {"name": "default"},
        }

    flat = {
        "a_only": [31.6, 31.2],
        "bt_beam": [31.9, 32.3],
        "bt_sample": [31.8, 31.0],
        "bt_tagged": [31.0, 31.5],
        "a_plus_b": [32.5, 32.1],
    }
    lines = study.conclusion(results(flat))
    first = [l for l in lines if l.startswith(f"- {study.SETTINGS['a_plus_b'][0]} vs")]
    assert len(first) == 1 and "+0.90 BLEU" in first[0] and "no difference shown" in first[0]
    assert any("add only +0.90 BLEU to A at this size" in l for l in lines)
    assert "The real pairs lead the best back-translation by +0.20 BLEU" in "".join(lines)
    wide = dict(flat, a_plus_b=[35.0, 35.4], bt_beam=[33.0, 33.4])
    lines = study.conclusion(results(wide))
    assert not any("at this size" in l for l in lines)
    beam = [l for l in lines if l.startswith(f"- {study.SETTINGS['bt_beam'][0]} vs")][0]
    assert "+1.80 BLEU (better; seed spread 0.40)" in beam


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TX_JAX_STUDY_SMOKE") != "1",
    reason="the debug study takes minutes on a 2-core CPU: TX_JAX_STUDY_SMOKE=1 runs it",
)
def test_debug_study_end_to_end(tmp_path):
    real = study.DEFAULT_MANUAL_DIR
    raw = real if (real / "train.de.gz").exists() else write_fixture(tmp_path / "raw")
    root = tmp_path / "study"
    assert study.main(["--debug", f"--root={root}", f"--manual_dir={raw}"]) == 0
    report = (root / "REPORT.md").read_text().splitlines()
    start = report.index("| setting | test BLEU | per seed | test chrF | seeds | vs A alone |")
    rows = []
    for line in report[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    assert len(rows) == 6
    assert [r[0] for r in rows[1:]] == [label for label, _ in study.SETTINGS.values()]
    assert all(math.isfinite(float(r[1])) and 0 <= float(r[1]) <= 100 for r in rows)
    results = json.loads((root / "results.json").read_text())
    assert set(results["settings"]) == set(study.SETTINGS)
    assert results["bt"]["beam"]["lines"] == results["split"]["b"]
    assert (root / "curves.png").stat().st_size > 5000
    for name in study.SETTINGS:  # every en->de run trained to its last step
        last = (root / "en_de" / name / "seed0" / "metrics.jsonl").read_text().splitlines()[-1]
        assert json.loads(last)["step"] == study.SIZES["debug"].steps
    # ROOT lost, its record kept: the study is rebuilt from the record, nothing trains
    other = tmp_path / "elsewhere"
    argv = ["--debug", f"--root={other}", f"--manual_dir={raw}", f"--record={root / 'record'}"]
    assert study.main(argv) == 0
    again = json.loads((other / "results.json").read_text())
    assert again["settings"] == results["settings"] and again["curves"] == results["curves"]
    assert not (other / "en_de").exists() and not (other / "de_en").exists()
