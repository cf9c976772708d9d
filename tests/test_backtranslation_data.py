"""Tests for tx_jax.data.backtranslation: synthetic corpora read from aligned files (plain,
.gz, globs) and mixed with the real split by their ratios, the tag on synthetic sources only,
exact resume of the mixed stream, clear errors, and a tiny run resumed bit for bit."""

import gzip
import json
import math

import ml_collections
import numpy as np
import pytest
from helpers import tiny_config, train_losses
from test_data_pipeline import make_pairs, make_tokenizer

from tx_jax.data import backtranslation as bt
from tx_jax.data import tasks
from tx_jax.data import tokenizer as tk
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.validation import validate_config

REAL = 300  # real pairs: sources numbered 0..299; synthetic ones 1000.. and 2000..


def _write(path, lines, gz=False):
    text = "".join(x + "\n" for x in lines).encode()
    path.write_bytes(gzip.compress(text) if gz else text)
    return str(path)


def _corpus_files(directory, pairs, name, gz=False, parts=1):
    """`pairs` as parts files per side: DIR/NAME.src-0, ... (source) and DIR/NAME.tgt-0, ..."""
    suffix = ".gz" if gz else ""
    cut = np.array_split(np.arange(len(pairs)), parts)
    for k, idx in enumerate(cut):
        _write(directory / f"{name}.src-{k}{suffix}", [pairs[i][0] for i in idx], gz)
        _write(directory / f"{name}.tgt-{k}{suffix}", [pairs[i][1] for i in idx], gz)
    return str(directory / f"{name}.src-*{suffix}"), str(directory / f"{name}.tgt-*{suffix}")


def _numbered(n, start, seed):
    return [
        (f"{start + i} {s.split(' ', 1)[1]}", t) for i, (s, t) in enumerate(make_pairs(n, seed))
    ]


@pytest.fixture(scope="module")
def tagged_tok(tmp_path_factory) -> tk.Tokenizer:
    texts = list(tk.iter_pair_texts(make_pairs(300, seed=1)))
    texts.append(" ".join(str(i) for i in range(400)))
    path = tmp_path_factory.mktemp("spm") / "spm.model"
    return tk.train_tokenizer(texts, 120, path, user_defined_symbols=["<BT>"])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bt")
    a = _corpus_files(d, _numbered(80, 1000, seed=21), "a", gz=True, parts=3)
    b = _corpus_files(d, _numbered(40, 2000, seed=22), "b")
    return {"a": a, "b": b}


def _data(entries, **kw) -> ml_collections.ConfigDict:
    d = dict(
        source_lang="src",
        target_lang="tgt",
        max_train_len=16,
        tokens_per_batch=128,
        bucket_boundaries=[16],
        packing=False,
        input_shards=1,
        max_train_pairs=0,
        backtranslation=entries,
        backtranslation_tag="<BT>",
        eval_split="validation",
        test_split="test",
    )
    return ml_collections.ConfigDict(d | kw)


def _task(data, tok, seed=3) -> tasks.Task:
    """The task prepare_task builds, over an in-memory real split."""
    corpora = bt.parse_corpora(data)
    tag_id = bt.check_tag(tok, "<BT>", "test") if any(c.tag for c in corpora) else None
    real = tasks.Task(data, tok, seed, splits={"train": _numbered(REAL, 0, seed=20)})
    synthetic = {c.name: bt.load_corpus(c) for c in corpora}
    return tasks.backtranslated(real, corpora, synthetic, tag_id)


def _entries(files, ratio_a=0.5, ratio_b=1.0):
    return [
        {"source": files["a"][0], "target": files["a"][1], "ratio": ratio_a, "tag": True},
        {"source": [files["b"][0]], "target": files["b"][1], "ratio": ratio_b, "name": "b"},
    ]


def test_files_read_in_order_gz_and_globs(files):
    (a,) = [c for c in bt.parse_corpora(_data(_entries(files)))][:1]
    pairs = bt.load_corpus(a)
    assert pairs == _numbered(80, 1000, seed=21)  # 3 .gz parts, in sorted order
    assert a.name == "synthetic0" and a.tag and a.ratio == 0.5


def test_proportions_define_the_ratio():
    assert bt.proportions([1.0]) == [0.5, 0.5]
    np.testing.assert_allclose(bt.proportions([0.5, 1.0]), [0.4, 0.2, 0.4])
    np.testing.assert_allclose(bt.proportions([0.25]), [0.8, 0.2])


def test_share_of_synthetic_examples_matches_the_ratios_and_tags(files, tagged_tok):
    task = _task(_data(_entries(files)), tagged_tok)
    it = task.train_iterator(1)
    tag = tagged_tok.piece_to_id("<BT>")
    rows = {"real": 0, "a": 0, "b": 0}
    while sum(rows.values()) < 3000:
        batch = next(it)
        for row in batch["inputs"][batch["inputs"][:, 0] > 0]:
            ids = [int(i) for i in row if i > 0]
            tagged = ids[0] == tag
            # the tag is one id, first, and only there
            assert tag not in ids[1:]
            number = int(tagged_tok.decode(ids[1:] if tagged else ids).split()[0])
            corpus = "real" if number < 1000 else "a" if number < 2000 else "b"
            assert tagged == (corpus == "a"), (corpus, ids)
            rows[corpus] += 1
    n = sum(rows.values())
    for corpus, p in zip(rows, [0.4, 0.2, 0.4]):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(rows[corpus] - n * p) < 4 * sigma, (rows, n)
    stats = it.stats()  # every example drawn, those still in buckets too
    kept = stats["kept"]
    for name, p in [("train", 0.4), ("synthetic0", 0.2), ("b", 0.4)]:
        assert abs(stats[f"kept/{name}"] - kept * p) < 4 * math.sqrt(kept * p * (1 - p))
    assert stats["kept/b"] > 3 * 40  # a small corpus is read epoch after epoch


@pytest.mark.parametrize("packing", [False, True])
def test_state_round_trips_and_resumes_the_identical_batches(files, tagged_tok, packing):
    data = _data(_entries(files), packing=packing, bucket_boundaries=[16])
    it = _task(data, tagged_tok).train_iterator(1)
    for _ in range(5):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(6)]
    fresh = _task(data, tagged_tok).train_iterator(1)
    fresh.set_state(state)
    got = [next(fresh) for _ in range(6)]
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    assert fresh.stats() == it.stats()
    # another ratio is another stream: the state says so instead of resuming elsewhere
    other = _task(_data(_entries(files, ratio_b=2.0), packing=packing), tagged_tok)
    with pytest.raises(ValueError, match="mixture"):
        other.train_iterator(1).set_state(state)


def test_misaligned_files_name_both_sides(tmp_path):
    src = _write(tmp_path / "bt.en", ["a", "b", "c"])
    tgt = _write(tmp_path / "bt.de", ["x", "y"])
    (c,) = bt.parse_corpora(_data([{"source": src, "target": tgt, "ratio": 1}]))
    with pytest.raises(ValueError, match=r"not aligned.*bt\.en \(3 lines\).*bt\.de \(2 lines\)"):
        bt.load_corpus(c)
    (missing,) = bt.parse_corpora(
        _data([{"source": str(tmp_path / "none-*.en"), "target": tgt, "ratio": 1}])
    )
    with pytest.raises(FileNotFoundError, match=r"backtranslation.source: no file matches"):
        bt.load_corpus(missing)


@pytest.mark.parametrize(
    "entries,match",
    [
        ([{"source": "s", "target": "t"}], r"backtranslation\[0\] has no 'ratio'"),
        ([{"source": "s", "target": "t", "ratio": 0}], r"\[0\]\.ratio=0 must be a positive"),
        ([{"source": "s", "target": "t", "ratio": 1, "tags": True}], r"unknown keys \['tags'\]"),
        ([{"source": "s", "target": "t", "ratio": 1, "tag": "yes"}], r"\.tag='yes'"),
        ([{"source": "", "target": "t", "ratio": 1}], r"\[0\]\.source=''"),
        ({"source": "s"}, r"backtranslation=.*a list"),
    ],
)
def test_bad_entries_name_the_key(entries, match):
    with pytest.raises(ValueError, match=match):
        bt.parse_corpora(_data(entries))


def bt_config(tfds_dir, corpora, **overrides) -> ml_collections.ConfigDict:
    """tiny_config with data.backtranslation set, a key only the study's config defines."""
    c = tiny_config(tfds_dir, **overrides)
    c.data.backtranslation = corpora
    return c


def test_config_checks(tfds_dir):
    entry = {"source": "s", "target": "t", "ratio": 1.0}
    multilingual = bt_config(tfds_dir, [entry])
    multilingual.data.directions = "en-de"
    with pytest.raises(ValueError, match="backtranslation with data.directions"):
        validate_config(multilingual)
    with pytest.raises(ValueError, match=r"backtranslation\[0\]\.ratio"):
        validate_config(bt_config(tfds_dir, [entry | {"ratio": -1}]))
    tagged = bt_config(tfds_dir, [entry | {"tag": True}])
    tagged.data.backtranslation_tag = "<B T>"
    with pytest.raises(ValueError, match=r"data.backtranslation_tag='<B T>' must be one word"):
        validate_config(tagged)


def test_tokenizer_without_the_tag_is_an_error(tmp_path, tfds_dir, files):
    plain = make_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="has no piece '<BT>'.*tagged back-translation"):
        bt.check_tag(plain, "<BT>", "x")
    config = bt_config(
        tfds_dir, _entries(files), **{"data.tokenizer_path": str(tmp_path / "spm.model")}
    )
    with pytest.raises(ValueError, match=r"tokenizer.model \(.*spm.model\) has no piece '<BT>'"):
        tasks.prepare_task(config.data, tmp_path / "run", seed=0)


def test_tiny_run_with_a_synthetic_corpus_resumes_bit_exactly(tmp_path, tfds_dir):
    """The run trains its tokenizer with '<BT>'; 2N steps straight == N + restart + N."""
    synthetic = _numbered(60, 1000, seed=23)
    src = _write(tmp_path / "bt.src", [s for s, _ in synthetic])
    tgt = _write(tmp_path / "bt.tgt.gz", [t for _, t in synthetic], gz=True)
    n = 3
    cfg = lambda steps: bt_config(  # noqa: E731
        tfds_dir,
        [{"source": src, "target": tgt, "ratio": 1.0, "tag": True}],
        **{"train.num_steps": steps, "checkpoint.every": n, "model.dropout_rate": 0.1},
    )
    train_and_evaluate(cfg(2 * n), tmp_path / "straight")
    train_and_evaluate(cfg(n), tmp_path / "resumed")
    train_and_evaluate(cfg(2 * n), tmp_path / "resumed")
    straight, resumed = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert [straight[s] for s in range(1, 2 * n + 1)] == [resumed[s] for s in range(1, 2 * n + 1)]
    tok = tk.Tokenizer.from_bytes((tmp_path / "straight" / "tokenizer.model").read_bytes())
    assert tok.piece_to_id("<BT>") not in (tok.unk_id, tok.pad_id)
    # the mixture's counts reach the metrics: about as many synthetic examples as real ones
    lines = (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    last = [r for r in map(json.loads, lines) if r["split"] == "train"][-1]
    real, fake = last["data_kept/train"], last["data_kept/synthetic0"]
    assert real + fake == last["data_kept"] and abs(real - fake) < 4 * math.sqrt(real + fake)
    # evaluation reads the real dataset only (debug: 400 train, 40 validation pairs)
    task = tasks.prepare_task(cfg(1).data, tmp_path / "straight", seed=0)
    assert len(task.pairs("train")) == 400 and len(task.streams["synthetic0"].items) == 60
    assert task.eval_batches("validation", 1).num_examples == 40
