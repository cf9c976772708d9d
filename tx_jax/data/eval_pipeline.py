"""Eval batches: every example once, in fixed-shape batches, never filtered.

    eval_batches(pairs, ("inputs", "targets"), tokenizer, max_len=..., batch_size=...)
    eval_batches(texts, ("targets",), tokenizer, ...)        language model
    encode_sources(texts, tokenizer, ...)                    sources only (translate)

Letters: B batch rows, L padded length. In corpus order unless `sort_by_length`; long sides are
truncated to max_len keeping the final EOS, empty sides become just EOS; all batches have
B = batch_size:
      'inputs', 'targets'  [B, L]  ids + EOS, then 0 ('inputs' only for `encode_sources`,
                                   'targets' only for the LM)
      'example_index'      [B]     position in `pairs` (global, not per process); -1 = pad row
      'example_mask'       [B]     1 for a real example, 0 for a padding row (all-zero row)

Text becomes ids as in training (`Featurizer`, truncating); process shards are
[process_index::process_count], with as many batches on every process.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tx_jax.data.batches import Batch, check_boundaries, default_bucket_boundaries, pad_rows
from tx_jax.data.features import Featurizer, Text, process_shard
from tx_jax.data.tokenizer import Tokenizer

# Eval buckets grow 1.5x from 16 (16, 24, 40, 64, 96): few shapes to compile, at most a third
# padding; shorter sources fill few batches, which decode faster than a program compiles.
EVAL_BUCKET_GROWTH = 1.5
EVAL_BUCKET_MIN = 16


def eval_bucket_boundaries(max_len: int, configured: Sequence[int] | None = None) -> list[int]:
    """The lengths eval batches are padded to: `configured` (data.eval_bucket_boundaries;
    [max_len] gives one shape), else geometric ones ending at max_len."""
    if configured:
        return check_boundaries(configured, max_len)
    return default_bucket_boundaries(max_len, min_length=EVAL_BUCKET_MIN, growth=EVAL_BUCKET_GROWTH)


@dataclasses.dataclass(frozen=True)
class EvalBatches(Sequence):
    """This process's batches, its real examples, and its counts 'examples', 'empty',
    'truncated', 'invalid_utf8'."""

    batches: list[Batch]
    num_examples: int
    stats: dict[str, int]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        return self.batches[i]


def eval_batches(
    items: Sequence[Any],
    keys: tuple[str, ...],
    tokenizer: Tokenizer,
    *,
    max_len: int,
    batch_size: int,
    batch_multiple: int = 1,
    bucket_boundaries: Sequence[int] | None = None,
    sort_by_length: bool = False,
    process_index: int | None = None,
    process_count: int | None = None,
    source_prefix: Sequence[int] = (),
    target_prefix: Sequence[int] = (),
) -> EvalBatches:
    """Every item (a text, or texts in `keys` order) of this process's shard exactly once.

    L is max_len (longer sides truncated), or with `bucket_boundaries` the smallest boundary
    holding batch b's longest side on any process; `sort_by_length` orders longest first
    (`example_index` restores corpus order). The prefixes are as in training.
    """
    if batch_size < 1 or batch_size % batch_multiple:
        raise ValueError(
            f"batch_size={batch_size} must be a positive multiple of {batch_multiple}."
        )
    pi, pc = process_shard(process_index, process_count)
    boundaries = (
        [max_len] if bucket_boundaries is None else check_boundaries(bucket_boundaries, max_len)
    )
    prefixes = dict(source_prefix=tuple(source_prefix), target_prefix=tuple(target_prefix))
    featurize = Featurizer(tokenizer, keys, max_len, True, **prefixes)
    one_length = len(boundaries) == 1
    # Batch b's length must agree on every process (a step under a global mesh has one
    # shape), so with buckets every shard's order is worked out here from every item.
    shards = [pi] if one_length or pc == 1 else range(pc)
    feats = {i: featurize(items[i]) for p in shards for i in range(p, len(items), pc)}
    lengths = {i: max(len(v) for v in rec.features.values()) for i, rec in feats.items()}
    # the order each shard's batches take its items: corpus order, or longest first (a stable
    # sort: ties keep corpus order)
    key = (lambda i: -lengths[i]) if sort_by_length else (lambda i: 0)
    orders = {p: sorted(range(p, len(items), pc), key=key) for p in shards}
    num_batches = math.ceil(math.ceil(len(items) / pc) / batch_size)  # same on every process
    batches = []
    for b in range(num_batches):
        rows = slice(b * batch_size, (b + 1) * batch_size)
        if one_length:
            length = max_len
        else:
            length = _bucket_length(boundaries, lengths, [order[rows] for order in orders.values()])
        batches.append(_padded_batch(orders[pi][rows], feats, keys, batch_size, length))
    mine = [feats[i] for i in range(pi, len(items), pc)]
    notes = collections.Counter(note for rec in mine for note in rec.notes)
    stats = {"examples": len(mine)} | {k: notes[k] for k in ("empty", "truncated", "invalid_utf8")}
    return EvalBatches(batches, len(mine), stats)


def _bucket_length(
    boundaries: Sequence[int], lengths: dict[int, int], chunks: Sequence[Sequence[int]]
) -> int:
    """L of one batch: the smallest boundary holding its longest item on any shard (`chunks`)."""
    longest = max((lengths[i] for chunk in chunks for i in chunk), default=1)
    return boundaries[bisect.bisect_left(boundaries, longest)]


def _padded_batch(
    chunk: Sequence[int], feats: dict[int, Any], keys: tuple[str, ...], batch_size: int, length: int
) -> Batch:
    """Corpus items `chunk` (`feats`: their records) -> `keys` [B, L], 'example_index' and
    'example_mask' [B] (module docstring)."""
    batch = pad_rows([feats[i].features for i in chunk], keys, batch_size, length)
    batch["example_index"] = np.full((batch_size,), -1, np.int32)
    batch["example_index"][: len(chunk)] = chunk
    batch["example_mask"] = (batch["example_index"] >= 0).astype(np.int32)
    return batch


def encode_sources(texts: Sequence[Text], tokenizer: Tokenizer, **options: Any) -> EvalBatches:
    """Raw source sentences of one process -> 'inputs' [B, L], 'example_index', 'example_mask'
    batches (hypothesis r goes to line example_index[r] where example_mask[r] is 1)."""
    return eval_batches(texts, ("inputs",), tokenizer, process_index=0, process_count=1, **options)
