"""Tests for tx_jax.data.shards: each process's rows of the global batch from its own
shards, the same global batch whatever the split, and a state that restores on any split."""

import functools
import hashlib
import json
import pathlib
from fractions import Fraction as F

import numpy as np
import pytest
from test_data_pipeline import make_pairs, make_tokenizer

from tx_jax.data import batches, shards

HALVES = ([(F(0), F(1, 2))], [(F(1, 2), F(1))])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def pairs():
    return make_pairs(240, seed=2, hi=9)


def _iterator(pairs, tok, spans=None, input_shards=2, batch_multiple=4, **kw):
    """Packed rows of 16 tokens, 8 rows per batch (4 per shard of 2)."""
    options = batches.TrainOptions(
        max_len=16, tokens_per_batch=128, packing=True, batch_multiple=batch_multiple, **kw
    )
    build = functools.partial(shards.make_train_iterator, shards.Stream(pairs), tok)
    return shards.make_sharded_iterator(build, options, input_shards=input_shards, spans=spans)


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_each_process_reads_its_shard_and_the_rows_add_up(pairs, tok):
    full = _iterator(pairs, tok)
    halves = [_iterator(pairs, tok, spans) for spans in HALVES]
    # S=4 shards and a process holding two separate quarters (a mesh can give that)
    apart = _iterator(pairs, tok, [(F(0), F(1, 4)), (F(1, 2), F(3, 4))], input_shards=4)
    quarters = _iterator(pairs, tok, input_shards=4)
    assert [sorted(h._shards) for h in halves] == [[0], [1]]
    assert sorted(apart._shards) == [0, 2] and apart.share == F(1, 2)
    for _ in range(6):
        batch = next(full)
        assert batch["inputs"].shape == (8, 16)
        parts = [next(h) for h in halves]
        _same(batch, {k: np.concatenate([p[k] for p in parts]) for k in batch})
        whole, mine = next(quarters), next(apart)
        _same(mine, {k: np.concatenate([whole[k][0:2], whole[k][4:6]]) for k in whole})
    # each half tokenized only its shard: its examples are about half, and they add up
    local = [h.local_stats() for h in halves]
    assert local[0]["examples"] + local[1]["examples"] == full.stats()["examples"]
    assert all(0.4 < x["examples"] / full.stats()["examples"] < 0.6 for x in local)
    for h, seen in zip(halves, ([0], [1])):
        assert h.local_stats()["shards"] == seen


def test_one_shard_is_the_single_stream(pairs, tok):
    """input_shards=1 on one process gives exactly shards.make_train_iterator's batches."""
    sharded = _iterator(pairs, tok, input_shards=1)
    options = batches.TrainOptions(max_len=16, tokens_per_batch=128, packing=True)
    plain = shards.make_train_iterator(shards.Stream(pairs), tok, options)
    for _ in range(4):
        _same(next(sharded), next(plain))


def test_state_restores_on_another_split(pairs, tok):
    """A state saved by one process reading both shards restores into processes holding a
    half or the middle (rows of both shards), which continue with the same rows."""
    full = _iterator(pairs, tok)
    for _ in range(3):
        next(full)
    state = json.loads(json.dumps(full.get_state()))
    assert state["input_shards"] == 2 and sorted(state["shards"]) == ["0", "1"]
    resumed = [_iterator(pairs, tok, spans) for spans in HALVES]
    middle = _iterator(pairs, tok, [(F(1, 4), F(3, 4))])
    for it in [*resumed, middle]:
        it.set_state(state)
    for _ in range(3):
        batch = next(full)
        _same(next(resumed[0]), {k: x[:4] for k, x in batch.items()})
        _same(next(resumed[1]), {k: x[4:] for k, x in batch.items()})
        _same(next(middle), {k: x[2:6] for k, x in batch.items()})
    assert resumed[1].stats()["examples"] == resumed[1].local_stats()["examples"]


def test_state_of_the_single_stream_before_input_shards_restores(pairs, tok):
    """A checkpoint's iterator state from before input shards (one TrainIterator state, its
    fingerprint holding batch_multiple) continues here; one whose batch_multiple gave other
    batch shapes is refused, naming the keys."""
    old_options = batches.TrainOptions(
        max_len=16, tokens_per_batch=128, packing=True, batch_multiple=4, process_count=1
    )
    old = shards.make_train_iterator(shards.Stream(pairs), tok, old_options)
    next(old)
    state = old.get_state()
    state["fingerprint"].pop("batch_shapes")
    state["fingerprint"]["batch_multiple"] = 4  # what it held then
    new = _iterator(pairs, tok, input_shards=1, batch_multiple=1)  # 8 rows either way
    new.set_state(state)
    _same(next(new), next(old))
    state["fingerprint"]["batch_multiple"] = 3  # 6 rows: another stream
    with pytest.raises(ValueError, match="batch_shapes.*data.tokens_per_batch.*restore_data"):
        _iterator(pairs, tok, input_shards=1).set_state(state)


def test_errors_name_the_keys(pairs, tok):
    with pytest.raises(ValueError, match="data.input_shards=2 needs one batch shape"):
        shards.check_shape_rule(2, packing=False, boundaries=[8, 16])
    shards.check_shape_rule(2, packing=False, boundaries=[16])  # one bucket is fine
    shards.check_shape_rule(1, packing=False, boundaries=[8, 16])
    with pytest.raises(ValueError, match="data.input_shards=0 must be >= 1"):
        shards.check_shape_rule(0, packing=True, boundaries=None)
    state = _iterator(pairs, tok).get_state()
    with pytest.raises(ValueError, match="data.input_shards=2, this run 4: keep"):
        _iterator(pairs, tok, input_shards=4).set_state(state)


def test_bucketed_shards_are_refused_by_the_config_check(tmp_path):
    from helpers import tiny_config

    from tx_jax.runner.loop import train_and_evaluate

    config = tiny_config(tmp_path, **{"data.input_shards": 2})
    config.data.bucket_boundaries = [16, 32]
    with pytest.raises(ValueError, match="data.packing=True or a single bucket"):
        train_and_evaluate(config, tmp_path / "run")


# ---------------------------------------------------------------------- states of earlier code


def test_states_written_by_the_earlier_data_layout_restore_exactly(tok, pairs):
    """tests/iterator_states.json holds iterator states and the three batches after each,
    written by data/'s earlier layout (separate train iterators for pairs, texts and
    mixtures, then sharded, over these pairs and this tokenizer): a checkpoint saved then
    restores into shards.make_train_iterator and continues with the same batches."""
    fixture = json.loads((pathlib.Path(__file__).parent / "iterator_states.json").read_text())
    sha1 = hashlib.sha1(tok.to_bytes()).hexdigest()
    other = make_pairs(90, seed=5, hi=6)
    opts = batches.TrainOptions(
        max_len=16, tokens_per_batch=96, seed=3, process_index=0, process_count=1
    )
    packed = batches.TrainOptions(
        max_len=16, tokens_per_batch=128, packing=True, seed=1, batch_multiple=2,
        process_index=0, process_count=1,
    )  # fmt: skip
    S, make = shards.Stream, shards.make_train_iterator
    mixed = {"train": S(pairs, 0.6), "synthetic0": S(other, 0.4, [7])}
    builds = {
        "bucketed": (functools.partial(make, S(pairs, source_prefix=[5]), tok), opts, 1),
        "packed_two_shards": (functools.partial(make, S(pairs), tok), packed, 2),
        "mixture": (functools.partial(make, mixed, tok), opts, 1),
        "lm_packed": (functools.partial(make, S([t for _, t in pairs]), tok, lm=True), packed, 1),
    }
    assert set(fixture["cases"]) == set(builds)
    for name, (build, options, input_shards) in builds.items():
        case = fixture["cases"][name]
        for shard in case["state"]["shards"].values():
            assert shard["fingerprint"]["tokenizer_sha1"] == sha1, "make_tokenizer changed"
        it = shards.make_sharded_iterator(build, options, input_shards=input_shards)
        it.set_state(case["state"])
        for expected in case["next"]:
            _same(next(it), {k: np.asarray(v, np.int32) for k, v in expected.items()})
        assert it.get_state()["shards"].keys() == case["state"]["shards"].keys()
