"""Read-only views of sequences that copy nothing: a split cut to its first N pairs
(`Prefix`), a uniform seeded sample of N of its pairs (`Sample`), several corpora one after
another (`Concat`). A split can be millions of pairs, read lazily from ArrayRecord files; a
view reads only the items asked for (in batches where the sequence reads them so)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

# Items read per batch when a view is iterated (TranslationSource.__getitems__ reads them in
# one call to the ArrayRecord data source).
_READ_CHUNK = 1024


class LazySequence(Sequence):
    """A read-only view that copies nothing: a subclass gives `__len__` and `item_at`, this
    adds negative indices, slices (as lists) and IndexError."""

    def item_at(self, i: int) -> Any:
        """The item at 0 <= i < len(self)."""
        raise NotImplementedError

    def __getitem__(self, i):
        n = len(self)
        if isinstance(i, slice):
            return [self.item_at(j) for j in range(*i.indices(n))]
        if not -n <= i < n:
            raise IndexError(i)
        return self.item_at(i % n)


def read_items(seq: Sequence, indices: Sequence[int]) -> list:
    """`seq`'s items at `indices` (valid, non-negative), in one `__getitems__` call when
    `seq` has one (a TranslationSource, a Prefix of one), else one by one."""
    getitems = getattr(seq, "__getitems__", None)
    return list(getitems(indices)) if getitems else [seq[i] for i in indices]


class Prefix(LazySequence):
    """The first `n` items of a sequence (all of them for None), without copying it."""

    def __init__(self, seq: Sequence, n: int | None):
        self._seq, self._n = seq, len(seq) if n is None else min(n, len(seq))

    def __len__(self) -> int:
        return self._n

    def item_at(self, i: int):
        return self._seq[i]

    def __getitems__(self, indices: Sequence[int]) -> list:
        if any(not 0 <= i < self._n for i in indices):
            raise IndexError(f"indices outside [0, {self._n})")
        return read_items(self._seq, indices)

    def __iter__(self) -> Iterator:
        for start in range(0, self._n, _READ_CHUNK):
            yield from read_items(self._seq, range(start, min(start + _READ_CHUNK, self._n)))


class Sample(LazySequence):
    """`n` distinct items of a sequence drawn uniformly at random (a numpy Generator seeded
    with `seed`), kept in the sequence's order; the whole sequence, in its order, when `n` is
    None or at least its length. A corpus that concatenates sub-corpora is sampled over all
    of them, where its first `n` items would be the head's alone. [n] indices are kept (8
    bytes each); the items are read when asked for."""

    def __init__(self, seq: Sequence, n: int | None, seed: int):
        total = len(seq)
        if n is not None and n < 0:
            raise ValueError(f"Sample: n={n}; expected n >= 0 or None")
        self._seq = seq
        self._indices: np.ndarray | None = None  # None: every index, in order
        if n is not None and n < total:
            rng = np.random.default_rng(seed)
            self._indices = np.sort(rng.choice(total, size=n, replace=False, shuffle=False))
        self._n = total if self._indices is None else n

    @property
    def indices(self) -> np.ndarray:
        """The sequence's indices this view reads, increasing: [len(self)] int64."""
        if self._indices is None:
            return np.arange(self._n, dtype=np.int64)
        return self._indices

    def __len__(self) -> int:
        return self._n

    def _at(self, start: int, stop: int) -> list[int]:
        if self._indices is None:
            return list(range(start, stop))
        return self._indices[start:stop].tolist()

    def item_at(self, i: int):
        return self._seq[self._at(i, i + 1)[0]]

    def __iter__(self) -> Iterator:
        for start in range(0, self._n, _READ_CHUNK):
            yield from read_items(self._seq, self._at(start, min(start + _READ_CHUNK, self._n)))


class Concat(LazySequence):
    """Sequences one after another, without copying them."""

    def __init__(self, parts: Sequence[Sequence]):
        self._parts = list(parts)
        self._starts = list(itertools.accumulate((len(p) for p in self._parts), initial=0))

    def __len__(self) -> int:
        return self._starts[-1]

    def item_at(self, i: int):
        k = next(k for k in range(len(self._parts)) if i < self._starts[k + 1])
        return self._parts[k][i - self._starts[k]]
