"""Several corpora sampled into one train stream: the data side of multilingual training.

    probs = mixture_probabilities([29000, 1000], "temperature", temperature=5.0)
    options = TrainOptions(max_len=64, tokens_per_batch=4096, packing=True)
    it = make_mixture_train_iterator({"en-de": pairs_de, "en-fr": pairs_fr}, probs, tokenizer,
                                     options)

Each kept example of the stream comes from corpus i with probability p_i, and batches mix the
corpora (as in Johnson et al., 2017). Probabilities (`mixture_probabilities`), n_i the number
of pairs of corpus i:

    uniform        p_i = 1 / k
    temperature    p_i = n_i^(1/T) / sum_j n_j^(1/T)    (T = 1: proportional to size;
                                                         T -> infinity: uniform)

How a stream position is drawn: the corpus of kept example k is u_k = the k-th uniform number
of a generator seeded with (seed, k // 4096), mapped through the cumulative probabilities:
a pure function of (seed, k), the same on every process. Within a corpus, examples come from
that corpus's own shuffled, repeated stream (pipeline.py's, seeded with (seed, i)), so each
corpus is read without replacement epoch by epoch, whatever its share. A dropped pair (too
long, empty) is skipped inside its corpus, so the corpus shares hold for kept examples.

State: the position in the mixed stream plus each corpus stream's state, e.g.
    {'next_index': 120, 'tx_counts': {'examples': 131, 'kept': 120, ..., 'kept/en-de': 61},
     'corpora': [{'next_index': 70, 'tx_counts': ...}, {...}]}
and the batching layer's held examples as positions `p * k + i` (i the corpus, p its stream
position), re-read on restore: `TrainIterator.set_state` resumes the identical batches.
`stats()` adds 'kept/<name>' (examples drawn per corpus); 'epoch' counts passes over the
combined size.

Input shards: with the options' process_index/process_count each corpus is sharded
[process_index::process_count] and every shard draws the same corpus sequence
(input_shards.py puts the shards' batches together).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from tx_jax.data.featurize import Text
from tx_jax.data.pipeline import (
    ExampleIterator,
    TrainIterator,
    TrainOptions,
    batch_iterator,
    process_shard,
    shard_records,
)
from tx_jax.data.tokenizer import Tokenizer

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


def _corpus_seed(seed: int, i: int) -> int:
    return int(np.random.SeedSequence([seed, i]).generate_state(1)[0])


class _MixtureIterDataset(grain.IterDataset):
    def __init__(self, records, probs: Sequence[float], seed: int, names: Sequence[str]):
        super().__init__()
        self._records, self._probs, self._seed, self._names = records, probs, seed, names

    def __iter__(self) -> _MixtureIterator:
        return _MixtureIterator(self._records, self._probs, self._seed, self._names)


class _MixtureIterator(grain.DatasetIterator):
    """(position, features) of kept examples, corpus i drawn with probability p_i."""

    def __init__(self, records, probs, seed: int, names: Sequence[str]):
        super().__init__()
        self._corpora = [
            ExampleIterator(r, _corpus_seed(seed, i), None) for i, r in enumerate(records)
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


def make_mixture_train_iterator(
    corpora: Mapping[str, Sequence[tuple[Text, Text]]],
    probabilities: Sequence[float],
    tokenizer: Tokenizer,
    options: TrainOptions,
    *,
    source_prefixes: Mapping[str, Sequence[int]] | None = None,
    target_prefixes: Mapping[str, Sequence[int]] | None = None,
) -> TrainIterator:
    """Translation train batches drawn from several corpora; never ends.

    Args:
      corpora: name -> random-access (source, target) pairs, in a fixed order (the state and
        the stream depend on it); e.g. {'en-de': ..., 'de-en': ...}.
      probabilities: one per corpus, in `corpora`'s order (`mixture_probabilities`).
      tokenizer: as for `pipeline.make_train_iterator`.
      options: as for `pipeline.make_train_iterator`, with `num_epochs` None (a mixture
        repeats every corpus forever).
      source_prefixes: name -> ids put before each source of that corpus (the target-language
        tag: {'en-de': [id of '<2de>'], ...}); none for a corpus not named.
      target_prefixes: name -> ids put before each target (an imported M2M100/NLLB model's
        target-language token); none for a corpus not named.
    """
    names = list(corpora)
    probs = [float(p) for p in probabilities]
    if len(probs) != len(names) or min(probs) < 0 or not math.isclose(sum(probs), 1.0):
        raise ValueError(f"probabilities {probs} must be {len(names)} numbers summing to 1")
    if options.num_epochs is not None:
        raise ValueError(
            f"num_epochs={options.num_epochs}: a mixture repeats every corpus forever; use None"
        )
    shard = process_shard(options.process_index, options.process_count)
    keys = ("inputs", "targets")
    prefixes = [[int(i) for i in (source_prefixes or {}).get(n, ())] for n in names]
    targets = [[int(i) for i in (target_prefixes or {}).get(n, ())] for n in names]
    records = [
        shard_records(corpora[n], keys, tokenizer, options, shard, prefix, target)
        for n, prefix, target in zip(names, prefixes, targets)
    ]
    kept = _MixtureIterDataset(records, probs, options.seed, names)
    sizes = [len(corpora[n]) for n in names]
    extra = {
        "mixture": {"names": names, "probabilities": probs, "sizes": sizes, "prefixes": prefixes}
    }
    if any(targets):  # only when set: earlier mixtures' checkpoints keep their fingerprint
        extra["mixture"]["target_prefixes"] = targets
    counts = dict(num_examples=sum(sizes), shard_size=sum(len(r) for r in records))
    return batch_iterator(kept, keys, tokenizer, options, shard, **counts, fingerprint_extra=extra)
