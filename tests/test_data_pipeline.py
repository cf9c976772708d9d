"""Tests for one train stream (tx_jax/data: features.py, streams.py, batches.py, shards.py):
shapes, budgets, filtering counts, exact resume, sharding and packing, on tiny SentencePiece
models and generated sentences."""

import collections
import json
import random

import grain
import numpy as np
import pytest
from etils import epath

from tx_jax.data import batches, shards
from tx_jax.data import tokenizer as tk

_VOCAB = """a the cat dog sat on mat red blue house tree bird flew over small big
ein der die das Haus Baum Vogel klein groß über rot blau"""
WORDS = _VOCAB.split()
MAX_LEN = 16


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_pairs(n: int, seed: int = 0, hi: int = 10) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [(f"{i} " + _sentence(rng, 1, hi), _sentence(rng, 1, hi)) for i in range(n)]


def make_tokenizer(directory) -> tk.Tokenizer:
    """The tests' 120-piece model over generated pairs (and digits)."""
    texts = list(tk.iter_pair_texts(make_pairs(300, seed=1)))
    texts.append(" ".join(str(i) for i in range(400)))  # digits, so numbered pairs stay short
    return tk.train_tokenizer(texts, 120, directory / "spm.model")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> tk.Tokenizer:
    return make_tokenizer(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def pairs() -> list[tuple[str, str]]:
    return make_pairs(240, seed=2, hi=9)


def _options(**kw) -> batches.TrainOptions:
    args = dict(max_len=MAX_LEN, tokens_per_batch=96, process_index=0, process_count=1)
    return batches.TrainOptions(**(args | kw))


def _train(pairs, tok, source_prefix=(), **kw) -> batches.TrainIterator:
    stream = shards.Stream(pairs, source_prefix=source_prefix)
    return shards.make_train_iterator(stream, tok, _options(**kw))


def _rows(batch, key="inputs"):
    """Token rows of a bucketed batch, without padding, each ending in EOS."""
    out = []
    for row in batch[key]:
        n = int((row > 0).sum())
        assert (row[:n] > 0).all() and (row[n:] == 0).all()  # padding only at the end
        if n:
            assert row[n - 1] == tk.EOS_ID
            out.append(row[:n].tolist())
    return out


def _decode_pairs(batches, tok) -> list[tuple[str, str]]:
    out = []
    for b in batches:
        src, tgt = _rows(b, "inputs"), _rows(b, "targets")
        assert len(src) == len(tgt)
        out += [(tok.decode(s), tok.decode(t)) for s, t in zip(src, tgt)]
    return out


def pair_fits(pair, tok) -> bool:
    return all(len(tok.encode(s)) + 1 <= MAX_LEN for s in pair)


# ---------------------------------------------------------------------- shapes


def test_default_bucket_boundaries_and_batch_sizes():
    geometric = [8, 16, 24, 32, 40, 56, 72, 96, 120, 152, 192, 240, 256]
    assert batches.default_bucket_boundaries(256) == geometric
    assert batches.default_bucket_boundaries(16) == [8, 16]
    assert batches.default_bucket_boundaries(20) == [8, 16, 20]
    assert batches.bucket_batch_sizes([8, 16, 24], 100, 4) == [12, 4, 4]
    assert batches.bucket_batch_sizes([8, 16], 100) == [12, 6]
    with pytest.raises(ValueError, match="too small"):
        batches.bucket_batch_sizes([8, 16, 32], 100, 4)


def test_batches_static_shapes_budget_and_multiple(pairs, tok):
    it = _train(pairs, tok, tokens_per_batch=128, batch_multiple=4, num_epochs=1)
    assert it.batch_shapes == ((16, 8), (8, 16))
    batches = list(it)
    assert batches
    for b in batches:
        assert set(b) == {"inputs", "targets"}
        assert b["inputs"].dtype == np.int32 and b["targets"].dtype == np.int32
        assert b["inputs"].shape == b["targets"].shape
        assert b["inputs"].shape in it.batch_shapes
        assert b["inputs"].shape[0] % 4 == 0
        assert (b["inputs"] > 0).sum() <= 128 and (b["targets"] > 0).sum() <= 128
    # Every emitted example is a real pair; kept = emitted + left in partial buckets.
    decoded = _decode_pairs(batches, tok)
    assert set(decoded) <= set(pairs)
    assert len(set(decoded)) == len(decoded)
    stats = it.stats()
    assert stats["kept"] == len(decoded) + stats["dropped_remainder"]
    assert stats["kept"] == sum(pair_fits(p, tok) for p in pairs)
    assert stats["epoch"] == 1


def test_each_example_in_smallest_bucket(pairs, tok):
    it = _train(pairs, tok, tokens_per_batch=64, bucket_boundaries=[4, 8, 12, 16], num_epochs=1)
    for b in it:
        length = b["inputs"].shape[1]
        longest = max((b["inputs"] > 0).sum(1).max(), (b["targets"] > 0).sum(1).max())
        assert [x for x in (4, 8, 12, 16) if x >= longest][0] == length


# ---------------------------------------------------------------------- filtering


def test_filter_counts_are_exact(pairs, tok, monkeypatch):
    long_src = ("the " * 30 + "cat", "a dog")
    long_tgt = ("a dog", "ein Haus " * 20)
    huge = ("x" * 1_000_000, "a cat")  # 1 MB line
    bad_utf8 = (b"the caf\xe9 cat", b"777 ein Haus")  # Latin-1 byte: repaired, kept
    surrogate = ("the cat \udce9", "778 der Baum")  # lone surrogate: repaired, kept
    data = list(pairs[:50])
    data += [long_src] * 3 + [long_tgt] * 2 + [huge] * 2
    data += [("", "a cat"), ("a cat", "   "), ("\t\n", ""), ("\ufffd", "a cat")]  # empty
    data += [bad_utf8, surrogate]
    seen_lengths = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda s: seen_lengths.append(len(s)) or encode(s))
    it = _train(data, tok, num_epochs=1, bucket_boundaries=[MAX_LEN], tokens_per_batch=MAX_LEN)
    emitted = _decode_pairs(list(it), tok)  # B = 1: nothing is left in a bucket
    stats = it.stats()
    fitting = sum(pair_fits(p, tok) for p in pairs[:50])
    assert stats == {
        "examples": len(data),
        "kept": fitting + 2,
        "dropped_empty": 4,
        "dropped_too_long": 5 + (50 - fitting),
        "dropped_too_long_chars": 2,
        "invalid_utf8": 2,
        "dropped_remainder": 0,
        "epoch": 1,
    }
    assert len(emitted) == fitting + 2
    assert max(seen_lengths) < 1000  # the 1 MB line was never tokenized
    repaired = {t: s for s, t in emitted if t.startswith("77")}
    assert repaired == {
        "777 ein Haus": tok.decode(encode("the caf\ufffd cat")),
        "778 der Baum": tok.decode(encode("the cat \ufffd")),
    }
    assert repaired["777 ein Haus"] == "the caf cat"  # nmt_nfkc normalization drops U+FFFD


def test_counts_accumulate_over_epochs(pairs, tok):
    data = list(pairs[:40]) + [("", "x")]
    it = _train(data, tok, num_epochs=3, bucket_boundaries=[MAX_LEN], tokens_per_batch=MAX_LEN)
    n = len(list(it))
    stats = it.stats()
    assert stats["examples"] == 3 * 41 and stats["dropped_empty"] == 3
    assert n == stats["kept"] and stats["epoch"] == 3


# ---------------------------------------------------------------------- state


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize(
    "kind, packing, prefetch",
    [
        ("mt", False, 0),
        ("mt", True, 0),
        ("mt", False, 2),
        ("mt", True, 2),
        ("lm", False, 0),
        ("lm", True, 2),
    ],
)
def test_exact_resume(pairs, tok, kind, packing, prefetch):
    data = pairs[:70]  # several epochs within 12 batches

    def make():
        options = _options(
            tokens_per_batch=128, packing=packing, prefetch=prefetch, seed=5, batch_multiple=2
        )
        if kind == "lm":
            return shards.make_train_iterator(
                shards.Stream([s for s, _ in data]), tok, options, lm=True
            )
        return shards.make_train_iterator(shards.Stream(data), tok, options)

    it = make()
    _take(it, 7)
    state = json.loads(json.dumps(it.get_state()))
    stats = it.stats()
    expected = _take(it, 5)
    assert it.stats()["epoch"] >= 1
    fresh = make()
    fresh.set_state(state)
    assert fresh.stats() == stats
    _assert_same(_take(fresh, 5), expected)
    assert fresh.stats() == it.stats()
    it.close()
    fresh.close()


def test_resume_rejects_other_pipeline(pairs, tok):
    state = _train(pairs, tok).get_state()
    other = _train(pairs, tok, tokens_per_batch=128)
    with pytest.raises(ValueError, match="tokens_per_batch"):
        other.set_state(state)
    bad = dict(state, version=99)
    with pytest.raises(ValueError, match="version"):
        _train(pairs, tok).set_state(bad)


def test_grain_orbax_handler_round_trip(pairs, tok, tmp_path):
    it = _train(pairs, tok)
    _take(it, 3)
    grain.checkpoint.CheckpointHandler().save(epath.Path(tmp_path), it)
    expected = _take(it, 3)
    fresh = _train(pairs, tok)
    grain.checkpoint.CheckpointHandler().restore(epath.Path(tmp_path), fresh)
    _assert_same(_take(fresh, 3), expected)


def test_epochs_reshuffled_like_grain(pairs, tok):
    data = pairs[:30]
    it = _train(
        data, tok, num_epochs=2, seed=9, bucket_boundaries=[MAX_LEN], tokens_per_batch=MAX_LEN
    )
    order = _decode_pairs(list(it), tok)
    kept = [p for p in data if pair_fits(p, tok)]
    first, second = order[: len(kept)], order[len(kept) :]
    assert sorted(first) == sorted(kept) and sorted(second) == sorted(kept)
    assert first != second
    grain_order = list(grain.MapDataset.source(data).shuffle(seed=9).repeat(2))
    assert order == [p for p in grain_order if pair_fits(p, tok)]


# ---------------------------------------------------------------------- sharding


def test_process_shards_disjoint_and_covering(pairs, tok):
    kw = dict(num_epochs=1, bucket_boundaries=[MAX_LEN], tokens_per_batch=MAX_LEN, process_count=2)
    seen = [
        set(_decode_pairs(list(_train(pairs, tok, process_index=i, **kw)), tok)) for i in (0, 1)
    ]
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {p for p in pairs if pair_fits(p, tok)}
    with pytest.raises(ValueError, match="process_index"):
        _train(pairs, tok, process_index=2, process_count=2)


def test_default_process_is_jax_process(pairs, tok):
    options = batches.TrainOptions(max_len=MAX_LEN, tokens_per_batch=64)
    it = shards.make_train_iterator(shards.Stream(pairs), tok, options)
    fp = it.get_state()["fingerprint"]
    assert (fp["process_index"], fp["process_count"]) == (0, 1)


# ---------------------------------------------------------------------- packing


def _segments(row_tokens, row_seg, row_pos):
    """Splits a packed row into per-segment token lists, checking segmentation/position."""
    n = int((row_tokens > 0).sum())
    assert (row_tokens[:n] > 0).all() and (row_tokens[n:] == 0).all()
    assert (row_seg[n:] == 0).all() and (row_pos[n:] == 0).all()
    segs = []
    for s in range(1, int(row_seg.max(initial=0)) + 1):
        where = np.flatnonzero(row_seg == s)
        assert where.size and (np.diff(where) == 1).all()  # contiguous, in order
        np.testing.assert_array_equal(row_pos[where], np.arange(where.size))
        tokens = row_tokens[where].tolist()
        assert tokens[-1] == tk.EOS_ID and tk.EOS_ID not in tokens[:-1]
        segs.append(tokens)
    assert sum(map(len, segs)) == n
    return segs


def test_packing_segments_consistent_and_no_token_lost(pairs, tok):
    it = _train(pairs, tok, packing=True, tokens_per_batch=4 * MAX_LEN, num_epochs=1)
    assert it.batch_shapes == ((4, MAX_LEN),)
    keys = {"inputs", "targets", "inputs_segmentation", "targets_segmentation"}
    keys |= {"inputs_position", "targets_position"}
    emitted = []
    for b in it:
        assert set(b) == keys
        assert all(v.shape == (4, MAX_LEN) and v.dtype == np.int32 for v in b.values())
        for r in range(4):
            src = _segments(b["inputs"][r], b["inputs_segmentation"][r], b["inputs_position"][r])
            tgt = _segments(b["targets"][r], b["targets_segmentation"][r], b["targets_position"][r])
            assert len(src) == len(tgt)
            emitted += [(tok.decode(s), tok.decode(t)) for s, t in zip(src, tgt)]
    stats = it.stats()
    assert len(emitted) + stats["dropped_remainder"] == stats["kept"]
    assert collections.Counter(emitted) <= collections.Counter(
        p for p in pairs if pair_fits(p, tok)
    )
    assert stats["kept"] == sum(pair_fits(p, tok) for p in pairs)


def test_lm_iterator(pairs, tok):
    texts = [s for s, _ in pairs]
    it = shards.make_train_iterator(
        shards.Stream(texts), tok, _options(tokens_per_batch=64), lm=True
    )
    b = next(it)
    assert set(b) == {"targets"} and b["targets"].shape in it.batch_shapes
    assert it.keys == ("targets",)
    for row in _rows(b, "targets"):
        assert tok.decode(row) in texts


def test_source_prefix_counts_toward_max_len(pairs, tok):
    """A language tag's id goes before every source and counts toward max_len."""
    tag = [5]
    it = _train(pairs, tok, source_prefix=tag, num_epochs=1)
    plain = _train(pairs, tok, num_epochs=1)
    assert it.get_state()["fingerprint"]["source_prefix"] == tag
    assert "source_prefix" not in plain.get_state()["fingerprint"]  # older states still fit
    sources = {s for s, _ in pairs}
    for b in it:
        for row in _rows(b, "inputs"):
            assert row[0] == 5 and tok.decode(row[1:]) in sources
    list(plain)
    long = [("the " * 14 + "cat", "a")]  # 15 pieces + EOS fit; + the tag do not
    fits = sum(
        len(tok.encode(s)) + 2 <= MAX_LEN and len(tok.encode(t)) + 1 <= MAX_LEN for s, t in pairs
    )
    assert it.stats()["kept"] == fits <= plain.stats()["kept"]
    assert len(tok.encode(long[0][0])) + 1 == MAX_LEN
    assert next(_train(long * 40, tok))["inputs"].shape == (6, MAX_LEN)
    with pytest.raises(ValueError, match="no example of 40 fits"):
        next(_train(long * 40, tok, source_prefix=tag))


def test_nothing_fits_is_an_error_not_a_hang(tok):
    it = _train([("the " * 40, "a")] * 5, tok, tokens_per_batch=64)
    with pytest.raises(ValueError, match="no example of 5 fits"):
        next(it)
    # one pair in 40 fits: rare across epochs, never an error
    rare = _train(
        [("the cat", "a dog")] + [("the " * 40, "a")] * 39,
        tok,
        tokens_per_batch=8 * MAX_LEN,
        bucket_boundaries=[MAX_LEN],
    )
    assert [tok.decode(r) for r in next(rare)["inputs"]] == ["the cat"] * 8
