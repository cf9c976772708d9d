"""Token lengths of a task's splits: what `data.max_train_len` drops, `data.max_eval_len` cuts.

    stats = train_lengths(task)              a uniform sample of the train pairs, tokenized
    stats.dropped(max_len)                   (pairs over max_len, share) of that sample
    stats.percentile(99)                     99th percentile of a pair's longer side, in ids
    evals = eval_lengths(task, ['validation', 'test'])

A pair's length is its longer side in ids as the train stream counts it (prefix and EOS
included); up to `SAMPLE` train pairs stand for the split, evaluation splits are read whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tx_jax.data.streams import Sample

# Train pairs tokenized to estimate lengths: the percentile's standard error at this size is
# well under one token for sentence-level corpora, and tokenizing them takes about a second.
SAMPLE = 50_000


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Per-pair lengths in ids (EOS and prefixes included) of `sampled` of `total` pairs."""

    source: np.ndarray  # int [n]
    target: np.ndarray  # int [n]
    total: int  # pairs in the split (the sample stands for them)

    @property
    def sampled(self) -> int:
        return len(self.source)

    @property
    def exact(self) -> bool:
        """Whether every pair was tokenized (a count is exact, not estimated)."""
        return self.sampled >= self.total

    def percentile(self, q: float) -> int:
        """The q-th percentile of a pair's longer side, rounded up to a whole id."""
        longer = np.maximum(self.source, self.target)
        return int(np.ceil(np.percentile(longer, q))) if self.sampled else 0

    def dropped(self, max_len: int) -> tuple[int, float]:
        """(pairs, share) with a side over `max_len` ids (train drops them), to scale."""
        return self._over(np.maximum(self.source, self.target), max_len)

    def truncated(self, max_len: int) -> tuple[int, float]:
        """(sources, share) over `max_len` ids: what evaluation truncates."""
        return self._over(self.source, max_len)

    def _over(self, lengths: np.ndarray, max_len: int) -> tuple[int, float]:
        share = float(np.mean(lengths > max_len)) if self.sampled else 0.0
        return round(share * self.total), share


def measure(task, pairs: Sequence[tuple[str, str]], total: int | None = None) -> Lengths:
    """Lengths of `pairs` as `task` (its tokenizer and prefixes) turns them into ids."""
    tok = task.tokenizer
    sources = tok.encode_batch([s for s, _ in pairs]) if len(pairs) else []
    targets = [tok.encode_target(t) for _, t in pairs]
    extra_s, extra_t = len(task.source_prefix) + 1, len(task.target_prefix) + 1  # + EOS
    return Lengths(
        np.array([len(s) + extra_s for s in sources], dtype=np.int64),
        np.array([len(t) + extra_t for t in targets], dtype=np.int64),
        len(pairs) if total is None else total,
    )


def train_lengths(task, seed: int, sample: int = SAMPLE) -> Lengths:
    """Lengths of up to `sample` train pairs drawn uniformly (seeded) from the whole split."""
    pairs = task.train_pairs()
    return measure(task, Sample(pairs, sample, seed), total=len(pairs))


def eval_lengths(task, splits: Sequence[str]) -> dict[str, Lengths]:
    """Lengths of every pair of each of `splits` the task has, by the split's name."""
    out = {}
    for split in splits:
        try:
            pairs = task.pairs(split)
        except (ValueError, FileNotFoundError):  # a test split is optional
            continue
        out[task.split_name(split)] = measure(task, pairs)
    return out


def describe_train(lengths: Lengths, max_len: int) -> str:
    """'train: data.max_train_len=48 drops 21 of 29,000 pairs (0.07%)', '~' when estimated."""
    n, share = lengths.dropped(max_len)
    how = "" if lengths.exact else f", estimated from {lengths.sampled:,} sampled"
    approx = "" if lengths.exact else "~"
    return (
        f"train: data.max_train_len={max_len} drops {approx}{n:,} of {lengths.total:,} pairs "
        f"({share:.2%}{how})"
    )


def describe_eval(evals: dict[str, Lengths], max_eval_len: int) -> str | None:
    """'evaluation: data.max_eval_len=72 truncates 0 of 1,014 validation sources (0.00%), ...'"""
    if not evals:
        return None
    parts = []
    for split, lengths in evals.items():
        n, share = lengths.truncated(max_eval_len)
        parts.append(f"{n:,} of {lengths.total:,} {split} sources ({share:.2%})")
    return f"evaluation: data.max_eval_len={max_eval_len} truncates " + ", ".join(parts)
