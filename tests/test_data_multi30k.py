"""Tests for tx_jax.data.multi30k: the Multi30k TFDS builder on small gzip fixtures.

Every fixture is written into tmp_path by the test; the real corpus is read only by the smoke
test at the end, and only where ../shared/data/multi30k (beside the repository) exists.
"""

from __future__ import annotations

import gzip
import http.server
import os
import pathlib
import pickle
import subprocess
import sys
import threading
import time

import pytest
import tensorflow_datasets as tfds
from helpers import ROOT

from tx_jax.config import load_config
from tx_jax.data import datasets, multi30k, text_corpus

REAL_CORPUS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"

# Fixture corpus: file prefix -> (number of lines, languages that have the file).
FIXTURE = {
    "train": (12, ("en", "de", "fr")),
    "val": (3, ("en", "de", "fr")),
    "test_2016_flickr": (3, ("en", "de", "fr")),
    "test_2017_flickr": (2, ("en", "de")),  # No fr: the split exists for en-de only.
}


def sentence(prefix: str, lang: str, i: int) -> str:
    """Returns fixture line i of {prefix}.{lang}.gz; non-ASCII, and de keeps a trailing space."""
    text = f"{lang} {prefix} {i} ü “q”"
    return text + " " if lang == "de" else text


def write_lines(path: pathlib.Path, lines: list[str]) -> None:
    """Writes lines as a gzip UTF-8 file, each ending in a newline."""
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def write_corpus(directory: pathlib.Path, fixture: dict = FIXTURE) -> pathlib.Path:
    """Writes the fixture corpus into `directory` and returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, (n, langs) in fixture.items():
        for lang in langs:
            write_lines(
                directory / f"{prefix}.{lang}.gz", [sentence(prefix, lang, i) for i in range(n)]
            )
    return directory


def prepare(config: str, data_dir: pathlib.Path, manual_dir: pathlib.Path) -> multi30k.Multi30k:
    """Returns a Multi30k builder prepared as ArrayRecord from manual_dir."""
    builder = multi30k.Multi30k(config=config, data_dir=str(data_dir))
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(manual_dir=str(manual_dir)),
    )
    return builder


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Returns a directory holding the fixture corpus."""
    return write_corpus(tmp_path_factory.mktemp("raw"))


@pytest.fixture(scope="module")
def en_de(tmp_path_factory: pytest.TempPathFactory, raw_dir: pathlib.Path) -> multi30k.Multi30k:
    """Returns the en-de builder prepared from the fixture corpus."""
    return prepare("en-de", tmp_path_factory.mktemp("data"), raw_dir)


def test_config_names_are_canonical_and_unordered():
    assert multi30k.config_name("de", "en") == "en-de"
    assert multi30k.config_name("en", "de") == "en-de"
    assert multi30k.config_name("fr", "cs") == "cs-fr"
    assert multi30k.config_name("cs", "en") == "en-cs"
    names = [c.name for c in multi30k.Multi30k.BUILDER_CONFIGS]
    assert sorted(names) == ["cs-de", "cs-fr", "de-fr", "en-cs", "en-de", "en-fr"]
    assert names[0] == "en-de"  # The default config.
    assert multi30k.Multi30k.BUILDER_CONFIGS[0].languages == ("en", "de")
    with pytest.raises(ValueError, match=r"'xx'.*en, de, fr, cs"):
        multi30k.config_name("en", "xx")
    with pytest.raises(ValueError, match="'de' twice"):
        multi30k.config_name("de", "de")


def test_download_urls_follow_split_availability():
    urls = multi30k.download_urls("en", "cs")
    assert list(urls) == ["train", "validation", "test_2016_flickr", "test_2018_flickr"]
    assert urls["validation"]["cs"] == (
        "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/val.cs.gz"
    )
    assert len(multi30k.download_urls("de", "fr")) == 6


def test_prepared_splits_and_features(en_de: multi30k.Multi30k):
    splits = {name: info.num_examples for name, info in en_de.info.splits.items()}
    assert splits == {"train": 12, "validation": 3, "test_2016_flickr": 3, "test_2017_flickr": 2}
    assert sorted(en_de.info.features.keys()) == ["de", "en"]
    assert str(en_de.version) == "1.0.0"


@pytest.mark.parametrize(
    ("split", "prefix"),
    [("train", "train"), ("validation", "val"), ("test_2017_flickr", "test_2017_flickr")],
)
def test_records_are_the_fixture_lines_in_order(en_de: multi30k.Multi30k, split, prefix):
    source = en_de.as_data_source(split)
    records = [source[i] for i in range(len(source))]
    n = FIXTURE[prefix][0]
    assert records == [
        {"en": sentence(prefix, "en", i).encode(), "de": sentence(prefix, "de", i).encode()}
        for i in range(n)
    ]
    assert records[0]["de"].endswith(b" ")  # Only the newline is stripped.


def test_tfds_data_source_reads_prepared_data(en_de: multi30k.Multi30k):
    source = tfds.data_source(
        "multi30k/en-de", split="test_2016_flickr", data_dir=en_de.data_dir_root, download=False
    )
    assert len(source) == 3
    assert source[2]["en"].decode() == sentence("test_2016_flickr", "en", 2)


def test_optional_split_only_when_both_files_exist(tmp_path, raw_dir):
    builder = prepare("en-fr", tmp_path, raw_dir)
    assert sorted(builder.info.splits.keys()) == ["test_2016_flickr", "train", "validation"]
    assert list(builder.info.features.keys()) == ["en", "fr"]


def test_both_directions_via_load_translation_split(en_de, raw_dir):
    data_dir = str(en_de.data_dir_root)
    en_to_de = datasets.load_translation_split(
        "multi30k", "train", source_lang="en", target_lang="de", data_dir=data_dir
    )
    de_to_en = datasets.load_translation_split(
        "multi30k", "train", source_lang="de", target_lang="en", data_dir=data_dir
    )
    assert len(en_to_de) == len(de_to_en) == 12
    assert en_to_de[5] == (sentence("train", "en", 5), sentence("train", "de", 5))
    assert de_to_en[5] == (sentence("train", "de", 5), sentence("train", "en", 5))
    assert [tuple(reversed(p)) for p in de_to_en] == list(en_to_de)
    # grain's worker processes pickle the source.
    assert pickle.loads(pickle.dumps(de_to_en))[11] == de_to_en[11]


def test_mismatched_line_counts_name_both_files(tmp_path):
    raw = write_corpus(tmp_path / "raw")
    write_lines(raw / "val.de.gz", ["only", "two"])
    builder = multi30k.Multi30k(config="en-de", data_dir=str(tmp_path / "data"))
    with pytest.raises(ValueError, match=r"val\.en\.gz has 3 lines but .*val\.de\.gz has 2"):
        builder.download_and_prepare(
            file_format="array_record",
            download_config=tfds.download.DownloadConfig(manual_dir=str(raw)),
        )
    assert not builder.is_prepared()


def test_empty_lines_are_skipped_and_counted(tmp_path):
    write_lines(tmp_path / "a.gz", ["one", "", "three", "four", "five"])
    write_lines(tmp_path / "b.gz", ["eins", "zwei", "   ", "vier", "fünf\r"])
    pairs, skipped = multi30k.read_parallel(tmp_path / "a.gz", tmp_path / "b.gz")
    assert skipped == 2
    assert pairs == [(0, "one", "eins"), (3, "four", "vier"), (4, "five", "fünf")]


def test_invalid_utf8_is_an_error_naming_file_and_line(tmp_path):
    write_lines(tmp_path / "a.gz", ["one", "two"])
    with gzip.open(tmp_path / "b.gz", "wb") as f:
        f.write(b"eins\nzw\xffei\n")
    with pytest.raises(text_corpus.CorpusError, match=r"b\.gz line 2: not UTF-8 \(byte 0xff"):
        multi30k.read_parallel(tmp_path / "a.gz", tmp_path / "b.gz")


def test_empty_lines_are_left_out_of_the_prepared_split(tmp_path):
    raw = write_corpus(tmp_path / "raw")
    lines = [sentence("val", "de", i) for i in range(3)]
    lines[1] = ""
    write_lines(raw / "val.de.gz", lines)
    builder = prepare("en-de", tmp_path / "data", raw)
    source = builder.as_data_source("validation")
    assert [source[i]["en"].decode() for i in range(len(source))] == [
        sentence("val", "en", 0),
        sentence("val", "en", 2),
    ]


def test_missing_required_file_is_named(tmp_path):
    raw = write_corpus(tmp_path / "raw")
    (raw / "train.fr.gz").unlink()
    builder = multi30k.Multi30k(config="en-fr", data_dir=str(tmp_path / "data"))
    with pytest.raises(FileNotFoundError, match=r"lacks train\.fr\.gz"):
        builder.download_and_prepare(
            file_format="array_record",
            download_config=tfds.download.DownloadConfig(manual_dir=str(raw)),
        )


@pytest.mark.skipif(not REAL_CORPUS.is_dir(), reason=f"no real Multi30k at {REAL_CORPUS}")
def test_real_corpus_en_de(tmp_path):
    start = time.perf_counter()
    train = datasets.load_translation_split(
        "multi30k",
        "train",
        source_lang="en",
        target_lang="de",
        data_dir=str(tmp_path),
        manual_dir=str(REAL_CORPUS),
    )
    print(f"prepared real Multi30k en-de in {time.perf_counter() - start:.1f} s")
    assert len(train) == 29000
    assert train[0] == (
        "Two young, White males are outside near many bushes.",
        "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    )
    sizes = {
        split: len(
            datasets.load_translation_split(
                "multi30k", split, source_lang="de", target_lang="en", data_dir=str(tmp_path)
            )
        )
        for split in ("validation", "test_2016_flickr")
    }
    assert sizes == {"validation": 1014, "test_2016_flickr": 1000}


@pytest.mark.skipif(not REAL_CORPUS.is_dir(), reason=f"no real corpus at {REAL_CORPUS}")
def test_real_corpus_as_text_files_gives_the_same_pairs(tmp_path):
    """configs/text.py with Multi30k's files as prefixes reads what configs/multi30k.py reads."""
    data = load_config("configs/text.py").data
    data.data_dir = str(tmp_path)
    data.source_lang, data.target_lang = "en", "de"
    splits = {"train": "train", "validation": "val", "test": "test_2016_flickr"}
    for split, prefix in splits.items():
        data[split] = str(REAL_CORPUS / prefix)
    for split, prefix in splits.items():
        text = list(datasets.load_split(data, split))
        reference = datasets.load_translation_split(
            "multi30k",
            "validation" if prefix == "val" else prefix,
            source_lang="en",
            target_lang="de",
            data_dir=str(tmp_path),
            manual_dir=str(REAL_CORPUS),
        )
        assert len(text) == len(reference) and text == list(reference), split
    assert len(text) == 1000


# --------------------------------------------------------------------------- a fresh clone
# configs/multi30k.py:debug where ../shared is not beside the repository: its manual_dir does
# not exist, so the raw files are downloaded (from a mirror on 127.0.0.1 here), or, with no
# network, the run stops in one line naming data.manual_dir and data.download.

SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "gu", "be", "do", "fi")


def varied_corpus(directory: pathlib.Path, lines: int, langs=("en", "de")) -> pathlib.Path:
    """Every split of `langs` in the release, `lines` lines each of words made of syllables:
    enough distinct pieces for the debug variant's 200-piece tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, prefix in multi30k.SPLIT_FILE_PREFIXES.items():
        if not set(langs) <= multi30k.SPLIT_LANGUAGES[split]:
            continue
        for k, lang in enumerate(langs):
            sentences = []
            for i in range(lines):
                words = [
                    SYLLABLES[(i * 7 + j * 3 + k) % 14] + SYLLABLES[(i + j * 5) % 14] + lang
                    for j in range(3 + i % 9)
                ]
                sentences.append(" ".join(words))
            write_lines(directory / f"{prefix}.{lang}.gz", sentences)
    return directory


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """(its URL, the paths asked for): the raw release served on 127.0.0.1."""
    root = tmp_path_factory.mktemp("release")
    varied_corpus(root / "raw", lines=300)
    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, format, *args):  # noqa: A002 (the base class's name)
            asked.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/raw", asked
    server.shutdown()


def prepare_in_a_fresh_clone(tmp_path: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    """tx_jax prepare --config=configs/multi30k.py:debug with no raw files beside."""
    clean = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tx_jax",
            "prepare",
            "--config=configs/multi30k.py:debug",
            f"--workdir={tmp_path / 'run'}",
            f"--config.data.manual_dir={tmp_path / 'shared'}",  # what a clone lacks
            f"--config.data.data_dir={tmp_path / 'tfds'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**clean, "JAX_PLATFORMS": "cpu", **env},
    )


def test_a_fresh_clone_downloads_the_raw_files_saying_so(tmp_path, mirror):
    url, asked = mirror
    proc = prepare_in_a_fresh_clone(tmp_path, TX_JAX_MULTI30K_URL=url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        f"Multi30k en-de: data.manual_dir {tmp_path / 'shared'} does not exist: downloading the "
        f"raw files from {url}/ (data.download=True)"
    )
    assert "data: multi30k train: 300 pairs" in proc.stdout
    assert "data: multi30k test_2016_flickr: 300 pairs" in proc.stdout
    assert (tmp_path / "run" / "tokenizer.model").exists()
    # one reachability check, then every file of the pair's six splits
    files = {
        f"/raw/{p}.{lang}.gz"
        for p in multi30k.SPLIT_FILE_PREFIXES.values()
        for lang in ("en", "de")
    }
    assert asked[0] == "/raw/train.en.gz" and set(asked[1:]) == files, asked


def test_a_fresh_clone_without_network_stops_in_one_line(tmp_path):
    """No network: the release's host is reached through a proxy that refuses (127.0.0.1:1)."""
    proxy = "http://127.0.0.1:1"
    start = time.perf_counter()
    proc = prepare_in_a_fresh_clone(tmp_path, HTTPS_PROXY=proxy, HTTP_PROXY=proxy)
    assert proc.returncode == 1 and time.perf_counter() - start < 120
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(
        f"error: Multi30k en-de: data.manual_dir {tmp_path / 'shared'} does not exist, and "
        f"data.download=True cannot reach {multi30k.RELEASE_URL}train.en.gz ("
    )
    assert line.endswith(
        "put the raw files (train.en.gz, train.de.gz, val.en.gz, val.de.gz, ...) in "
        "data.manual_dir, or run where that host is reachable"
    )
    assert not (tmp_path / "tfds" / "multi30k" / "en-de").exists()
