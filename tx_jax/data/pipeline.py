"""Grain train pipeline: text pairs -> SentencePiece ids -> static-shape numpy batches.

Letters: B batch rows, L padded length. In a bucketed batch 'inputs' and 'targets' share one
L (the bucket boundary that holds the longer side), so each bucket is a single jit shape.

Input is any random-access `Sequence` of (source, target) pairs of `str` or UTF-8 `bytes`
(TFDS-backed sequences or plain lists); the LM variants take a `Sequence` of texts.

Train batches (`make_train_iterator`, `make_lm_train_iterator`, both configured by one
`TrainOptions`): dicts of numpy int32.

    bucketed (packing=False)
      'inputs'   [B, L]  source ids + EOS, then 0 (padding)      (absent for LM)
      'targets'  [B, L]  target ids + EOS, then 0
      L is a bucket boundary (`batching.default_bucket_boundaries`); B = floor(tokens_per_batch / L)
      rounded down to a multiple of `batch_multiple`, so B * L <= tokens_per_batch and only
      len(boundaries) shapes exist (`TrainIterator.batch_shapes`).
    packed (packing=True), L = max_len, B = floor(tokens_per_batch / max_len) rounded down
      'inputs', 'targets'                            [B, L]  several examples per row
      'inputs_segmentation', 'targets_segmentation'  [B, L]  1, 2, 3... per example, 0 = pad
      'inputs_position', 'targets_position'          [B, L]  0-based, restarting per example
      Rows are filled first-fit in stream order; an example never spans two rows.

Eval batches (every example once, fixed shapes, nothing dropped) are in eval_pipeline.py;
a sampled mixture of several corpora (multilingual training) in mixture.py. All three
featurize with featurize.Featurizer, so text becomes the same ids everywhere.

Train records are sharded per process ([process_index::process_count]), shuffled with `seed`
(a new permutation each epoch, the order of grain's `MapDataset.shuffle(seed).repeat()`),
repeated forever (or `num_epochs`), tokenized once and cached, and filtered: a pair is dropped
when a side is empty, whitespace-only or encodes to no id, or is longer than max_len ids (EOS
included). A side over `max_len * max_piece_chars * 4`
non-space characters is dropped by a character count before tokenization (a 1 MB line costs
no tokenizer time; the factor 4 allows for NFKC composition, so ordinary text that would fit
is never dropped by it). Invalid UTF-8 is decoded with U+FFFD and kept (SentencePiece's
default nmt_nfkc normalizer then deletes the U+FFFD characters).

`TrainIterator.stats()` returns counts since the start of training (epochs add up):
    'examples' read, 'kept', 'dropped_empty', 'dropped_too_long', 'dropped_too_long_chars',
    'invalid_utf8' (repaired, kept if otherwise fine), 'dropped_remainder' (partial buckets
    left when a finite `num_epochs` ends), 'epoch' (current epoch of this process's shard).

Iterator state (`TrainIterator.get_state()`) is a small JSON-serializable dict, e.g.
    {'version': 1,
     'fingerprint': {'max_len': 16, 'tokens_per_batch': 128, 'seed': 0, 'process_index': 0,
                     'bucket_boundaries': [8, 16], 'batch_shapes': [[16, 8], [8, 16]],
                     'tokenizer_sha1': '...', ...},
     'pipeline': {'examples': {'next_index': 50, 'tx_counts': {'examples': 50, ...}},
                  'held': [[3, 4, 8], []], 'dropped_remainder': 0}}
'next_index' is the position in this shard's shuffled, repeated stream; 'held' lists the
stream positions of examples waiting in each bucket (or in the open packed batch), which
`set_state` re-reads and re-adds. A fresh iterator built with the same data and options
then continues with identical batches; a state whose fingerprint differs raises ValueError.
The fingerprint holds the batch shapes, not `batch_multiple` (the device count behind them),
so a state restores on another device count when the shapes are the same.
`TrainIterator` is a grain `DatasetIterator`, so Orbax saves it with
`grain.checkpoint.CheckpointSave(it)` / `CheckpointRestore(it)` (one JSON file per process).

Shards: `process_index` / `process_count` name the shard [process_index::process_count] read.
Training cuts the stream into `data.input_shards` such shards and each process builds only
those its devices need (input_shards.py); their batches form one global array, so they must
share a shape: `packing=True` or a single bucket (`bucket_boundaries=[max_len]`).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import hashlib
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np
from grain.experimental import index_shuffle

from tx_jax.data.batching import (
    Batch,
    BatchSpec,
    GroupIterDataset,
    bucket_batch_sizes,
    check_boundaries,
)
from tx_jax.data.featurize import Featurizer, Record, Text
from tx_jax.data.tokenizer import Tokenizer

_STATE_VERSION = 1
_COUNT_KEYS = (
    "examples",
    "kept",
    "dropped_empty",
    "dropped_too_long",
    "dropped_too_long_chars",
    "invalid_utf8",
)


class _ShardRecords(grain.MapDataset):
    """Featurized records of shard items[process_index::process_count], memoized.

    One MapDataset in place of grain's source -> slice -> map chain, whose per-element
    monitoring in every layer costs more than tokenizing a pair.
    """

    def __init__(self, items: Sequence[Any], shard: slice, featurize: Featurizer, cache: bool):
        super().__init__()
        self._items = items
        self._indices = range(len(items))[shard]
        self._featurize = featurize
        self._cache: dict[int, Record] | None = {} if cache else None

    def __len__(self) -> int:
        return len(self._indices)

    def __str__(self) -> str:
        return f"_ShardRecords({self._indices})"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        index %= len(self._indices)
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        record = self._featurize(self._items[self._indices[index]])
        if self._cache is not None:
            self._cache[index] = record
        return record


# ------------------------------------------------------------------------ train iterators


def _record_at(records: grain.MapDataset, n: int, seed: int, position: int) -> Record:
    """Record at stream `position`: epoch e = position // n is shuffled with seed + e.

    Same order as `records.shuffle(seed).repeat()` (grain's index_shuffle with its per-epoch
    seed), without the per-element overhead of two more grain MapDataset layers.
    """
    epoch, i = divmod(position, n)  # n = len(records)
    if n > 1:
        i = index_shuffle(i, n - 1, (seed + epoch) % 2**32, 4)
    return records[i]


class _ExampleIterDataset(grain.IterDataset):
    """Shuffled, repeated stream of (position, features) for kept records (`ExampleIterator`)."""

    def __init__(self, records: grain.MapDataset, seed: int, num_epochs: int | None):
        super().__init__()
        self._records = records
        self._seed = seed
        self._num_epochs = num_epochs

    def __iter__(self) -> ExampleIterator:
        return ExampleIterator(self._records, self._seed, self._num_epochs)


class ExampleIterator(grain.DatasetIterator):
    """Kept examples of one corpus shard, shuffled per epoch: (position, features) pairs.

    `records` is `shard_records`'s dataset of n `Record`s. Stream position p reads record
    shuffle_{seed + p // n}(p % n), so an epoch is a permutation and each epoch differs;
    dropped records are skipped and counted. `features` is key -> int32 [<= max_len] ids.
    State: {'next_index': the next stream position, 'tx_counts': the counts of
    `TrainIterator.stats`}; `reread(p)` gives the features at position p again (a restore
    re-reads the examples that the batching layer held).
    """

    def __init__(self, records: grain.MapDataset, seed: int, num_epochs: int | None):
        super().__init__()
        self._records = records
        self._seed = seed
        self._n = len(records)
        self._end = None if num_epochs is None else num_epochs * self._n
        self._next_index = 0
        self._counts = dict.fromkeys(_COUNT_KEYS, 0)

    def __next__(self) -> tuple[int, dict[str, np.ndarray]]:
        misses = 0
        while self._end is None or self._next_index < self._end:
            # 2n - 1 positions in a row always cover one whole epoch: if none was kept, none is
            if misses >= 2 * self._n:
                raise ValueError(
                    f"no example of {self._n} fits: every one is empty or longer than max_len"
                    f" (counts: {self._counts})"
                )
            position = self._next_index
            record = _record_at(self._records, self._n, self._seed, position)
            self._next_index += 1
            self._counts["examples"] += 1
            for note in record.notes:
                self._counts[note] += 1
            if record.drop:
                self._counts[f"dropped_{record.drop}"] += 1
                misses += 1
                continue
            self._counts["kept"] += 1
            return position, record.features
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._next_index, "tx_counts": dict(self._counts)}

    def reread(self, position: int) -> dict[str, np.ndarray]:
        """Features of the (kept) example at `position`, as returned by `__next__` then."""
        return _record_at(self._records, self._n, self._seed, position).features

    def set_state(self, state: dict[str, Any]) -> None:
        self._next_index = int(state["next_index"])
        self._counts = dict(state["tx_counts"])


_LIVE_ITERATORS: weakref.WeakSet = weakref.WeakSet()


def _noop() -> None:
    pass


@atexit.register
def _close_live_iterators() -> None:
    """Stops prefetch threads before interpreter teardown.

    grain's ThreadPrefetchDatasetIterator.close() (also run by __del__) uses module globals
    that are already None during teardown and prints a traceback; closing now and making
    the later close() a no-op avoids that.
    """
    for it in list(_LIVE_ITERATORS):
        it.close()
        todo = [it]
        while todo:
            node = todo.pop()
            node.close = _noop
            todo.extend(getattr(node, "_parents", ()))


class TrainIterator(grain.DatasetIterator):
    """Infinite (or `num_epochs`) iterator of train batches with exact, JSON-able state.

    Attributes:
      keys: the token keys of each batch ('inputs', 'targets' or just 'targets').
      batch_shapes: every (B, L) a batch can have, smallest L first.
      packing: whether batches are packed (then they also carry segmentation/position).
    """

    def __init__(
        self,
        dataset: GroupIterDataset,
        *,
        prefetch: int,
        fingerprint: dict[str, Any],
        keys: tuple[str, ...],
        batch_shapes: tuple[tuple[int, int], ...],
        packing: bool,
        shard_size: int,
    ):
        self._batches = dataset.__iter__()
        if prefetch > 0:
            prefetcher = grain.experimental.ThreadPrefetchDatasetIterator(self._batches, prefetch)
            super().__init__(prefetcher)
        else:
            super().__init__(self._batches)
        self._fingerprint = fingerprint
        self.keys = keys
        self.batch_shapes = batch_shapes
        self.packing = packing
        self._shard_size = shard_size
        self._final_state: dict[str, Any] | None = None  # set once exhausted
        _LIVE_ITERATORS.add(self)

    def __next__(self) -> Batch:
        try:
            return next(self._parent)
        except StopIteration:
            # A prefetcher never publishes the state after the end; read it from the source,
            # which is idle now, so that stats() counts the dropped remainder.
            self._final_state = copy.deepcopy(self._batches.get_state())
            raise

    def _pipeline_state(self) -> dict[str, Any]:
        if self._final_state is not None:
            return self._final_state
        return self._parent.get_state()  # as of the last batch returned, even with prefetch

    def get_state(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "fingerprint": copy.deepcopy(self._fingerprint),
            "pipeline": copy.deepcopy(self._pipeline_state()),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"Unknown train iterator state version {state.get('version')}.")
        theirs = state["fingerprint"]
        diff = {k: (theirs.get(k), v) for k, v in self._fingerprint.items() if theirs.get(k) != v}
        if diff:
            raise ValueError(f"State is from a different pipeline, (saved, now): {diff}")
        self._final_state = None
        self._parent.set_state(copy.deepcopy(state["pipeline"]))

    @property
    def shard_size(self) -> int:
        """The records of one pass over this iterator's shard."""
        return self._shard_size

    def position(self) -> int:
        """The next position in the shard's stream (after the last batch returned)."""
        return int(self._pipeline_state()["examples"]["next_index"])

    def stats(self) -> dict[str, int]:
        """Example counts since the start of training (see the module docstring)."""
        state = self._pipeline_state()
        counts = dict(state["examples"]["tx_counts"])
        counts["dropped_remainder"] = state["dropped_remainder"]
        counts["epoch"] = state["examples"]["next_index"] // self._shard_size
        return counts


def process_shard(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    """(process_index, process_count) of the shard [process_index::process_count] to read.

    A None is filled in from jax.process_index() / jax.process_count(); ValueError unless
    0 <= process_index < process_count.
    """
    if process_index is None or process_count is None:
        import jax  # only needed for the defaults

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count}).")
    return process_index, process_count


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """How a train iterator filters, shuffles, shards and batches (module docstring).

    Built once and passed to `make_train_iterator`, `make_lm_train_iterator` or
    `mixture.make_mixture_train_iterator`. Every field but `cache_tokens` and `prefetch` goes
    into the iterator state's fingerprint: a state restores only with the same options.
    """

    # Most ids per side, EOS (and a source prefix) included; longer examples are dropped.
    max_len: int
    # Padded positions per side that a batch may hold: B * L <= tokens_per_batch.
    tokens_per_batch: int
    # B is a multiple of this (the number of local devices), so batches split evenly.
    batch_multiple: int = 1
    # Sorted bucket lengths ending at max_len; None: `batching.default_bucket_boundaries`.
    bucket_boundaries: Sequence[int] | None = None
    # Pack several examples per row of length max_len instead of bucketing them by length.
    packing: bool = False
    # Shuffle seed; epoch e is shuffled with seed + e, so every epoch has another order.
    seed: int = 0
    # The input shard read (data.input_shards): examples [process_index::process_count]; None:
    # jax.process_index(), one shard a process.
    process_index: int | None = None
    # How many shards the examples are split into; None: jax.process_count().
    process_count: int | None = None
    # None repeats forever; else the iterator ends after that many passes over the shard.
    num_epochs: int | None = None
    # Keep each tokenized example in memory after its first read; off for corpora too big.
    cache_tokens: bool = True
    # Batches prepared ahead in a background thread (0: none); async dispatch usually hides
    # building a batch behind the device step already, and prefetch copies the state per batch.
    prefetch: int = 0


# Options that do not change the batches, so a state restores whatever they are; the
# fingerprint holds the batch shapes that batch_multiple gives instead of the device count
# behind it, so a state restores on any topology with the same shapes.
_NOT_IN_FINGERPRINT = ("cache_tokens", "prefetch", "batch_multiple")


def shard_records(
    items: Sequence[Any],
    keys: tuple[str, ...],
    tokenizer: Tokenizer,
    options: TrainOptions,
    shard: tuple[int, int],
    source_prefix: Sequence[int] = (),
    target_prefix: Sequence[int] = (),
) -> grain.MapDataset:
    """The featurized records of this process's shard of `items` (an error if it is empty).

    Args:
      items: random-access examples for `Featurizer` (texts, or tuples of texts per `keys`).
      keys: the feature keys, ('inputs', 'targets') or ('targets',).
      tokenizer: turns text into ids.
      options: max_len and cache_tokens are read.
      shard: (process_index, process_count) from `process_shard`.
      source_prefix: ids put before every 'inputs' (a language tag).
      target_prefix: ids put before every 'targets' (an M2M100/NLLB target-language token).

    Returns:
      A MapDataset of len(items[process_index::process_count]) `Record`s, memoized when
      `options.cache_tokens`; index it modulo its length.
    """
    pi, pc = shard
    featurize = Featurizer(
        tokenizer,
        keys,
        options.max_len,
        source_prefix=tuple(source_prefix),
        target_prefix=tuple(target_prefix),
    )
    records = _ShardRecords(items, slice(pi, None, pc), featurize, options.cache_tokens)
    if len(records) == 0:
        raise ValueError(f"Process {pi} of {pc} has no examples ({len(items)} in total).")
    return records


def batch_shapes(options: TrainOptions) -> tuple[tuple[int, int], ...]:
    """Every (B, L) a train batch of `options` can have, smallest L first (module docstring)."""
    o = options
    boundaries = [o.max_len] if o.packing else check_boundaries(o.bucket_boundaries, o.max_len)
    sizes = bucket_batch_sizes(boundaries, o.tokens_per_batch, o.batch_multiple)
    return tuple(zip(sizes, boundaries))


def batch_keys(keys: Sequence[str], packing: bool) -> tuple[str, ...]:
    """The arrays of a train batch over feature `keys`: with packing also each key's
    segmentation and position (module docstring)."""
    if not packing:
        return tuple(keys)
    return tuple(f"{k}{suffix}" for k in keys for suffix in ("", "_segmentation", "_position"))


def batch_iterator(
    kept: grain.IterDataset,
    keys: tuple[str, ...],
    tokenizer: Tokenizer,
    options: TrainOptions,
    shard: tuple[int, int],
    *,
    num_examples: int,
    shard_size: int,
    fingerprint_extra: dict[str, Any] | None = None,
) -> TrainIterator:
    """A stream of kept (position, features) examples -> a TrainIterator of batches.

    Args:
      kept: iterates like `ExampleIterator` (features: key -> int32 [<= max_len]) and can
        `reread(position)`; mixture.py's sampler does too.
      keys: the feature keys of every example and batch.
      tokenizer: its bytes' sha1 goes into the state's fingerprint.
      options: the batching options (`TrainOptions`); the shard is `shard`, not theirs.
      shard: (process_index, process_count) that `kept` reads.
      num_examples: the examples over all shards (in the fingerprint).
      shard_size: what one epoch of `stats()['epoch']` counts.
      fingerprint_extra: more fingerprint entries (a source prefix, a mixture).

    Returns:
      A TrainIterator of [B, L] int32 batches (module docstring).
    """
    pi, pc = shard
    o = options
    shapes = batch_shapes(o)
    boundaries, sizes = [n for _, n in shapes], [b for b, _ in shapes]
    if pc > 1 and len(boundaries) > 1:
        logging.warning("Length buckets differ across %d processes; see pipeline.py.", pc)
    spec = BatchSpec(keys, tuple(boundaries), tuple(sizes), o.packing)
    ds = GroupIterDataset(kept, spec)
    fingerprint = dataclasses.asdict(o) | {
        "bucket_boundaries": boundaries,
        "process_index": pi,
        "process_count": pc,
        "num_examples": num_examples,
        "keys": list(keys),
        "tokenizer_sha1": hashlib.sha1(tokenizer.to_bytes()).hexdigest(),
        **(fingerprint_extra or {}),
    }
    for k in _NOT_IN_FINGERPRINT:
        fingerprint.pop(k)
    fingerprint["batch_shapes"] = [list(x) for x in shapes]
    return TrainIterator(
        ds,
        prefetch=o.prefetch,
        fingerprint=fingerprint,
        keys=keys,
        batch_shapes=shapes,
        packing=o.packing,
        shard_size=shard_size,
    )


def _train_iterator(
    items: Sequence[Any],
    keys: tuple[str, ...],
    tokenizer: Tokenizer,
    options: TrainOptions,
    source_prefix: Sequence[int] = (),
    target_prefix: Sequence[int] = (),
) -> TrainIterator:
    """Shared builder for the translation and LM train iterators."""
    shard = process_shard(options.process_index, options.process_count)
    records = shard_records(items, keys, tokenizer, options, shard, source_prefix, target_prefix)
    kept = _ExampleIterDataset(records, options.seed, options.num_epochs)
    # Only when set: the fingerprints of untagged runs stay what their checkpoints hold.
    prefixes = {"source_prefix": source_prefix, "target_prefix": target_prefix}
    extra = {k: [int(i) for i in v] for k, v in prefixes.items() if v} or None
    counts = dict(num_examples=len(items), shard_size=len(records))
    return batch_iterator(kept, keys, tokenizer, options, shard, **counts, fingerprint_extra=extra)


def make_train_iterator(
    pairs: Sequence[tuple[Text, Text]],
    tokenizer: Tokenizer,
    options: TrainOptions,
    *,
    source_prefix: Sequence[int] = (),
    target_prefix: Sequence[int] = (),
) -> TrainIterator:
    """Translation train batches ('inputs', 'targets'; see the module docstring).

    Args:
      pairs: random-access (source, target) texts, str or UTF-8 bytes.
      tokenizer: joint-vocabulary tokenizer (pad 0, EOS appended to both sides).
      options: batching, shuffling and sharding (`TrainOptions`).
      source_prefix: ids put before every source's pieces (e.g. the target-language tag of a
        multilingual model, `[tokenizer.piece_to_id('<2de>')]`); they count toward max_len.
      target_prefix: ids put before every target's pieces (an imported M2M100/NLLB model's
        target-language token: the decoder learns to emit it first); they count too.
    """
    keys = ("inputs", "targets")
    return _train_iterator(pairs, keys, tokenizer, options, source_prefix, target_prefix)


def make_lm_train_iterator(
    texts: Sequence[Text], tokenizer: Tokenizer, options: TrainOptions
) -> TrainIterator:
    """Language-model train batches: 'targets' [B, L] (text ids + EOS) only.

    Same options, filtering, state and packing keys as `make_train_iterator`.
    """
    return _train_iterator(texts, ("targets",), tokenizer, options)
