"""Kept examples -> static-shape batches: length buckets or first-fit packing.

Letters: B batch rows, L padded length. The train pipeline (pipeline.py, mixture.py) feeds a
stream of (position, features) examples into `GroupIterDataset`; the shapes of its batches
are in pipeline.py's module docstring. A group iterator's state is its parent's state plus
the stream positions of the examples it holds (re-read on restore, so the same groups form).

    default_bucket_boundaries(max_len)           geometric bucket lengths ending at max_len
    bucket_batch_sizes(boundaries, tokens, m)    rows per bucket under a token budget
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

Batch = dict[str, np.ndarray]

# ------------------------------------------------------------------------ shapes


def default_bucket_boundaries(
    max_len: int, *, min_length: int = 8, growth: float = 1.25, multiple: int = 8
) -> list[int]:
    """Geometric bucket lengths, rounded up to `multiple`, ending exactly at `max_len`.

    E.g. max_len=256 -> [8, 16, 24, 32, 40, 56, 72, 96, 120, 152, 192, 240, 256]: at most
    ~25% padding per bucket with 13 jit shapes.
    """
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
class BatchSpec:
    keys: tuple[str, ...]
    lengths: tuple[int, ...]  # bucket boundaries; (max_len,) when packing
    batch_sizes: tuple[int, ...]  # rows per bucket
    packing: bool


class GroupIterDataset(grain.IterDataset):
    """Kept examples -> batches: by length bucket, or first-fit packed into rows."""

    def __init__(self, parent: grain.IterDataset, spec: BatchSpec):
        super().__init__(parent)
        self._spec = spec

    def __iter__(self) -> _GroupIterator:
        cls = _PackIterator if self._spec.packing else _BucketIterator
        return cls(self._parent.__iter__(), self._spec)


class _GroupIterator(grain.DatasetIterator):
    """Holds examples until a batch is full. State: stream state + held positions.

    Restoring re-reads the held positions (cached, or re-tokenized) and re-adds them in
    order, which rebuilds the exact same groups.
    """

    def __init__(self, parent: grain.DatasetIterator, spec: BatchSpec):
        super().__init__(parent)
        self._spec = spec
        self._dropped_remainder = 0
        self._reset()

    def _reset(self) -> None:
        raise NotImplementedError

    def _add(self, position: int, features: dict[str, np.ndarray]) -> Batch | None:
        """Adds one example; returns a batch when one is complete."""
        raise NotImplementedError

    def _held(self) -> list[list[int]]:
        """Positions of the examples held, per group, in the order they were added."""
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
