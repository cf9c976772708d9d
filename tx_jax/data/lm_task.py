"""A language-modelling task over one side of a translation dataset (config.task == 'lm').

    task = prepare_lm_task(config.data, workdir, seed=config.seed)
    task.train_iterator(n, spans)              this process's rows of the global batches
    task.eval_batches('validation', n)         every text once, [eval_batch_size, max_eval_len]
    task.texts('test')                         the raw texts

The TranslationTask interface (tasks.py) with 'targets'-only batches (no pairs, no BLEU):
`data.lm_side` picks the side of the pairs ('target', 'source', or 'both': each pair's source
then its target). The tokenizer is trained on that side only, saved as WORKDIR/tokenizer.model
like a translation one (run_tokenizer.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from etils import epath

from tx_jax.config import study_value
from tx_jax.data import eval_pipeline, preparation, run_tokenizer, shards
from tx_jax.data.shards import kept_train_pairs, sharded_train_iterator
from tx_jax.data.streams import LazySequence, Sample
from tx_jax.data.tasks import TranslationTask
from tx_jax.data.tokenizer import Tokenizer

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


@dataclasses.dataclass
class LMTask:
    """A language-modelling task over one side of a translation dataset (`data.lm_side`):
    the TranslationTask interface with 'targets'-only batches (no pairs, no BLEU)."""

    data: Any  # config.data
    tokenizer: Tokenizer
    seed: int
    pair_task: TranslationTask  # the splits it reads
    shard_eval: bool = True

    def texts(self, split: str, limit: int | None = None) -> Sequence[str]:
        return SideTexts(self.pair_task.pairs(split, limit), study_value(self.data, "lm_side"))

    def train_iterator(
        self, batch_multiple: int, spans: Sequence[shards.Span] | None = None
    ) -> shards.ShardedTrainIterator:
        """This process's rows of the global batches of 'targets' (texts + EOS)."""
        build = functools.partial(
            shards.make_lm_train_iterator, self.texts("train"), self.tokenizer
        )
        return sharded_train_iterator(self.data, self.seed, build, batch_multiple, spans)

    def eval_batches(
        self, split: str, batch_multiple: int, limit: int | None = None, *, one_shape=True
    ):
        """This process's share of the texts (all of them when `shard_eval` is False), in
        corpus order, every batch [eval_batch_size, max_eval_len]."""
        d = self.data
        every = {} if self.shard_eval else {"process_index": 0, "process_count": 1}
        return eval_pipeline.make_lm_eval_batches(
            self.texts(split, limit),
            self.tokenizer,
            max_len=d.max_eval_len,
            batch_size=d.eval_batch_size,
            batch_multiple=batch_multiple,
            **every,
        )


def prepare_lm_task(
    data: Any, workdir: str | epath.Path, *, seed: int, tokenizer: Tokenizer | None = None
) -> LMTask:
    """The pairs of `data` read as for translation; the tokenizer is trained on the LM side
    only (`data.lm_side`) of `data.tokenizer_pairs` train pairs drawn uniformly with `seed`
    (all of them when the split has no more) unless `tokenizer` (another run's, for
    `train.init_from`) is given, and saved as WORKDIR/tokenizer.model like a translation one."""
    side = study_value(data, "lm_side")
    if side not in LM_SIDES:
        raise ValueError(f"data.lm_side={side!r}; expected one of {LM_SIDES}")
    run_tokenizer.tokenizer_options(data)  # a bad option fails before the data is prepared
    workdir = epath.Path(workdir)
    (train,) = preparation.open_train_splits([data], workdir)
    pairs = Sample(kept_train_pairs(data, train), data.tokenizer_pairs, seed)
    tok = run_tokenizer.load_or_train_tokenizer(
        data,
        workdir,
        lambda: iter(SideTexts(pairs, side)),
        given=tokenizer,
        given_by="train.init_from",
    )
    pair_task = TranslationTask(data, tok, seed, splits={"train": train})
    return LMTask(data, tok, seed, pair_task)
