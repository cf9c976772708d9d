"""Tests for tx_jax.data's task files: the tokenizer of a gs:// workdir is trained in a
temporary directory of its own run (run_tokenizer), and train_options reads config.data
(train_input); a translation task is built whole (tasks)."""

import os
import tempfile

import ml_collections
import pytest
from test_data_pipeline import make_pairs, make_tokenizer

from tx_jax.data import datasets, run_tokenizer, tasks, train_input
from tx_jax.data import tokenizer as tk


class FakeBucketPath:
    """The few epath.Path methods load_or_train_tokenizer uses, over a dict: a gs:// path."""

    def __init__(self, url: str, files: dict[str, bytes]):
        self.url, self.files = url, files

    def __truediv__(self, name: str) -> "FakeBucketPath":
        return FakeBucketPath(f"{self.url}/{name}", self.files)

    def __str__(self) -> str:
        return self.url

    def exists(self) -> bool:
        return self.url in self.files

    def read_bytes(self) -> bytes:
        return self.files[self.url]

    def write_bytes(self, data: bytes) -> None:
        self.files[self.url] = data


def test_gs_workdir_tokenizer_trained_in_a_temporary_directory(tmp_path, monkeypatch):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    written = []
    train = run_tokenizer.train_tokenizer

    def spy(texts, vocab_size, model_path, **kw):
        written.append(str(model_path))
        return train(texts, vocab_size, model_path, **kw)

    monkeypatch.setattr(run_tokenizer, "train_tokenizer", spy)
    data = ml_collections.ConfigDict({"vocab_size": 60, "tokenizer_path": None})
    texts = list(tk.iter_pair_texts(make_pairs(100)))
    files: dict[str, bytes] = {}
    toks = [
        run_tokenizer.load_or_train_tokenizer(
            data, FakeBucketPath(f"gs://b/run{i}", files), lambda: texts
        )
        for i in (0, 1)
    ]
    assert sorted(files) == ["gs://b/run0/tokenizer.model", "gs://b/run1/tokenizer.model"]
    assert toks[0] == toks[1] == tk.Tokenizer.from_bytes(files["gs://b/run0/tokenizer.model"])
    assert len(set(written)) == 2  # one temporary file per run, none shared
    assert all(os.path.dirname(os.path.dirname(w)) == str(temp) for w in written)
    assert not os.listdir(temp)  # removed after use


def test_train_options_from_config():
    data = ml_collections.ConfigDict(
        {"max_len": 32, "tokens_per_batch": 256, "bucket_boundaries": None, "packing": True}
    )
    options = train_input.train_options(data, seed=4, batch_multiple=2)
    assert (options.max_len, options.tokens_per_batch, options.packing) == (32, 256, True)
    assert (options.seed, options.batch_multiple, options.bucket_boundaries) == (4, 2, None)
    assert (options.process_index, options.process_count) == (0, 1)  # one global stream


def _synthetic_data(tmp_path, **overrides) -> ml_collections.ConfigDict:
    """A config.data reading a 12-pair synthetic corpus from tmp_path/data."""
    data = {
        "dataset": "synthetic",
        "source_lang": "src",
        "target_lang": "tgt",
        "data_dir": str(tmp_path / "data"),
        "manual_dir": None,
        "download": False,
        "synthetic": {"num_train": 12, "num_validation": 3, "num_test": 3, "seed": 0},
        "max_train_pairs": 5,
        "tokenizer_pairs": 100,
        "tokenizer_path": None,
        "vocab_size": 60,
        "eval_split": "validation",
        "test_split": "test",
    }
    return ml_collections.ConfigDict({**data, **overrides})


def test_translation_task_is_built_with_its_tokenizer(tmp_path):
    """The task comes whole: the given tokenizer (kept as WORKDIR/tokenizer.model, by its
    bytes), its train split opened and cut to max_train_pairs; the workdir's file is what a
    second preparation there reads."""
    given = make_tokenizer(tmp_path)
    data = _synthetic_data(tmp_path)
    task = tasks.prepare_translation_task(data, tmp_path / "run", seed=3, tokenizer=given)
    assert task.tokenizer == given and task.seed == 3
    assert (tmp_path / "run" / run_tokenizer.TOKENIZER_FILE).read_bytes() == given.to_bytes()
    assert set(task.splits) == {"train"} and len(task.splits["train"]) == 12
    assert list(task.train_pairs()) == list(task.splits["train"])[:5]
    assert list(task.pairs("test")) == list(datasets.load_split(data, "test"))
    again = tasks.prepare_translation_task(data, tmp_path / "run", seed=3)
    assert again.tokenizer == given
    with pytest.raises(ValueError, match="differs from the tokenizer of train.init_from"):
        tasks.prepare_translation_task(
            data, tmp_path / "run", seed=3, tokenizer=make_other(tmp_path)
        )


def make_other(tmp_path) -> tk.Tokenizer:
    """Another vocabulary than make_tokenizer's."""
    texts = list(tk.iter_pair_texts(make_pairs(200, seed=7)))
    return tk.train_tokenizer(texts, 80, tmp_path / "other.model")
