"""Tests for weighted streams (tx_jax.data.streams, shards): sampling probabilities, the
empirical direction frequencies of the stream, exact resume with a mixture, process shards
(fixtures of test_data_pipeline.py)."""

import collections
import math

import numpy as np
import pytest
from test_data_pipeline import make_pairs, make_tokenizer

from tx_jax.data import batches, shards, streams
from tx_jax.data import tokenizer as tk

SIZES = {"a": 300, "b": 60, "c": 15}
PREFIX = {"a": [4], "b": [5], "c": [6]}  # any ids: they mark each example's corpus


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> tk.Tokenizer:
    return make_tokenizer(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def corpora() -> dict[str, list[tuple[str, str]]]:
    return {name: make_pairs(n, seed=10 + i, hi=6) for i, (name, n) in enumerate(SIZES.items())}


def _iterator(corpora, tok, probs, **kw):
    args = dict(max_len=16, tokens_per_batch=128, process_index=0, process_count=1, seed=3)
    options = batches.TrainOptions(**(args | kw))
    mixed = {n: shards.Stream(c, p, PREFIX[n]) for (n, c), p in zip(corpora.items(), probs)}
    return shards.make_train_iterator(mixed, tok, options)


def test_mixture_probabilities():
    assert streams.mixture_probabilities([300, 60, 15], "uniform") == [1 / 3] * 3
    proportional = streams.mixture_probabilities([300, 60, 15], "temperature", 1.0)
    np.testing.assert_allclose(proportional, np.array([300, 60, 15]) / 375)
    sqrt = np.sqrt([300, 60, 15])
    np.testing.assert_allclose(
        streams.mixture_probabilities([300, 60, 15], "temperature", 2.0), sqrt / sqrt.sum()
    )
    hot = streams.mixture_probabilities([10**9, 1], "temperature", 1e6)  # T -> inf: uniform
    np.testing.assert_allclose(hot, [0.5, 0.5], atol=1e-4)
    assert math.isclose(sum(streams.mixture_probabilities([10**12, 3], "temperature", 0.01)), 1)
    with pytest.raises(ValueError, match="data.mixture='zipf'"):
        streams.mixture_probabilities([1, 2], "zipf")
    with pytest.raises(ValueError, match="data.temperature=0"):
        streams.mixture_probabilities([1, 2], "temperature", 0)
    with pytest.raises(ValueError, match="needs pairs"):
        streams.mixture_probabilities([1, 0], "uniform")


@pytest.mark.parametrize("kind,temperature", [("uniform", 1.0), ("temperature", 2.0)])
def test_empirical_frequencies_match_probabilities(corpora, tok, kind, temperature):
    probs = streams.mixture_probabilities(list(SIZES.values()), kind, temperature)
    it = _iterator(corpora, tok, probs, packing=False)
    rows = collections.Counter()
    while sum(rows.values()) < 3000:
        batch = next(it)
        real = batch["inputs"][:, 0] > 0
        rows.update(batch["inputs"][real, 0].tolist())  # the prefix id: the corpus
    n = sum(rows.values())
    stats = it.stats()  # counts the examples still held in buckets too
    for (name, p), prefix in zip(zip(SIZES, probs), PREFIX.values()):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(rows[prefix[0]] - n * p) < 4 * sigma, (name, rows, n * p)
        assert stats[f"kept/{name}"] >= rows[prefix[0]]
    assert sum(stats[f"kept/{name}"] for name in SIZES) == stats["kept"]
    # the small corpora are read epoch after epoch: every pair of 'c' was seen
    assert stats["kept/c"] > 2 * SIZES["c"]


@pytest.mark.parametrize("packing", [False, True])
def test_exact_resume_with_a_mixture(corpora, tok, packing):
    probs = streams.mixture_probabilities(list(SIZES.values()), "temperature", 1.5)
    it = _iterator(corpora, tok, probs, packing=packing)
    for _ in range(7):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(6)]
    fresh = _iterator(corpora, tok, probs, packing=packing)
    fresh.set_state(state)
    got = [next(fresh) for _ in range(6)]
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    assert fresh.stats() == it.stats()
    assert state["fingerprint"]["mixture"]["names"] == list(SIZES)
    other = _iterator(corpora, tok, streams.mixture_probabilities([1, 1, 1], "uniform"))
    with pytest.raises(ValueError, match="different pipeline.*mixture"):
        other.set_state(state)


def test_process_shards_draw_the_same_corpora_from_disjoint_examples(corpora, tok):
    probs = streams.mixture_probabilities(list(SIZES.values()), "uniform")
    its = [_iterator(corpora, tok, probs, process_index=i, process_count=2) for i in (0, 1)]
    seen = [set(), set()]
    for i, it in enumerate(its):
        for _ in range(10):
            batch = next(it)
            for row in batch["inputs"]:
                if row[0]:
                    seen[i].add(tuple(row[: (row > 0).sum()]))
    counts = [it.stats() for it in its]
    # the same corpus sequence on both: equal draws per corpus, up to the buckets' fill
    for name in SIZES:
        assert abs(counts[0][f"kept/{name}"] - counts[1][f"kept/{name}"]) <= 12
    # disjoint halves of 'a' (300 pairs, never exhausted in 10 batches)
    first = {s for s in seen[0] if s[0] == PREFIX["a"][0]}
    second = {s for s in seen[1] if s[0] == PREFIX["a"][0]}
    assert first and second and not first & second


def test_bad_probabilities(corpora, tok):
    with pytest.raises(ValueError, match="summing to 1"):
        _iterator(corpora, tok, [0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="num_epochs=1: a mixture repeats"):
        _iterator(corpora, tok, [0.5, 0.25, 0.25], num_epochs=1)
