"""Tests for tx_jax.data's task files: the tokenizer of a gs:// workdir is trained in a
temporary directory of its own run (run_tokenizer), and train_options reads config.data
(shards); a translation task is built whole (tasks); the tokenizer learns from a uniform
seeded sample of the train split (streams.Sample) with data.tokenizer's SentencePiece options,
and a workdir's tokenizer.model is read as it is."""

import os
import tempfile

import ml_collections
import numpy as np
import pytest
from sentencepiece import sentencepiece_model_pb2
from test_data_pipeline import make_pairs, make_tokenizer

from tx_jax.data import datasets, run_tokenizer, shards, streams, tasks
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
        {"max_train_len": 32, "tokens_per_batch": 256, "bucket_boundaries": None, "packing": True}
    )
    options = shards.train_options(data, seed=4, batch_multiple=2)
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
    task = tasks.prepare_task(data, tmp_path / "run", seed=3, tokenizer=given)
    assert task.tokenizer == given and task.seed == 3
    assert (tmp_path / "run" / run_tokenizer.TOKENIZER_FILE).read_bytes() == given.to_bytes()
    assert set(task.splits) == {"train"} and len(task.splits["train"]) == 12
    assert list(task.train_pairs()) == list(task.splits["train"])[:5]
    assert list(task.pairs("test")) == list(datasets.load_split(data, "test"))
    again = tasks.prepare_task(data, tmp_path / "run", seed=3)
    assert again.tokenizer == given
    with pytest.raises(ValueError, match="differs from the tokenizer of train.init_from"):
        tasks.prepare_task(data, tmp_path / "run", seed=3, tokenizer=make_other(tmp_path))


def make_other(tmp_path) -> tk.Tokenizer:
    """Another vocabulary than make_tokenizer's."""
    texts = list(tk.iter_pair_texts(make_pairs(200, seed=7)))
    return tk.train_tokenizer(texts, 80, tmp_path / "other.model")


class Batched(list):
    """A list that records its batched reads (`__getitems__`), as a TranslationSource does."""

    def __init__(self, items):
        super().__init__(items)
        self.reads: list[int] = []

    def __getitems__(self, indices):
        self.reads.append(len(indices))
        return [self[i] for i in indices]


def test_sample_is_the_whole_sequence_or_n_sorted_uniform_seeded_indices():
    seq = list(range(1000))
    for n in (1000, 5000, None):  # a sample as large as the split: all of it, in order
        whole = streams.Sample(seq, n, seed=3)
        assert len(whole) == 1000 and list(whole) == seq and whole.indices.tolist() == seq
    sample = streams.Sample(seq, 100, seed=0)
    idx = sample.indices
    assert len(sample) == 100 and len(set(idx.tolist())) == 100
    assert (np.diff(idx) > 0).all()  # increasing: the corpus's order
    assert list(sample) == idx.tolist() and sample[7] == idx[7] and sample[-1] == idx[-1]
    assert sample[2:5] == idx[2:5].tolist()
    assert streams.Sample(seq, 100, seed=0).indices.tolist() == idx.tolist()  # reproducible
    other = streams.Sample(seq, 100, seed=1).indices
    assert other.tolist() != idx.tolist() and len(set(other) & set(idx)) < 30  # ~10 by chance
    # spread over the whole range: every tenth of it holds some (10 expected each)
    per_tenth = np.bincount(idx // 100, minlength=10)
    assert per_tenth.min() >= 4 and per_tenth.max() <= 18, per_tenth
    assert idx[0] < 50 and idx[-1] > 950
    assert len(streams.Sample(seq, 0, seed=0)) == 0
    with pytest.raises(ValueError, match="n=-1"):
        streams.Sample(seq, -1, seed=0)


def test_views_read_a_split_in_batches():
    """Iterating a Sample (or a Prefix) of a split reads its pairs in batches of 1024 through
    the split's __getitems__ (one ArrayRecord call each), not one by one."""
    source = Batched(range(3000))
    assert list(streams.Sample(source, None, seed=0)) == list(range(3000))
    assert source.reads == [1024, 1024, 952]
    source.reads.clear()
    sample = streams.Sample(streams.Prefix(source, 2500), 1500, seed=0)
    assert list(sample) == sample.indices.tolist() and sample.indices[-1] < 2500
    assert source.reads == [1024, 476]
    with pytest.raises(IndexError):
        streams.Prefix(source, 10).__getitems__([3, 10])


def test_tokenizer_of_a_split_no_larger_than_tokenizer_pairs_is_the_heads(tmp_path):
    """When data.tokenizer_pairs covers the (kept) train split, the tokenizer is byte for byte
    the one the first-N rule trained: every such run (synthetic, Multi30k) keeps its own."""
    data = _synthetic_data(tmp_path)  # 12 pairs cut to 5, tokenizer_pairs 100
    task = tasks.prepare_task(data, tmp_path / "run", seed=3)
    head = list(task.splits["train"])[:5]
    before = tk.train_tokenizer(tk.iter_pair_texts(head), 60, tmp_path / "head.model")
    assert task.tokenizer.to_bytes() == before.to_bytes()


def test_tokenizer_options_are_checked_naming_the_key(tmp_path):
    def options(**given):
        return run_tokenizer.tokenizer_options(ml_collections.ConfigDict({"tokenizer": given}))

    assert run_tokenizer.tokenizer_options(ml_collections.ConfigDict({})) == {
        "model_type": "unigram",
        "character_coverage": 1.0,
        "byte_fallback": False,
    }  # a config stored before data.tokenizer existed: what its tokenizer was trained with
    assert options(model_type="bpe", character_coverage=0.9995, byte_fallback=True) == {
        "model_type": "bpe",
        "character_coverage": 0.9995,
        "byte_fallback": True,
    }
    bad = {
        "model_type='wordpiece'; expected one of unigram, bpe": {"model_type": "wordpiece"},
        "model_type='char'": {"model_type": "char"},
        "character_coverage=0.0; expected a fraction in (0, 1]": {"character_coverage": 0.0},
        "character_coverage=1.5": {"character_coverage": 1.5},
        "character_coverage='0.9'": {"character_coverage": "0.9"},
        "byte_fallback='yes'; expected True or False": {"byte_fallback": "yes"},
    }
    for message, given in bad.items():
        with pytest.raises(ValueError) as info:
            options(**given)
        assert str(info.value).startswith(f"data.tokenizer.{message}"), str(info.value)
    # a task refuses a bad option before it prepares any data
    data = _synthetic_data(tmp_path, tokenizer={"model_type": "wordpiece"})
    with pytest.raises(ValueError, match=r"^data\.tokenizer\.model_type='wordpiece'"):
        tasks.prepare_task(data, tmp_path / "run", seed=0)
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def _trained_with(monkeypatch) -> list[dict]:
    """The keyword arguments of each train_tokenizer call run_tokenizer makes from now on."""
    calls: list[dict] = []
    train = run_tokenizer.train_tokenizer

    def spy(texts, vocab_size, model_path, **kw):
        calls.append(kw)
        return train(texts, vocab_size, model_path, **kw)

    monkeypatch.setattr(run_tokenizer, "train_tokenizer", spy)
    return calls


def test_tokenizer_options_reach_sentencepiece(tmp_path, monkeypatch):
    """data.tokenizer.model_type='bpe' trains a BPE model (its proto says so) that round-trips
    its corpus; byte_fallback and character_coverage are passed on."""
    calls = _trained_with(monkeypatch)
    pairs = make_pairs(200)
    data = ml_collections.ConfigDict(
        {
            "vocab_size": 80,
            "tokenizer_path": None,
            "tokenizer": {"model_type": "bpe", "character_coverage": 0.9999},
        }
    )
    tok = run_tokenizer.load_or_train_tokenizer(
        data, tmp_path / "run", lambda: tk.iter_pair_texts(pairs)
    )
    assert calls == [
        {
            "user_defined_symbols": (),
            "model_type": "bpe",
            "character_coverage": 0.9999,
            "byte_fallback": False,
        }
    ]
    proto = sentencepiece_model_pb2.ModelProto.FromString(tok.to_bytes())
    assert proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.BPE
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    for source, target in pairs[:50]:
        for text in (source, target):
            ids = tok.encode(text)
            assert tk.UNK_ID not in ids and tok.decode(ids) == text


def test_a_workdirs_tokenizer_is_read_as_it_is_whatever_the_options(tmp_path, monkeypatch):
    """An old run's WORKDIR/tokenizer.model (a unigram model without byte fallback) loads by
    its bytes under a config whose data.tokenizer says otherwise: nothing is trained."""
    old = make_tokenizer(tmp_path)
    (tmp_path / "run").mkdir()
    old.save(tmp_path / "run" / run_tokenizer.TOKENIZER_FILE)
    calls = _trained_with(monkeypatch)
    for given in ({}, {"model_type": "bpe", "byte_fallback": True, "character_coverage": 0.5}):
        data = ml_collections.ConfigDict({"vocab_size": 300, "tokenizer_path": None})
        if given:
            data.tokenizer = given
        tok = run_tokenizer.load_or_train_tokenizer(data, tmp_path / "run", lambda: [])
        assert tok.to_bytes() == old.to_bytes()
    assert calls == []
