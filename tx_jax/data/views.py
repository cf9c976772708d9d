"""Read-only views of sequences that copy nothing: a split cut to its first N pairs
(`Prefix`), several corpora one after another (`Concat`). A split can be millions of
pairs, read lazily from ArrayRecord files; a view reads only the items asked for."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any


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


class Prefix(LazySequence):
    """The first `n` items of a sequence (all of them for None), without copying it."""

    def __init__(self, seq: Sequence, n: int | None):
        self._seq, self._n = seq, len(seq) if n is None else min(n, len(seq))

    def __len__(self) -> int:
        return self._n

    def item_at(self, i: int):
        return self._seq[i]


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
