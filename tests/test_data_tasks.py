"""Tests for tx_jax.data.tasks: the tokenizer of a gs:// workdir is trained in a temporary
directory of its own run, and train_options reads config.data."""

import os
import tempfile

import ml_collections
from test_data_pipeline import make_pairs

from tx_jax.data import tasks
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
    train = tasks.train_tokenizer

    def spy(texts, vocab_size, model_path, **kw):
        written.append(str(model_path))
        return train(texts, vocab_size, model_path, **kw)

    monkeypatch.setattr(tasks, "train_tokenizer", spy)
    data = ml_collections.ConfigDict({"vocab_size": 60, "tokenizer_path": None})
    texts = list(tk.iter_pair_texts(make_pairs(100)))
    files: dict[str, bytes] = {}
    toks = [
        tasks.load_or_train_tokenizer(data, FakeBucketPath(f"gs://b/run{i}", files), lambda: texts)
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
    options = tasks.train_options(data, seed=4, batch_multiple=2)
    assert (options.max_len, options.tokens_per_batch, options.packing) == (32, 256, True)
    assert (options.seed, options.batch_multiple, options.bucket_boundaries) == (4, 2, None)
    assert (options.process_index, options.process_count) == (0, 1)  # one global stream
