"""Tests for tx_jax.data.eval_pipeline: every example once, in order, truncated not dropped,
process shards, sources-only and LM batches (fixtures shared with test_data_pipeline.py)."""

import numpy as np
import pytest
from test_data_pipeline import MAX_LEN, make_pairs, make_tokenizer, pair_fits

from tx_jax.data import eval_pipeline as ep
from tx_jax.data import tokenizer as tk

PAIR = ("inputs", "targets")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> tk.Tokenizer:
    return make_tokenizer(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def pairs() -> list[tuple[str, str]]:
    return make_pairs(240, seed=2, hi=9)


def test_eval_covers_each_example_once_in_order(pairs, tok):
    data = list(pairs[:19]) + [("the " * 40, "a cat"), ("", "ein Haus")]
    ev = ep.eval_batches(data, PAIR, tok, max_len=MAX_LEN, batch_size=8, batch_multiple=4)
    assert len(ev) == 3 and ev.num_examples == 21
    index = np.concatenate([b["example_index"] for b in ev])
    mask = np.concatenate([b["example_mask"] for b in ev])
    np.testing.assert_array_equal(index[mask == 1], np.arange(21))
    assert (index[mask == 0] == -1).all() and mask.sum() == 21
    truncated = sum(not pair_fits(p, tok) for p in data)
    assert ev.stats == {"examples": 21, "empty": 1, "truncated": truncated, "invalid_utf8": 0}
    for b in ev:
        assert b["inputs"].shape == b["targets"].shape == (8, MAX_LEN)
        assert b["inputs"].dtype == np.int32 and b["example_index"].dtype == np.int32
        assert (b["inputs"][b["example_mask"] == 0] == 0).all()
        for r in np.flatnonzero(b["example_mask"]):
            src, tgt = data[b["example_index"][r]]
            row = b["inputs"][r]
            assert row[(row > 0).sum() - 1] == tk.EOS_ID
            if pair_fits((src, tgt), tok):
                assert tok.decode(row) == src and tok.decode(b["targets"][r]) == tgt
            elif src.strip():  # truncated: the first max_len - 1 pieces, then EOS
                assert row.tolist() == tok.encode(src)[: MAX_LEN - 1] + [tk.EOS_ID]
    assert ev[-1]["inputs"][4].tolist() == [tk.EOS_ID] + [0] * (MAX_LEN - 1)  # empty source


def test_eval_sorted_and_bucketed_still_covers(pairs, tok):
    data = pairs[:37]
    ev = ep.eval_batches(
        data,
        PAIR,
        tok,
        max_len=MAX_LEN,
        batch_size=8,
        bucket_boundaries=[8, 16],
        sort_by_length=True,
    )
    index = np.concatenate([b["example_index"] for b in ev])
    assert sorted(index[index >= 0].tolist()) == list(range(37))
    lengths = []
    for b in ev:
        assert b["inputs"].shape[1] in (8, 16) and b["inputs"].shape[0] == 8
        for r in np.flatnonzero(b["example_mask"]):
            assert tok.decode(b["inputs"][r]) == data[b["example_index"][r]][0]
            lengths.append(max((b["inputs"][r] > 0).sum(), (b["targets"][r] > 0).sum()))
    assert lengths == sorted(lengths, reverse=True)


def test_eval_process_shards(pairs, tok):
    data = pairs[:21]
    evs = [
        ep.eval_batches(
            data, PAIR, tok, max_len=MAX_LEN, batch_size=4, process_index=i, process_count=2
        )
        for i in (0, 1)
    ]
    assert len(evs[0]) == len(evs[1]) == 3  # ceil(ceil(21 / 2) / 4): same count everywhere
    seen = [set(np.concatenate([b["example_index"] for b in ev]).tolist()) - {-1} for ev in evs]
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(21))
    assert evs[0].num_examples == 11 and evs[1].num_examples == 10


def test_encode_sources_and_lm_eval(tok):
    texts = ["the cat", "ein Haus", "", b"der \xff Baum", "the " * 250_000]  # last: 1 MB
    ev = ep.encode_sources(texts, tok, max_len=MAX_LEN, batch_size=2)
    assert len(ev) == 3 and set(ev[0]) == {"inputs", "example_index", "example_mask"}
    assert [tok.decode(r) for b in ev for r in b["inputs"]][:3] == ["the cat", "ein Haus", ""]
    assert ev.stats == {"examples": 5, "empty": 1, "truncated": 1, "invalid_utf8": 1}
    long_row = ev[2]["inputs"][0]
    assert (long_row > 0).all() and long_row[-1] == tk.EOS_ID
    assert ev[2]["example_mask"].tolist() == [1, 0]
    lm = ep.eval_batches(["the cat", "a dog"] * 3, ("targets",), tok, max_len=MAX_LEN, batch_size=4)
    assert set(lm[0]) == {"targets", "example_index", "example_mask"}
    assert lm[1]["example_mask"].tolist() == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="multiple"):
        ep.encode_sources(texts, tok, max_len=MAX_LEN, batch_size=3, batch_multiple=2)


def test_source_prefix_before_every_source(pairs, tok):
    ev = ep.eval_batches(pairs[:5], PAIR, tok, max_len=MAX_LEN, batch_size=8, source_prefix=[7])
    src = ep.encode_sources(
        ["the cat", "the " * 40], tok, max_len=MAX_LEN, batch_size=2, source_prefix=[7]
    )
    for r in range(5):
        row = ev[0]["inputs"][r]
        assert row[0] == 7 and tok.decode(row[1:]) == pairs[r][0]
        assert tok.decode(ev[0]["targets"][r]) == pairs[r][1]  # targets untouched
    assert src[0]["inputs"][0, :4].tolist() == [7, *tok.encode("the cat"), tk.EOS_ID]
    long_row = src[0]["inputs"][1]  # truncated: the prefix stays, EOS last
    assert long_row[0] == 7 and long_row[-1] == tk.EOS_ID and (long_row > 0).all()
