"""The one task type: a direction of a dataset and its tokenizer, trained over weighted streams.

    task = prepare_task(config.data, workdir, seed=config.seed, lm=False)
    task.train_iterator(n, spans)              this process's rows of the global batches
    task.eval_batches('validation', n)         every example once, static shapes
    task.pairs('test')                          raw (source, reference) text pairs

Every kind of run is a `Task`; what differs is its streams and their weights:

    one direction              its train split alone (no weights: the stream of shards.py)
    several directions         one stream per direction, weighted by data.mixture, each
                               source after its <2xx> tag; `directions` holds the direction
                               tasks, which evaluation decodes one by one (directions.py)
    real + back-translated     the train split and each synthetic corpus, weighted by its
                               ratio, tagged sources after <BT> (backtranslation.py)
    language modelling         one side of the pairs (`lm_side`), 'targets' only, no BLEU

`prepare_task` finds the tokenizer (run_tokenizer.py), then builds the task. Validation loss
batches are per-process shards; decoding reads every example on every process (`shard_eval`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

from etils import epath

from tx_jax.config import study_value
from tx_jax.data import backtranslation as bt
from tx_jax.data import datasets, directions, eval_pipeline, preparation, shards, streams
from tx_jax.data.run_tokenizer import TOKENIZER_FILE, load_or_train_tokenizer, tokenizer_options
from tx_jax.data.shards import Stream, kept_train_pairs
from tx_jax.data.streams import Concat, Prefix, Sample, SideTexts
from tx_jax.data.tokenizer import Tokenizer, iter_pair_texts


@dataclasses.dataclass
class Task:
    data: Any  # config.data
    tokenizer: Tokenizer
    seed: int
    # the splits opened so far (a dataclasses.replace copy shares it)
    splits: dict[str, datasets.TranslationSource] = dataclasses.field(default_factory=dict)
    shard_eval: bool = True  # False: every process evaluates every example
    tag: str = ""  # a multilingual model's target tag ('<2de>'), before every source
    # (source, target) prefix ids given whole (evaluate's --source_lang / --target_lang);
    # None: from the tag or the data languages
    prefixes: tuple[Sequence[int], Sequence[int]] | None = None
    # weighted train streams by name, in mixture order; empty: the train split alone
    streams: dict[str, Stream] = dataclasses.field(default_factory=dict)
    # a multilingual task's trained and extra (zero-shot) direction tasks, by name
    directions: dict[str, Task] = dataclasses.field(default_factory=dict)
    extra: dict[str, Task] = dataclasses.field(default_factory=dict)
    lm_side: str = ""  # a language model's side of the pairs (streams.LM_SIDES); '' translates

    @functools.cached_property
    def _prefixes(self) -> tuple[list[int], list[int]]:
        if self.prefixes is not None:
            return [int(i) for i in self.prefixes[0]], [int(i) for i in self.prefixes[1]]
        if self.tag:
            return [self.tokenizer.piece_to_id(self.tag)], []
        # An imported model's language tokens: the tokenizer's methods, as translate and
        # score use them, so all agree.
        src, tgt = self.data.get("source_lang"), self.data.get("target_lang")
        try:
            return self.tokenizer.source_prefix(src, tgt), self.tokenizer.target_prefix(tgt)
        except ValueError as e:
            raise ValueError(f"data.source_lang={src!r}, data.target_lang={tgt!r}: {e}") from None

    @property
    def source_prefix(self) -> list[int]:
        """The ids before every source: the tag's, an imported model's language token, or none."""
        return [] if self.lm_side else self._prefixes[0]

    @property
    def target_prefix(self) -> list[int]:
        """The ids before every target, forced first in decoding (M2M100/NLLB's language)."""
        return [] if self.lm_side else self._prefixes[1]

    @property
    def one_pair(self) -> bool:
        """Whether it translates one language pair: what runner/sizing.py can measure."""
        return not (self.lm_side or self.directions)

    @property
    def bleu_directions(self) -> list[str]:
        """Directions decoded for BLEU: the training ones, then `extra_eval_directions`."""
        return [*self.directions, *self.extra]

    def split_name(self, split: str) -> str:
        """'validation' / 'test' are aliases for the config's eval_split / test_split."""
        return {"validation": self.data.eval_split, "test": self.data.test_split}.get(split, split)

    def direction(self, name: str) -> Task:
        """One direction's task ('de-fr'), built on the fly when not configured."""
        task = self.directions.get(name) or self.extra.get(name)
        if task is None:
            task = direction_task(self.data, self.tokenizer, self.seed, name)
            self.extra[name] = task
        return dataclasses.replace(task, shard_eval=self.shard_eval)

    def source(self, split: str) -> datasets.TranslationSource:
        name = self.split_name(split)
        if name not in self.splits:
            self.splits[name] = datasets.load_split(self.data, name)
        return self.splits[name]

    def train_pairs(self) -> Sequence[tuple[str, str]]:
        """The train split, cut to its first `data.max_train_pairs` pairs when that is set."""
        return kept_train_pairs(self.data, self.source("train"))

    def pairs(self, split: str, limit: int | None = None) -> Sequence[tuple[str, str]]:
        """A split's first `limit` pairs; several directions' one after another."""
        if self.directions:
            return Concat([self.direction(n).pairs(split, limit) for n in self.directions])
        pairs = self.train_pairs() if self.split_name(split) == "train" else self.source(split)
        return Prefix(pairs, limit)

    def texts(self, split: str, limit: int | None = None) -> Sequence[str]:
        """A language model's texts: its side of the pairs (`lm_side`)."""
        return SideTexts(self.pairs(split, limit), self.lm_side)

    def train_iterator(
        self, batch_multiple: int, spans: Sequence[shards.Span] | None = None
    ) -> shards.ShardedTrainIterator:
        """This process's `spans` (None: all) of the global batches (shards.py)."""
        streams = self.streams
        if not streams:
            items = self.texts("train") if self.lm_side else self.train_pairs()
            streams = Stream(items, 1.0, self.source_prefix, self.target_prefix)
        lm = bool(self.lm_side)
        build = functools.partial(shards.make_train_iterator, streams, self.tokenizer, lm=lm)
        options = shards.train_options(self.data, seed=self.seed, batch_multiple=batch_multiple)
        n = int(self.data.get("input_shards", 1))
        return shards.make_sharded_iterator(build, options, input_shards=n, spans=spans)

    def eval_batches(
        self, split: str, batch_multiple: int, limit: int | None = None, *, one_shape=False
    ) -> eval_pipeline.EvalBatches:
        """This process's share of the examples (all unless `shard_eval`), sorted by length
        into the eval buckets (short batches decode fast); `one_shape`: corpus order padded to
        max_eval_len, one program for the loss (a language model's always). Several directions'
        come one after another."""
        if self.directions:
            parts = [
                self.direction(n).eval_batches(split, batch_multiple, limit, one_shape=one_shape)
                for n in self.directions
            ]
            stats = {k: sum(p.stats[k] for p in parts) for k in parts[0].stats}
            batches = [b for p in parts for b in p.batches]
            return eval_pipeline.EvalBatches(batches, sum(p.num_examples for p in parts), stats)
        d, lm = self.data, bool(self.lm_side)
        every = {} if self.shard_eval else {"process_index": 0, "process_count": 1}
        if one_shape or lm:
            shapes = dict(bucket_boundaries=[d.max_eval_len])
        else:
            buckets = eval_pipeline.eval_bucket_boundaries(
                d.max_eval_len, d.get("eval_bucket_boundaries")
            )
            shapes = dict(bucket_boundaries=buckets, sort_by_length=True)
        return eval_pipeline.eval_batches(
            self.texts(split, limit) if lm else self.pairs(split, limit),
            ("targets",) if lm else ("inputs", "targets"),
            self.tokenizer,
            max_len=d.max_eval_len,
            batch_size=d.eval_batch_size,
            batch_multiple=batch_multiple,
            source_prefix=self.source_prefix,
            target_prefix=self.target_prefix,
            **every,
            **shapes,
        )


def direction_task(data: Any, tokenizer: Tokenizer, seed: int, direction: Any) -> Task:
    """The tagged task of one direction (trained or not) of a multilingual config."""
    if isinstance(direction, str):
        (direction,) = directions.parse_directions(direction, "direction")
    directions.check_tags(tokenizer, [direction[1]], "this model")
    data = directions.direction_data(data, direction)
    return Task(data, tokenizer, seed, tag=directions.lang_tag(direction[1]))


def prepare_task(
    data: Any,
    workdir: str | epath.Path,
    *,
    seed: int,
    tokenizer: Tokenizer | None = None,
    lm: bool = False,
) -> Task:
    """The run's task over config.data: its splits prepared, its tokenizer (`tokenizer`:
    train.init_from's; else run_tokenizer.py's) and its streams. `lm`: a language model over
    `data.lm_side` of the pairs."""
    tokenizer_options(data)  # a bad option fails before the data is prepared
    workdir = epath.Path(workdir)
    if directions.is_multilingual(data):
        return _multilingual(data, workdir, seed, tokenizer)
    corpora = [] if lm else bt.parse_corpora(data)
    tag = bt.backtranslation_tag(data)
    tagged = any(c.tag for c in corpora)
    side = study_value(data, "lm_side") if lm else ""
    if lm and side not in streams.LM_SIDES:
        raise ValueError(f"data.lm_side={side!r}; expected one of {streams.LM_SIDES}")
    (train,) = preparation.open_train_splits([data], workdir)
    pairs = Sample(kept_train_pairs(data, train), data.tokenizer_pairs, seed)
    tok = load_or_train_tokenizer(
        data,
        workdir,
        lambda: iter(SideTexts(pairs, side)) if lm else iter_pair_texts(pairs),
        given=tokenizer,
        given_by="train.init_from",
        symbols=[tag] if tagged else [],
    )
    task = Task(data, tok, seed, splits={"train": train}, lm_side=side)
    if not corpora:
        return task
    tag_id = None
    if tagged:
        given = "train.init_from" if tokenizer is not None else data.get("tokenizer_path")
        where = f"{workdir / TOKENIZER_FILE}" + (f" ({given})" if given else "")
        tag_id = bt.check_tag(tok, tag, where)
    synthetic = {c.name: bt.load_corpus(c, f"{bt.KEY}[{i}]") for i, c in enumerate(corpora)}
    return backtranslated(task, corpora, synthetic, tag_id)


def backtranslated(
    task: Task,
    corpora: Sequence[bt.SyntheticCorpus],
    synthetic: dict[str, Sequence[tuple[str, str]]],
    tag_id: int | None,
) -> Task:
    """`task` with the synthetic corpora (pairs: `synthetic`) mixed in by ratio, tagged ones'
    sources after `tag_id`; evaluation reads the real dataset only."""
    weights = bt.proportions([c.ratio for c in corpora])
    prefix, target = list(task.source_prefix), list(task.target_prefix)
    mixed = {bt.REAL: Stream(task.train_pairs(), weights[0], prefix, target)}
    for c, w in zip(corpora, weights[1:]):
        tagged = prefix + ([tag_id] if c.tag else [])
        mixed[c.name] = Stream(synthetic[c.name], w, tagged, target)
    return dataclasses.replace(task, streams=mixed)


def _tokenizer_texts(
    data: Any, train_pairs: Sequence[Sequence[tuple[str, str]]], seed: int
) -> Iterator[str]:
    """Both sides of a sample of data.tokenizer_pairs of each language pair's `train_pairs`,
    each distinct sentence once (English of en-de and en-fr is one text in Multi30k)."""
    seen: set[str] = set()
    for pairs in train_pairs:
        for pair in Sample(pairs, data.tokenizer_pairs, seed):
            for text in pair:
                if text not in seen:
                    seen.add(text)
                    yield text


def _multilingual(data: Any, workdir: epath.Path, seed: int, tokenizer: Tokenizer | None) -> Task:
    """Every direction's splits, one tokenizer with the tags, one stream per direction."""
    trained, extra = directions.train_directions(data), directions.extra_directions(data)
    if not trained:
        raise ValueError("data.directions is empty: name the directions, e.g. 'en-de,de-en'")
    by_pair: dict[frozenset, tuple[str, str]] = {}  # one direction per unordered language pair
    for d in trained:
        by_pair.setdefault(frozenset(d), d)
    corpus = [directions.direction_data(data, d) for d in by_pair.values()]  # the tokenizer's
    # Extra directions' data is prepared too (a zero-shot pair is a dataset config of its own).
    also = [directions.direction_data(data, d) for d in extra]
    sources = preparation.open_train_splits(corpus, workdir, also_prepare=also)
    train_pairs = [kept_train_pairs(d, s) for d, s in zip(corpus, sources)]
    languages = directions.tag_languages(data)
    tok = load_or_train_tokenizer(
        data,
        workdir,
        lambda: _tokenizer_texts(data, train_pairs, seed),
        given=tokenizer,
        given_by="train.init_from",
        symbols=[directions.lang_tag(x) for x in languages],
    )
    directions.check_tags(tok, languages, str(workdir / TOKENIZER_FILE))
    opened = dict(zip(by_pair.values(), sources))

    def make(d: tuple[str, str]) -> Task:
        splits = {"train": opened[d]} if d in opened else {}
        tag = directions.lang_tag(d[1])
        return Task(directions.direction_data(data, d), tok, seed, splits=splits, tag=tag)

    train_tasks = {directions.direction_name(d): make(d) for d in trained}
    extra_tasks = {directions.direction_name(d): make(d) for d in extra}
    sizes = [len(t.train_pairs()) for t in train_tasks.values()]
    probs = streams.mixture_probabilities(
        sizes, study_value(data, "mixture"), study_value(data, "temperature")
    )
    mixed = {
        n: Stream(t.train_pairs(), p, t.source_prefix, t.target_prefix)
        for (n, t), p in zip(train_tasks.items(), probs)
    }
    return Task(data, tok, seed, streams=mixed, directions=train_tasks, extra=extra_tasks)
