"""A translation task: one direction of a dataset, with its tokenizer, as batches.

    task = prepare_translation_task(config.data, workdir, seed=config.seed)
    task.train_iterator(n, spans)              this process's rows of the global batches
    task.eval_batches('validation', n)         every example once, static shapes
    task.pairs('test')                          raw (source, reference) text pairs

A task is built whole, from its data config and its tokenizer (any object with the Tokenizer
interface); `prepare_translation_task` finds the tokenizer first (given, loaded from the
workdir, or trained on a uniform sample of the train split: run_tokenizer.py), then builds
the task. The other
tasks read the same way: lm_task.py (one side of the pairs, task='lm'), directions.py
(several tagged directions in one model). Which pairs train and how they are batched and
sharded over processes: shards.py; datasets by name: datasets.py.

Validation loss batches are per-process shards (their sums are reduced over all devices);
decoding for BLEU runs the same examples on every process (`shard_eval=False`), since the
parameters it reads are spread over all of them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from etils import epath

from tx_jax.data import datasets, eval_pipeline, preparation, shards
from tx_jax.data.run_tokenizer import load_or_train_tokenizer, tokenizer_options
from tx_jax.data.shards import kept_train_pairs, sharded_train_iterator
from tx_jax.data.streams import Prefix, Sample
from tx_jax.data.tokenizer import Tokenizer, iter_pair_texts


@dataclasses.dataclass
class TranslationTask:
    data: Any  # config.data
    tokenizer: Tokenizer
    seed: int
    # The splits opened so far, by name (filled as they are read; a copy made by
    # dataclasses.replace shares it)
    splits: dict[str, datasets.TranslationSource] = dataclasses.field(default_factory=dict)
    # False: eval_batches gives every process all the examples (decoding with parameters
    # sharded over several processes runs the same batches everywhere)
    shard_eval: bool = True
    # A multilingual model's target-language tag ('<2de>'): its id goes before every source
    # (train and eval), so the pairs themselves stay plain text; '' for none.
    tag: str = ""
    # (source prefix, target prefix) given whole, e.g. evaluate's --source_lang/--target_lang
    # through inference/languages.prefixes; None: from the tag or the data languages.
    prefixes: tuple[Sequence[int], Sequence[int]] | None = None

    @functools.cached_property
    def _prefixes(self) -> tuple[list[int], list[int]]:
        if self.prefixes is not None:
            return [int(i) for i in self.prefixes[0]], [int(i) for i in self.prefixes[1]]
        if self.tag:
            return [self.tokenizer.piece_to_id(self.tag)], []
        # An imported model's language tokens (M2M100/NLLB: [__en__] before the source and
        # [__de__] first in the target, as its translations are forced to start); the
        # tokenizer's own methods, which translate and score use too, so all agree.
        src, tgt = self.data.get("source_lang"), self.data.get("target_lang")
        try:
            return self.tokenizer.source_prefix(src, tgt), self.tokenizer.target_prefix(tgt)
        except ValueError as e:
            raise ValueError(f"data.source_lang={src!r}, data.target_lang={tgt!r}: {e}") from None

    @property
    def source_prefix(self) -> list[int]:
        """The ids put before every source: [id of the tag], an imported model's source
        language token (M2M100/NLLB) or target token (multi-target Marian), or none."""
        return self._prefixes[0]

    @property
    def target_prefix(self) -> list[int]:
        """The ids put before every target's pieces, which decoding forces first: an
        imported M2M100/NLLB model's target-language token, or none."""
        return self._prefixes[1]

    def split_name(self, split: str) -> str:
        """'validation' / 'test' are aliases for the config's eval_split / test_split."""
        return {"validation": self.data.eval_split, "test": self.data.test_split}.get(split, split)

    def source(self, split: str) -> datasets.TranslationSource:
        name = self.split_name(split)
        if name not in self.splits:
            self.splits[name] = datasets.load_split(self.data, name)
        return self.splits[name]

    def train_pairs(self) -> Sequence[tuple[str, str]]:
        """The train split, cut to its first `data.max_train_pairs` pairs when that is set."""
        return kept_train_pairs(self.data, self.source("train"))

    def pairs(self, split: str, limit: int | None = None) -> Sequence[tuple[str, str]]:
        pairs = self.train_pairs() if self.split_name(split) == "train" else self.source(split)
        return Prefix(pairs, limit)

    def train_iterator(
        self, batch_multiple: int, spans: Sequence[shards.Span] | None = None
    ) -> shards.ShardedTrainIterator:
        """This process's rows (`spans`; None: all) of the global batches, whose rows are a
        multiple of `batch_multiple` (shards.py)."""
        build = functools.partial(
            shards.make_train_iterator,
            self.train_pairs(),
            self.tokenizer,
            source_prefix=self.source_prefix,
            target_prefix=self.target_prefix,
        )
        return sharded_train_iterator(self.data, self.seed, build, batch_multiple, spans)

    def eval_batches(
        self, split: str, batch_multiple: int, limit: int | None = None, *, one_shape=False
    ):
        """This process's share of the examples (every example when `shard_eval` is False):
        sorted by length and padded to the eval buckets, for decoding (a sentence's output
        limit is its own, so padding changes no hypothesis, and short batches decode in a
        fraction of the time); `one_shape`: in corpus order, all padded to max_eval_len, for
        the teacher-forced loss (one program to compile, and its cost is small)."""
        d = self.data
        every = {} if self.shard_eval else {"process_index": 0, "process_count": 1}
        if one_shape:
            shapes = dict(bucket_boundaries=[d.max_eval_len])
        else:
            buckets = eval_pipeline.eval_bucket_boundaries(
                d.max_eval_len, d.get("eval_bucket_boundaries")
            )
            shapes = dict(bucket_boundaries=buckets, sort_by_length=True)
        return eval_pipeline.make_eval_batches(
            self.pairs(split, limit),
            self.tokenizer,
            max_len=d.max_eval_len,
            batch_size=d.eval_batch_size,
            batch_multiple=batch_multiple,
            source_prefix=self.source_prefix,
            target_prefix=self.target_prefix,
            **shapes,
            **every,
        )


def prepare_translation_task(
    data: Any,
    workdir: str | epath.Path,
    *,
    seed: int,
    tokenizer: Tokenizer | None = None,
    symbols: Sequence[str] = (),
) -> TranslationTask:
    """Splits and tokenizer of one language pair; `tokenizer`, when given (another run's, for
    `train.init_from`), is used and saved as WORKDIR/tokenizer.model instead of training one
    (data.tokenizer's options) on both sides of `data.tokenizer_pairs` train pairs drawn
    uniformly over the whole split with `seed` (all of them when the split has no more; with
    `symbols`, e.g. the back-translation tag, as single pieces)."""
    tokenizer_options(data)  # a bad option fails before the data is prepared
    workdir = epath.Path(workdir)
    (train,) = preparation.open_train_splits([data], workdir)
    pairs = Sample(kept_train_pairs(data, train), data.tokenizer_pairs, seed)
    tok = load_or_train_tokenizer(
        data,
        workdir,
        lambda: iter_pair_texts(pairs),
        given=tokenizer,
        given_by="train.init_from",
        symbols=symbols,
    )
    return TranslationTask(data, tok, seed, splits={"train": train})
