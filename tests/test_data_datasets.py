"""Tests for tx_jax.data.datasets: TranslationSource and load_translation_split.

The WMT catalog path runs without network or TensorFlow in two ways:
* `tfds.testing.mock_data(policy=USE_FILES, data_dir=...)` over the real WMT builder's
  metadata (features + split sizes) written into tmp_path, so split and language checks see
  real values while records are TFDS's random fake strings;
* the real WMT builder prepared as ArrayRecord from fixture sentences (its
  `_split_generators` patched), read back through the real ArrayRecord data source.
"""

from __future__ import annotations

import gzip
import pathlib
from unittest import mock

import ml_collections
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.core import naming
from tensorflow_datasets.core import splits as splits_lib

from tx_jax.data import datasets, multi30k, synthetic

WMT = "wmt14_translate/de-en"


def write_lines(path: pathlib.Path, lines: list[str]) -> None:
    """Writes lines as a gzip UTF-8 file, each ending in a newline."""
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


@pytest.fixture(scope="module")
def multi30k_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Returns (raw_dir, data_dir): an en/de/fr fixture corpus and an empty TFDS data_dir."""
    raw = tmp_path_factory.mktemp("raw")
    for prefix, n in (("train", 6), ("val", 2), ("test_2016_flickr", 2)):
        for lang in ("en", "de", "fr"):
            write_lines(raw / f"{prefix}.{lang}.gz", [f"{lang}-{prefix}-{i}" for i in range(n)])
    return str(raw), str(tmp_path_factory.mktemp("data"))


# TranslationSource


def test_translation_source_decodes_and_orders_pairs():
    records = [{"en": b"a \xc3\xbc", "de": "b"}, {"en": b"c", "de": b"d"}]
    source = datasets.TranslationSource(records, source_lang="de", target_lang="en")
    assert len(source) == 2
    assert source[0] == ("b", "a ü")
    assert source[-1] == ("d", "c")
    assert list(source) == [("b", "a ü"), ("d", "c")]
    assert source.__getitems__([1, 0]) == [("d", "c"), ("b", "a ü")]
    assert ("d", "c") in source
    with pytest.raises(IndexError, match="index 2 out of range"):
        source[2]
    with pytest.raises(TypeError, match="not slices"):
        source[0:1]


# Multi30k


def test_multi30k_both_directions_share_one_prepared_pair(multi30k_dirs):
    raw, data_dir = multi30k_dirs
    fr_en = datasets.load_translation_split(
        "multi30k", "train", source_lang="fr", target_lang="en", data_dir=data_dir, manual_dir=raw
    )
    assert len(fr_en) == 6
    assert fr_en[3] == ("fr-train-3", "en-train-3")
    # Prepared once; the other direction reads it without manual_dir.
    en_fr = datasets.load_translation_split(
        "multi30k", "validation", source_lang="en", target_lang="fr", data_dir=data_dir
    )
    assert list(en_fr) == [("en-val-0", "fr-val-0"), ("en-val-1", "fr-val-1")]
    assert (pathlib.Path(data_dir) / "multi30k" / "en-fr" / "1.0.0").is_dir()


def _load_multi30k_train(tmp_path, manual_dir=None, download=False):
    """de->en train of Multi30k into tmp_path/data, raw files from `manual_dir`."""
    return datasets.load_translation_split(
        "multi30k",
        "train",
        source_lang="de",
        target_lang="en",
        data_dir=str(tmp_path / "data"),
        manual_dir=None if manual_dir is None else str(manual_dir),
        download=download,
    )


def test_multi30k_without_files_or_download_names_both_keys(tmp_path):
    with pytest.raises(
        multi30k.SourceUnavailable,
        match=r"^Multi30k en-de: data.manual_dir is not set: put the raw files there "
        r"\(train.en.gz, train.de.gz, val.en.gz, val.de.gz, .*\) or set data.download=True",
    ):
        _load_multi30k_train(tmp_path)
    (tmp_path / "empty").mkdir()
    for manual_dir, said in (
        (tmp_path / "none", "does not exist"),
        (tmp_path / "empty", "is empty"),
    ):
        with pytest.raises(multi30k.SourceUnavailable, match=f"{manual_dir} {said}: put"):
            _load_multi30k_train(tmp_path, manual_dir)


def test_multi30k_wrong_manual_dir_fails_offline_even_with_download(tmp_path):
    """A directory holding other files is a mistake to name, never a silent download."""
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "train.en").write_text("not the raw release\n")
    with pytest.raises(multi30k.SourceUnavailable, match=r"lacks train\.en\.gz, train\.de\.gz"):
        _load_multi30k_train(tmp_path, tmp_path / "raw", download=True)


def test_multi30k_bad_language_and_split(multi30k_dirs):
    raw, data_dir = multi30k_dirs
    with pytest.raises(ValueError, match=r"'xx'.*valid languages: en, de, fr, cs"):
        datasets.load_translation_split(
            "multi30k", "train", source_lang="xx", target_lang="en", data_dir=data_dir
        )
    with pytest.raises(ValueError, match=r"Split 'test_2017_flickr'.*train, validation"):
        datasets.load_translation_split(
            "multi30k",
            "test_2017_flickr",
            source_lang="de",
            target_lang="en",
            data_dir=data_dir,
            manual_dir=raw,
        )
    with pytest.raises(ValueError, match=r"config 'en-fr' does not match"):
        datasets.load_translation_split(
            "multi30k/en-fr", "train", source_lang="en", target_lang="de", data_dir=data_dir
        )


def test_unknown_dataset_name_suggests_close_names():
    with pytest.raises(
        ValueError, match=r"Unknown dataset 'wmt14_translat/de-en'.*wmt14_translate"
    ):
        datasets.load_translation_split(
            "wmt14_translat/de-en", "train", source_lang="en", target_lang="de"
        )


# WMT from the TFDS catalog


@pytest.fixture
def wmt_metadata(tmp_path: pathlib.Path) -> str:
    """Returns a data_dir holding only the real WMT14 de-en builder's metadata files."""
    builder = tfds.builder(WMT, data_dir=str(tmp_path))
    builder.info.set_file_format("array_record", override=True)
    builder.info.set_splits(
        splits_lib.SplitDict(
            [
                splits_lib.SplitInfo(
                    name=split,
                    shard_lengths=[n],
                    num_bytes=0,
                    filename_template=naming.ShardedFileTemplate(
                        data_dir=builder.data_path,
                        dataset_name=builder.name,
                        split=split,
                        filetype_suffix="array_record",
                    ),
                )
                for split, n in (("train", 4), ("validation", 4), ("test", 4))
            ]
        )
    )
    builder.data_path.mkdir(parents=True)
    builder.info.write_to_directory(builder.data_path)
    return str(tmp_path)


def test_wmt_mock_data_direction_and_errors(wmt_metadata):
    policy = tfds.testing.MockPolicy.USE_FILES
    with tfds.testing.mock_data(num_examples=4, policy=policy, data_dir=wmt_metadata):
        en_de = datasets.load_translation_split(
            "wmt14_translate/de-en", "validation", source_lang="en", target_lang="de"
        )
        records = tfds.builder(WMT).as_data_source("validation")
        assert len(en_de) == 4
        for i in range(4):
            assert en_de[i] == (records[i]["en"], records[i]["de"])
            assert en_de[i][0] != en_de[i][1]
        de_en = datasets.load_translation_split(WMT, "test", source_lang="de", target_lang="en")
        assert de_en[0] == (records[0]["de"], records[0]["en"])
        with pytest.raises(ValueError, match=r"target_lang='fr' is not a feature .*de, en"):
            datasets.load_translation_split(WMT, "train", source_lang="en", target_lang="fr")
        with pytest.raises(ValueError, match=r"Split 'dev'.*train, validation, test"):
            datasets.load_translation_split(WMT, "dev", source_lang="en", target_lang="de")


def test_wmt_not_prepared_raises_without_network(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"wmt14_translate.*not prepared.*download=True"):
        datasets.load_translation_split(
            WMT, "train", source_lang="en", target_lang="de", data_dir=str(tmp_path)
        )
    assert not (tmp_path / "downloads").exists()


def test_wmt_real_builder_prepared_from_fixtures(tmp_path):
    """download=True prepares the real WMT builder as ArrayRecord (its sources patched)."""
    pairs = {"train": [(f"Haus {i}", f"house {i}") for i in range(5)], "test": [("Ja", "Yes")]}

    def split_generators(self, dl_manager):
        del dl_manager
        return {split: self._fixture_examples(rows) for split, rows in pairs.items()}

    def fixture_examples(self, rows):
        del self
        for i, (de, en) in enumerate(rows):
            yield i, {"de": de, "en": en}

    builder_cls = type(tfds.builder(WMT, data_dir=str(tmp_path)))
    with (
        mock.patch.object(builder_cls, "_split_generators", split_generators),
        mock.patch.object(builder_cls, "_fixture_examples", fixture_examples, create=True),
    ):
        train = datasets.load_translation_split(
            WMT, "train", source_lang="en", target_lang="de", data_dir=str(tmp_path), download=True
        )
    assert sorted(train) == [(f"house {i}", f"Haus {i}") for i in range(5)]  # TFDS shuffles.
    test = datasets.load_translation_split(
        WMT, "test", source_lang="de", target_lang="en", data_dir=str(tmp_path)
    )
    assert list(test) == [("Ja", "Yes")]


# Synthetic (tx_jax/data/synthetic.py)


def test_synthetic_is_prepared_on_first_use_in_both_directions(tmp_path):
    kwargs = {"config": synthetic.make_config(num_train=8, num_validation=4, num_test=4)}

    def load(split: str, source_lang: str, target_lang: str) -> datasets.TranslationSource:
        return datasets.load_translation_split(
            "synthetic",
            split,
            source_lang=source_lang,
            target_lang=target_lang,
            data_dir=str(tmp_path),
            builder_kwargs=kwargs,
        )

    forward, backward = load("validation", "src", "tgt"), load("validation", "tgt", "src")
    assert len(forward) == len(backward) == 4
    src, tgt = forward[0]
    assert isinstance(src, str) and isinstance(tgt, str) and src != tgt
    assert backward[0] == (tgt, src)
    assert len(load("train", "src", "tgt")) == 8
    with pytest.raises(ValueError, match=r"source_lang='en' is not a feature .*src, tgt"):
        load("train", "en", "tgt")


# The table (DATASETS): entries, config arguments, a dataset with supervised keys


class TxJaxTestSummaries(tfds.core.GeneratorBasedBuilder):
    """A TFDS builder whose sides are not languages (as gigaword's): 'document' -> 'summary'
    are its supervised keys. Defining it registers it by name, as any TFDS builder."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {"document": tfds.features.Text(), "summary": tfds.features.Text()}
            ),
            supervised_keys=("document", "summary"),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # generated here: nothing is downloaded
        return {"train": self._generate_examples(3), "test": self._generate_examples(1)}

    def _generate_examples(self, n: int):
        for i in range(n):
            yield i, {"document": f"a long text number {i}", "summary": f"text {i}"}


def test_table_rows_by_name():
    assert set(datasets.DATASETS) == {"synthetic", "multi30k", "text"}
    assert datasets.entry_of("text") is datasets.DATASETS["text"]
    assert datasets.entry_of("multi30k/en-de") is datasets.DATASETS["multi30k"]
    assert datasets.entry_of("synthetic") is datasets.DATASETS["synthetic"]
    assert datasets.entry_of(WMT) is datasets.TFDS_CATALOG
    with pytest.raises(ValueError, match=r"'synthetic/big'.*no named configs"):
        datasets.load_translation_split(
            "synthetic/big", "train", source_lang="src", target_lang="tgt"
        )


def test_load_split_reads_the_entry_config_arguments(tmp_path):
    """config.data.synthetic's sizes become the builder's config; load_split of a config is
    load_translation_split of its keys."""
    data = ml_collections.ConfigDict(
        {
            "dataset": "synthetic",
            "source_lang": "tgt",
            "target_lang": "src",
            "data_dir": str(tmp_path),
            "manual_dir": None,
            "download": False,
            "synthetic": {"num_train": 6, "num_validation": 2, "num_test": 3, "seed": 5},
        }
    )
    kwargs = datasets.DATASETS["synthetic"].config_kwargs(data)
    config = kwargs["config"]  # TFDS configs compare by identity: compare the fields
    assert (config.name, config.seed, config.num_train, config.num_test) == ("s5_n6_2_3", 5, 6, 3)
    test = datasets.load_split(data, "test")
    direct = datasets.load_translation_split(
        "synthetic",
        "test",
        source_lang="tgt",
        target_lang="src",
        data_dir=str(tmp_path),
        builder_kwargs=kwargs,
    )
    assert len(test) == 3 and list(test) == list(direct)
    assert datasets.TFDS_CATALOG.config_kwargs(
        ml_collections.ConfigDict({"builder_kwargs": {"config": "x"}})
    ) == {"config": "x"}


def test_tfds_dataset_with_supervised_keys_built_locally(tmp_path):
    """Any TFDS dataset reads by its supervised keys' features (flax's input pipeline takes
    such datasets whole): prepared only when allowed, the direction from source/target_lang."""
    name = "tx_jax_test_summaries"
    with pytest.raises(
        FileNotFoundError, match=r"tx_jax_test_summaries.*not prepared.*download=True"
    ):
        datasets.load_translation_split(
            name, "train", source_lang="document", target_lang="summary", data_dir=str(tmp_path)
        )
    train = datasets.load_translation_split(
        name,
        "train",
        source_lang="document",
        target_lang="summary",
        data_dir=str(tmp_path),
        download=True,
    )
    assert list(train) == [(f"a long text number {i}", f"text {i}") for i in range(3)]
    backward = datasets.load_translation_split(
        name, "test", source_lang="summary", target_lang="document", data_dir=str(tmp_path)
    )
    assert list(backward) == [("text 0", "a long text number 0")]
    with pytest.raises(
        ValueError, match=r"source_lang='en' is not a feature.*supervised keys: document -> summary"
    ):
        datasets.load_translation_split(
            name, "train", source_lang="en", target_lang="summary", data_dir=str(tmp_path)
        )


def test_a_new_dataset_is_one_entry(tmp_path, monkeypatch):
    """A row added to the table (its builder, local preparation, config arguments) is read
    by name through load_split, prepared offline as the row allows."""
    row = datasets.DatasetEntry(
        builder=lambda name, *, source_lang, target_lang, data_dir, builder_kwargs: (
            TxJaxTestSummaries(data_dir=data_dir, **builder_kwargs)
        ),
        prepares_locally=lambda builder, manual_dir, download: True,
        config_kwargs=lambda data: {"version": data.summaries_version},
    )
    monkeypatch.setitem(datasets.DATASETS, "summaries", row)
    data = ml_collections.ConfigDict(
        {
            "dataset": "summaries",
            "source_lang": "document",
            "target_lang": "summary",
            "data_dir": str(tmp_path),
            "manual_dir": None,
            "download": False,
            "summaries_version": "1.0.0",
        }
    )
    assert datasets.load_split(data, "test")[0] == ("a long text number 0", "text 0")
