"""A batch's path, step 4: kept examples -> static-shape batches, with exact, JSON-able state.

Letters: B batch rows, L padded length. A stream of (position, features) examples
(streams.py) is grouped into batches, dicts of numpy int32:

    bucketed (packing=False)
      'inputs'   [B, L]  source ids + EOS, then 0 (padding)      (absent for LM)
      'targets'  [B, L]  target ids + EOS, then 0
      'inputs' and 'targets' share one L, the bucket boundary that holds the longer side
      (`default_bucket_boundaries`); B = floor(tokens_per_batch / L) rounded down to a
      multiple of `batch_multiple`, so B * L <= tokens_per_batch and only len(boundaries)
      shapes exist (`TrainIterator.batch_shapes`): each bucket is a single jit shape.
    packed (packing=True), L = max_len, B = floor(tokens_per_batch / max_len) rounded down
      'inputs', 'targets'                            [B, L]  several examples per row
      'inputs_segmentation', 'targets_segmentation'  [B, L]  1, 2, 3... per example, 0 = pad
      'inputs_position', 'targets_position'          [B, L]  0-based, restarting per example
      Rows are filled first-fit in stream order; an example never spans two rows.

`TrainIterator.stats()` counts since the start of training: 'examples' read, 'kept',
'dropped_empty' / '_too_long' / '_too_long_chars', 'invalid_utf8' (repaired, kept),
'dropped_remainder' (partial buckets when a finite `num_epochs` ends), 'epoch' (of the shard).
Its JSON state is {'version': 1, 'fingerprint': {options, batch shapes, tokenizer_sha1, ...},
'pipeline': {'examples', 'held': [positions waiting per bucket], 'dropped_remainder'}}:
`set_state` re-reads the held positions, so the same groups form; another fingerprint is a
ValueError.
"""

from __future__ import annotations

import atexit
import bisect
import copy
import dataclasses
import hashlib
import logging
import math
import weakref
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from tx_jax.data.tokenizer import Tokenizer

Batch = dict[str, np.ndarray]

# ------------------------------------------------------------------------ shapes


def default_bucket_boundaries(
    max_len: int, *, min_length: int = 8, growth: float = 1.25, multiple: int = 8
) -> list[int]:
    """Geometric bucket lengths, rounded up to `multiple`, ending at `max_len` (256: 13)."""
    out = [min(max_len, multiple * math.ceil(min_length / multiple))]
    while out[-1] < max_len:
        nxt = multiple * math.ceil(out[-1] * growth / multiple)
        out.append(min(max_len, max(nxt, out[-1] + multiple)))
    return out


def bucket_batch_sizes(
    boundaries: Sequence[int], tokens_per_batch: int, batch_multiple: int = 1
) -> list[int]:
    """Rows per bucket: floor(tokens_per_batch / L) rounded down to `batch_multiple`."""
    sizes = [
        (tokens_per_batch // length) // batch_multiple * batch_multiple for length in boundaries
    ]
    if min(sizes) < 1:
        raise ValueError(
            f"tokens_per_batch={tokens_per_batch} is too small for length {max(boundaries)} and"
            f" batch_multiple={batch_multiple}: need at least {max(boundaries) * batch_multiple}."
        )
    return sizes


def check_boundaries(boundaries: Sequence[int] | None, max_len: int) -> list[int]:
    if boundaries is None:
        return default_bucket_boundaries(max_len)
    out = sorted(int(b) for b in boundaries)
    if out[-1] != max_len or out[0] < 1 or len(set(out)) != len(out):
        raise ValueError(f"bucket_boundaries must be distinct, >= 1, end at max_len: {out}")
    return out


def pad_rows(features: Sequence[dict[str, np.ndarray]], keys, rows: int, length: int) -> Batch:
    """Stacks 1-D id arrays into zero-padded int32 [rows, length] arrays, one per key."""
    out = {k: np.zeros((rows, length), np.int32) for k in keys}
    for r, feats in enumerate(features):
        for k in keys:
            v = feats[k]
            out[k][r, : len(v)] = v
    return out


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """How a train iterator filters, shuffles, shards and batches (all but three fingerprinted)."""

    max_len: int  # most ids per side, EOS and a prefix included; longer examples are dropped
    tokens_per_batch: int  # padded positions per side a batch may hold: B * L <= this
    batch_multiple: int = 1  # B is a multiple of this (the local devices): batches split evenly
    bucket_boundaries: Sequence[int] | None = None  # ending at max_len; None: the default ones
    packing: bool = False  # rows of max_len packed with examples instead of length buckets
    seed: int = 0  # epoch e is shuffled with seed + e: every epoch has another order
    # the input shard read: examples [process_index::process_count]; None: jax's process
    process_index: int | None = None
    process_count: int | None = None
    num_epochs: int | None = None  # passes over the shard; None repeats forever
    cache_tokens: bool = True  # keep tokenized examples in memory (off for huge corpora)
    prefetch: int = 0  # batches prepared ahead in a thread (async dispatch mostly hides them)


# Options that do not change the batches (the fingerprint holds the shapes batch_multiple gives).
_NOT_IN_FINGERPRINT = ("cache_tokens", "prefetch", "batch_multiple")


def batch_shapes(options: TrainOptions) -> tuple[tuple[int, int], ...]:
    """Every (B, L) a train batch of `options` can have, smallest L first (module docstring)."""
    o = options
    lengths = [o.max_len] if o.packing else check_boundaries(o.bucket_boundaries, o.max_len)
    return tuple(zip(bucket_batch_sizes(lengths, o.tokens_per_batch, o.batch_multiple), lengths))


def batch_keys(keys: Sequence[str], packing: bool) -> tuple[str, ...]:
    """The arrays of a train batch over feature `keys` (packing adds segmentation, position)."""
    suffixes = ("", "_segmentation", "_position") if packing else ("",)
    return tuple(f"{k}{suffix}" for k in keys for suffix in suffixes)


# ------------------------------------------------------------------------ grouping


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    keys: tuple[str, ...]
    lengths: tuple[int, ...]  # bucket boundaries; (max_len,) when packing
    batch_sizes: tuple[int, ...]  # rows per bucket
    packing: bool


class _GroupIterator(grain.DatasetIterator):
    """Holds examples until a batch is full; its state adds the held positions, re-read and
    re-added in order on restore, which rebuilds the same groups. A subclass gives `_reset`
    and `_add(position, features)` -> a batch when one is complete, else None."""

    def __init__(self, parent: grain.DatasetIterator, spec: BatchSpec):
        super().__init__(parent)
        self._spec = spec
        self._dropped_remainder = 0
        self._reset()

    def _held(self) -> list[list[int]]:  # per group, in the order they were added
        return [[int(p) for p, _ in group] for group in self._groups]

    def __next__(self) -> Batch:
        while True:
            try:
                position, features = next(self._parent)
            except StopIteration:
                self._dropped_remainder += sum(len(g) for g in self._held())
                self._reset()
                raise
            batch = self._add(position, features)
            if batch is not None:
                return batch

    def get_state(self) -> dict[str, Any]:
        return {
            "examples": self._parent.get_state(),
            "held": self._held(),
            "dropped_remainder": self._dropped_remainder,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["examples"])
        self._dropped_remainder = int(state["dropped_remainder"])
        self._reset()
        for group in state["held"]:
            for position in group:
                batch = self._add(position, self._parent.reread(position))
                assert batch is None, "restoring held examples must not complete a batch"


class _BucketIterator(_GroupIterator):
    """One group per bucket; a bucket of length L is emitted when it holds B(L) examples."""

    def _reset(self) -> None:
        self._groups: list[list[tuple[int, dict]]] = [[] for _ in self._spec.lengths]

    def _add(self, position: int, features: dict[str, np.ndarray]) -> Batch | None:
        spec = self._spec
        b = bisect.bisect_left(spec.lengths, max(len(v) for v in features.values()))
        group = self._groups[b]
        group.append((position, features))
        if len(group) < spec.batch_sizes[b]:
            return None
        self._groups[b] = []
        return pad_rows([f for _, f in group], spec.keys, spec.batch_sizes[b], spec.lengths[b])


class _PackIterator(_GroupIterator):
    """First fit into B rows of max_len; emits the rows when an example fits in none."""

    def _reset(self) -> None:
        self._groups = [[]]  # (position, features) of the open batch
        self._rows: list[int] = []  # row of each held example
        self._free = [[self._spec.lengths[0]] * len(self._spec.keys)]  # per used row and key

    def _first_fit(self, lengths: list[int]) -> int | None:
        for r, free in enumerate(self._free):
            if all(n <= f for n, f in zip(lengths, free)):
                return r
        return len(self._free) if len(self._free) < self._spec.batch_sizes[0] else None

    def _add(self, position: int, features: dict[str, np.ndarray]) -> Batch | None:
        lengths = [len(features[k]) for k in self._spec.keys]
        batch = None
        row = self._first_fit(lengths)
        if row is None:
            examples = [f for _, f in self._groups[0]]
            batch = _pack_rows(examples, self._rows, self._spec)
            self._reset()
            row = 0  # every kept example fits an empty row (len <= max_len)
        if row == len(self._free):
            self._free.append([self._spec.lengths[0]] * len(lengths))
        self._free[row] = [f - n for f, n in zip(self._free[row], lengths)]
        self._rows.append(row)
        self._groups[0].append((position, features))
        return batch


def _pack_rows(examples: Sequence[dict], rows: Sequence[int], spec: BatchSpec) -> Batch:
    """Writes examples into their rows: tokens, segmentation (1, 2, ...) and positions."""
    num_rows, length = spec.batch_sizes[0], spec.lengths[0]
    out = {}
    for k in spec.keys:
        for name in (k, f"{k}_segmentation", f"{k}_position"):
            out[name] = np.zeros((num_rows, length), np.int32)
    segments = [0] * num_rows
    fill = {k: [0] * num_rows for k in spec.keys}
    arange = np.arange(length, dtype=np.int32)
    for features, r in zip(examples, rows):
        segments[r] += 1
        for k in spec.keys:
            v = features[k]
            start, end = fill[k][r], fill[k][r] + len(v)
            out[k][r, start:end] = v
            out[f"{k}_segmentation"][r, start:end] = segments[r]
            out[f"{k}_position"][r, start:end] = arange[: len(v)]
            fill[k][r] = end
    return out


# ------------------------------------------------------------------------ the iterator

_STATE_VERSION = 1
_LIVE_ITERATORS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_iterators() -> None:
    """Stops prefetch threads before teardown, where grain's close() would print a traceback."""
    for it in list(_LIVE_ITERATORS):
        it.close()
        todo = [it]
        while todo:
            node = todo.pop()
            node.close = lambda: None
            todo.extend(getattr(node, "_parents", ()))


class TrainIterator(grain.DatasetIterator):
    """Infinite (or `num_epochs`) train batches of `kept` (position, features) examples that
    can `reread(position)`, from shard `shard` (index, count), with exact, JSON-able state;
    `num_examples`, the tokenizer's sha1 and `fingerprint_extra` are fingerprinted,
    `shard_size` is one epoch. `batch_shapes`: every (B, L), smallest L first."""

    def __init__(
        self,
        kept: grain.IterDataset,
        keys: tuple[str, ...],
        tokenizer: Tokenizer,
        options: TrainOptions,
        shard: tuple[int, int],
        *,
        num_examples: int,
        shard_size: int,
        fingerprint_extra: dict[str, Any] | None = None,
    ):
        o, (pi, pc) = options, shard
        self.keys, self.packing, self.shard_size = keys, o.packing, shard_size
        self.batch_shapes = shapes = batch_shapes(o)
        sizes, boundaries = (tuple(x) for x in zip(*shapes))
        if pc > 1 and len(boundaries) > 1:
            logging.warning("Length buckets differ across %d processes; see shards.py.", pc)
        spec = BatchSpec(keys, boundaries, sizes, o.packing)
        group = _PackIterator if o.packing else _BucketIterator
        self._batches = group(kept.__iter__(), spec)
        if o.prefetch > 0:
            prefetcher = grain.experimental.ThreadPrefetchDatasetIterator(self._batches, o.prefetch)
            super().__init__(prefetcher)
        else:
            super().__init__(self._batches)
        fingerprint = dataclasses.asdict(o) | {
            "bucket_boundaries": list(boundaries),
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
        self._fingerprint = fingerprint
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

    def position(self) -> int:
        """The next position in the shard's stream (after the last batch returned)."""
        return int(self._pipeline_state()["examples"]["next_index"])

    def stats(self) -> dict[str, int]:
        """Example counts since the start of training (see the module docstring)."""
        state = self._pipeline_state()
        counts = dict(state["examples"]["tx_counts"])
        counts["dropped_remainder"] = state["dropped_remainder"]
        counts["epoch"] = state["examples"]["next_index"] // self.shard_size
        return counts
