"""A batch's path, step 2: a task's text streams and the order its examples are read in.

Views over splits that copy nothing (a split is read lazily from ArrayRecord files): `Prefix`
(the first N pairs), `Sample` (a seeded uniform sample of N), `Concat`, `SideTexts` (one side
of the pairs, or both, as a language model's texts).

One stream: `ExampleIterator` yields a shard's kept examples as (position, features); position
p reads record shuffle_{seed + p // n}(p % n) (grain's `shuffle(seed).repeat()` order), dropped
records skipped and counted.

Weighted streams (directions, real + back-translated pairs): kept example k comes from stream i
with probability p_i (`mixture_probabilities`: uniform, or temperature n_i^(1/T) / sum_j
n_j^(1/T)), drawn seeded with (seed, k // 4096): the same on every process. Each stream reads
its own `ExampleIterator` (without replacement whatever its share); the state adds each
stream's ('corpora'), the counts 'kept/<name>'.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import numpy as np
from grain.experimental import index_shuffle

from tx_jax.data.features import Record

# Items read per batch when a view is iterated (TranslationSource.__getitems__ reads them in
# one call to the ArrayRecord data source).
_READ_CHUNK = 1024


class LazySequence(Sequence):
    """A read-only view that copies nothing: a subclass gives `__len__` and `item_at` (and
    `__getitems__` when it reads in batches); this adds negative indices, slices (as lists),
    IndexError and iteration in chunks of _READ_CHUNK."""

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

    def __getitems__(self, indices: Sequence[int]) -> list:
        return [self.item_at(i) for i in indices]

    def __iter__(self) -> Iterator:
        for start in range(0, len(self), _READ_CHUNK):
            yield from self.__getitems__(range(start, min(start + _READ_CHUNK, len(self))))


def read_items(seq: Sequence, indices: Sequence[int]) -> list:
    """`seq`'s items at `indices` (valid, non-negative), in one `__getitems__` call when
    `seq` has one (a TranslationSource, a view), else one by one."""
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


class Sample(LazySequence):
    """`n` distinct items of a sequence drawn uniformly (seeded), in the sequence's order (all
    of it when `n` is None or at least its length); only the indices are held."""

    def __init__(self, seq: Sequence, n: int | None, seed: int):
        total = len(seq)
        if n is not None and n < 0:
            raise ValueError(f"Sample: n={n}; expected n >= 0 or None")
        self._seq = seq
        self.indices = np.arange(total, dtype=np.int64)  # the sequence's indices read, sorted
        if n is not None and n < total:
            rng = np.random.default_rng(seed)
            self.indices = np.sort(rng.choice(total, size=n, replace=False, shuffle=False))

    def __len__(self) -> int:
        return len(self.indices)

    def item_at(self, i: int):
        return self._seq[int(self.indices[i])]

    def __getitems__(self, indices: Sequence[int]) -> list:
        return read_items(self._seq, self.indices[list(indices)].tolist())


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


LM_SIDES = ("target", "source", "both")


class SideTexts(LazySequence):
    """One side of a sequence of pairs as a sequence of texts ('both': source, target of
    pair 0, then of pair 1, ...), read lazily."""

    def __init__(self, pairs: Sequence[tuple[str, str]], side: str):
        if side not in LM_SIDES:
            raise ValueError(f"data.lm_side={side!r}; expected one of {LM_SIDES}")
        self._pairs, self._side = pairs, side

    def __len__(self) -> int:
        return len(self._pairs) * (2 if self._side == "both" else 1)

    def item_at(self, i: int) -> str:
        if self._side == "both":
            return self._pairs[i // 2][i % 2]
        return self._pairs[i][0 if self._side == "source" else 1]


# ------------------------------------------------------------------------ one stream

_DROPS = ("dropped_empty", "dropped_too_long", "dropped_too_long_chars")
_COUNT_KEYS = ("examples", "kept", *_DROPS, "invalid_utf8")


def _record_at(records: grain.MapDataset, n: int, seed: int, position: int) -> Record:
    """Record at stream `position`: epoch e = position // n is shuffled with seed + e, as
    grain's `records.shuffle(seed).repeat()` would without two more layers' overhead."""
    epoch, i = divmod(position, n)  # n = len(records)
    if n > 1:
        i = index_shuffle(i, n - 1, (seed + epoch) % 2**32, 4)
    return records[i]


class StreamDataset(grain.IterDataset):
    """The IterDataset whose iterator is `make(*args)`: an `ExampleIterator` (one stream) or a
    `MixtureIterator` (weighted streams)."""

    def __init__(self, make: type[grain.DatasetIterator], *args: Any):
        super().__init__()
        self._make, self._args = make, args

    def __iter__(self) -> grain.DatasetIterator:
        return self._make(*self._args)


class ExampleIterator(grain.DatasetIterator):
    """(position, features) of one shard's kept `Record`s, shuffled per epoch. State:
    {'next_index', 'tx_counts'}; `reread(p)` gives position p's features again (restore)."""

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


# ------------------------------------------------------------------------ weighted streams

MIXTURES = ("uniform", "temperature")
_BLOCK = 4096  # stream positions whose corpora are drawn at once


def mixture_probabilities(
    sizes: Sequence[int], mixture: str, temperature: float = 1.0
) -> list[float]:
    """Sampling probability of each corpus (module docstring); sizes are pair counts."""
    if mixture not in MIXTURES:
        raise ValueError(f"data.mixture={mixture!r}; expected one of {MIXTURES}")
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"every corpus of a mixture needs pairs; sizes {list(sizes)}")
    if mixture == "uniform":
        return [1.0 / len(sizes)] * len(sizes)
    if not temperature > 0:
        raise ValueError(f"data.temperature={temperature} must be positive")
    # n^(1/T) in log space: large corpora and small T stay finite.
    logs = [math.log(n) / temperature for n in sizes]
    top = max(logs)
    weights = [math.exp(x - top) for x in logs]
    return [w / sum(weights) for w in weights]


class MixtureIterator(grain.DatasetIterator):
    """(position, features) of kept examples, corpus i drawn with probability p_i."""

    def __init__(self, records, probs, seed: int, names: Sequence[str]):
        super().__init__()
        self._corpora = [
            ExampleIterator(r, int(np.random.SeedSequence([seed, i]).generate_state(1)[0]), None)
            for i, r in enumerate(records)
        ]
        self._cdf = np.cumsum(np.asarray(probs, np.float64))
        self._cdf[-1] = 1.0
        self._seed, self._names = seed, list(names)
        self._next_index = 0
        self._block: tuple[int, np.ndarray] | None = None

    def corpus_at(self, k: int) -> int:
        """The corpus of mixed-stream position k (a pure function of seed and k)."""
        b, j = divmod(k, _BLOCK)
        if self._block is None or self._block[0] != b:
            u = np.random.default_rng([self._seed, 0x6D6978, b]).random(_BLOCK)
            which = np.searchsorted(self._cdf, u, side="right")
            self._block = (b, np.minimum(which, len(self._corpora) - 1))
        return int(self._block[1][j])

    def __next__(self) -> tuple[int, dict[str, np.ndarray]]:
        i = self.corpus_at(self._next_index)
        position, features = next(self._corpora[i])
        self._next_index += 1
        return position * len(self._corpora) + i, features

    def reread(self, position: int) -> dict[str, np.ndarray]:
        p, i = divmod(position, len(self._corpora))
        return self._corpora[i].reread(p)

    def get_state(self) -> dict[str, Any]:
        states = [c.get_state() for c in self._corpora]
        counts: dict[str, int] = {}
        for state in states:
            for key, n in state["tx_counts"].items():
                counts[key] = counts.get(key, 0) + n
        for name, state in zip(self._names, states):
            counts[f"kept/{name}"] = state["tx_counts"]["kept"]
        return {"next_index": self._next_index, "tx_counts": counts, "corpora": states}

    def set_state(self, state: dict[str, Any]) -> None:
        if len(state["corpora"]) != len(self._corpora):
            raise ValueError(f"state of {len(state['corpora'])} corpora, not {len(self._corpora)}")
        self._next_index = int(state["next_index"])
        for corpus, s in zip(self._corpora, state["corpora"]):
            corpus.set_state(s)
