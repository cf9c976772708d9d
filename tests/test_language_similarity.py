"""experiments/language_similarity.py end to end in its `debug` size, on a four-language
Multi30k-shaped fixture written here (word-for-word translations between invented lexicons,
Czech's sharing no characters' words with the others)."""

import gzip
import json
import pathlib
import random
import sys

import numpy as np
import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import language_similarity as study  # noqa: E402

WORDS = {
    "en": "man woman dog cat house tree car boat red blue green small big runs sits eats",
    "de": "mann frau hund katze haus baum auto boot rot blau gruen klein gross laeuft sitzt isst",
    "fr": "homme femme chien chat maison arbre voiture bateau rouge bleu vert petit grand court "
    "assis mange",
    "cs": "muz zena pes kocka dum strom vuz lod cerveny modry zeleny maly velky bezi sedi ji",
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


def test_run_configs_hold_the_design(tmp_path):
    """The default study: one vocabulary (multi's) everywhere, the low-resource caps, init_from."""
    size = study.SIZES["default"]
    configs = study.run_configs(size, tmp_path, {})
    assert list(configs) == [
        "multi",
        "pre_de",
        "scratch_fr",
        "matched_fr",
        "from_de_fr",
        "scratch_cs",
        "matched_cs",
        "from_de_cs",
    ]
    multi = configs["multi"]
    assert multi.data.directions == "en-de,de-en,en-fr,fr-en,en-cs,cs-en"
    assert multi.data.max_train_pairs == "en-fr=3000,fr-en=3000,en-cs=3000,cs-en=3000"
    assert (multi.data.mixture, multi.data.temperature) == ("temperature", 5.0)
    for name in ("pre_de", "scratch_fr", "matched_fr", "from_de_fr", "scratch_cs", "from_de_cs"):
        assert configs[name].data.tokenizer_path == str(tmp_path / "multi" / "tokenizer.model")
        assert configs[name].model.to_dict() == multi.model.to_dict()  # same architecture
    assert configs["scratch_cs"].data.max_train_pairs == 3000
    assert configs["from_de_cs"].train.init_from == str(tmp_path / "pre_de")
    assert configs["scratch_cs"].train.init_from is None
    # compute matching: the transfer arm's updates (pre-training + fine-tuning) = matched's
    steps = {name: c.train.num_steps for name, c in configs.items()}
    assert steps["matched_cs"] == steps["pre_de"] + steps["from_de_cs"] == 950
    assert steps["scratch_cs"] == steps["from_de_cs"] == 250
    assert configs["matched_cs"].data.max_train_pairs == 3000
    assert configs["matched_cs"].train.init_from is None


def test_debug_study_end_to_end(tmp_path):
    raw = write_fixture(tmp_path / "raw")
    root = tmp_path / "study"
    assert (
        study.main(
            ["--debug", f"--root={root}", f"--manual_dir={raw}", f"--data_dir={tmp_path / 'tfds'}"]
        )
        == 0
    )
    results = json.loads((root / "results.json").read_text())
    transfer = results["scores"]["transfer"]
    assert set(transfer) == {"en-fr", "en-cs"}
    for row in transfer.values():
        for kind in ("scratch", "matched", "from_de", "multilingual"):
            assert 0.0 <= row[kind]["bleu"] <= 100.0 and "nrefs:1" in row[kind]["signature"]
    zero = results["scores"]["zero_shot"]
    assert set(zero) == {"de-fr", "fr-de"} and set(zero["de-fr"]) == {"direct", "pivot_en"}
    sim = results["similarity"]
    assert sim["languages"] == ["en", "de", "fr", "cs"] and sim["sentences"] == 12
    cka, cos, chrf = (np.array(sim[k]) for k in ("cka", "cosine", "chrf"))
    assert cka.shape == cos.shape == (2, 4, 4)  # embeddings + 1 encoder layer
    np.testing.assert_allclose(np.diagonal(cka, axis1=1, axis2=2), 1.0, atol=1e-3)
    np.testing.assert_allclose(cka, np.transpose(cka, (0, 2, 1)), atol=1e-3)
    np.testing.assert_allclose(np.diagonal(chrf), 100.0)
    # disjoint invented lexicons: the languages share only letters, far below identity
    assert chrf[0, 1] < 60 and chrf[0, 3] < 60
    assert len(sim["correlation"]["cka"]) == 2  # one Pearson/Spearman per layer
    assert all(c["n"] == 6 for c in sim["correlation"]["cka"])  # the 6 language pairs
    for name in ("cka_heatmaps.png", "cosine_heatmaps.png", "cka_vs_chrf.png"):
        assert (root / name).stat().st_size > 5000
    report = (root / "REPORT.md").read_text()
    assert "| en-fr |" in report and "| de-fr |" in report and "| en-cs | " in report
    assert (
        "scratch, compute-matched" in report
        and "compute-matched scratch and from en->de 8" in report
    )
    # every run trained to its step count in its own workdir
    for name, steps in (
        ("multi", 6),
        ("pre_de", 4),
        ("scratch_cs", 4),
        ("matched_cs", 8),
        ("from_de_fr", 4),
    ):
        last = (root / name / "metrics.jsonl").read_text().splitlines()[-1]
        assert json.loads(last)["step"] == steps


@pytest.mark.parametrize("bad", [["--bogus"]])
def test_unknown_argument_is_an_error(bad):
    with pytest.raises(SystemExit):
        study.main(bad)
