"""Multilingual translation: one model, several directions, target-language tags.

    data.directions = 'en-de,de-en,en-fr,fr-en'   (or '+' between them, or a list)
    data.mixture = 'temperature'                  'uniform' | 'temperature' (streams.py)
    data.temperature = 5.0                        p_i ~ n_i^(1/T)
    data.extra_eval_directions = 'de-fr'          also decoded for BLEU (e.g. zero-shot)

    task = prepare_multilingual_task(config.data, workdir, seed=config.seed)
    task.train_iterator(n)               one mixed stream over every direction (streams.py)
    task.eval_batches('validation', n)   the validation pairs of every training direction
    task.direction('en-de')              a TranslationTask of one direction, tagged: its pairs,
                                         eval batches and BLEU; any direction whose target
                                         language has a tag, trained or not (zero-shot)
    task.bleu_directions                 the training directions, then extra_eval_directions

Tags (Johnson et al., 2017): the id of '<2xx>' goes before every source whose target language
is xx, in training and in evaluation; the pairs themselves stay plain text. The tokenizer has
one user-defined piece per language of `directions` and `extra_eval_directions` (sorted), so a
tag is one id: `lang_tag('de') == '<2de>'`, id `tokenizer.piece_to_id('<2de>')`. A source is
encoded as [tag id] + pieces + [EOS].

Shared vocabulary: one SentencePiece model over every language: for each unordered language
pair of the directions, both sides of `data.tokenizer_pairs` of its train pairs drawn
uniformly with the run's seed (all of them when it has no more; each sentence once), unless
`data.tokenizer_path` or `train.init_from` gives one (which must have the tags).

Data: a direction is `data.dataset` with source_lang/target_lang set to it (Multi30k prepares
one pair config for both directions of a pair); `data.max_train_pairs` cuts each direction's
train split to its first N pairs (or per direction: 'en-fr=3000,fr-en=3000', the others whole),
before the mixture sizes n_i are counted.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import ml_collections
from etils import epath

from tx_jax.config import study_value
from tx_jax.data import preparation, run_tokenizer, shards, streams, tasks
from tx_jax.data.eval_pipeline import EvalBatches
from tx_jax.data.shards import (
    ShardedTrainIterator,
    Span,
    kept_train_pairs,
    parse_max_train_pairs,
    sharded_train_iterator,
)
from tx_jax.data.streams import Concat, Sample
from tx_jax.data.tokenizer import Tokenizer

Direction = tuple[str, str]  # (source language, target language)


def lang_tag(lang: str) -> str:
    """The target-language tag piece: 'de' -> '<2de>'."""
    return f"<2{lang}>"


def direction_name(direction: Direction) -> str:
    """('en', 'de') -> 'en-de' (metric names: bleu/en-de)."""
    return f"{direction[0]}-{direction[1]}"


def parse_directions(spec: str | Sequence[str] | None, key: str = "data.directions") -> list:
    """'en-de,de-en' / 'en-de+de-en' / ['en-de', 'de-en'] -> [('en', 'de'), ('de', 'en')], in
    the given order; '' or None -> []. A ValueError names `key` for anything malformed."""
    if not spec:
        return []
    items = spec.replace("+", ",").split(",") if isinstance(spec, str) else list(spec)
    out: list[Direction] = []
    for item in (str(i).strip() for i in items):
        src, sep, tgt = item.partition("-")
        if not sep or not src or not tgt or "-" in tgt or src == tgt:
            raise ValueError(
                f"{key}={spec!r}: {item!r} is not SRC-TGT with two different languages "
                "(write e.g. 'en-de,de-en,en-fr')"
            )
        if (src, tgt) in out:
            raise ValueError(f"{key}={spec!r}: {item!r} appears twice")
        out.append((src, tgt))
    return out


def is_multilingual(data: Any) -> bool:
    """Whether `data` (config.data) asks for tagged directions (`data.directions` is set)."""
    return bool(study_value(data, "directions"))


def train_directions(data: Any) -> list[Direction]:
    return parse_directions(study_value(data, "directions"))


def extra_directions(data: Any) -> list[Direction]:
    """`data.extra_eval_directions` that are not training directions."""
    trained = train_directions(data)
    extra = parse_directions(
        study_value(data, "extra_eval_directions"), "data.extra_eval_directions"
    )
    return [d for d in extra if d not in trained]


def tag_languages(data: Any) -> list[str]:
    """Every language of the directions (training and extra), sorted: one tag each."""
    pairs = train_directions(data) + extra_directions(data)
    return sorted({lang for d in pairs for lang in d})


def validate_config(data: Any, task: str = "translation") -> None:
    """The multilingual and transfer keys of config.data, before anything is read (absent
    from a config: their neutral values, nothing to check). ValueError names the key."""
    trained = train_directions(data)
    extra = study_value(data, "extra_eval_directions")
    parse_directions(extra, "data.extra_eval_directions")
    if extra and not trained:
        raise ValueError("data.extra_eval_directions needs data.directions (a multilingual run)")
    if trained and task == "lm":
        raise ValueError("data.directions is for translation; task='lm' reads data.lm_side")
    kind, temperature = study_value(data, "mixture"), study_value(data, "temperature")
    if kind not in streams.MIXTURES:
        raise ValueError(f"data.mixture={kind!r}; expected one of {streams.MIXTURES}")
    if temperature <= 0:
        raise ValueError(f"data.temperature={temperature} must be positive")
    spec = study_value(data, "max_train_pairs")
    cut = parse_max_train_pairs(spec)
    names = [direction_name(d) for d in trained] or [f"{data.source_lang}-{data.target_lang}"]
    if isinstance(cut, dict) and set(cut) - set(names):
        raise ValueError(
            f"data.max_train_pairs={spec!r} names {sorted(set(cut) - set(names))}"
            f", not a trained direction ({', '.join(names)})"
        )


def check_tags(tokenizer: Tokenizer, languages: Sequence[str], where: str) -> None:
    """Every `lang_tag` must be one piece of the tokenizer (a user-defined symbol)."""
    missing = [
        lang_tag(x)
        for x in languages
        if tokenizer.piece_to_id(lang_tag(x)) in (tokenizer.unk_id, tokenizer.pad_id)
    ]
    if missing:
        raise ValueError(
            f"the tokenizer of {where} has no piece {', '.join(missing)}: a multilingual model "
            "needs each target-language tag as one piece (trained with them as "
            "user_defined_symbols, as prepare_multilingual_task does)"
        )


def direction_data(data: Any, direction: Direction) -> ml_collections.ConfigDict:
    """A copy of config.data reading `direction` (source_lang, target_lang set)."""
    out = ml_collections.ConfigDict(data.to_dict() if hasattr(data, "to_dict") else dict(data))
    out.source_lang, out.target_lang = direction
    return out


def direction_task(data: Any, tokenizer: Tokenizer, seed: int, direction: Direction | str):
    """The tagged TranslationTask of one direction (trained or not) of a multilingual config."""
    if isinstance(direction, str):
        (direction,) = parse_directions(direction, "direction")
    check_tags(tokenizer, [direction[1]], "this model")
    return tasks.TranslationTask(
        direction_data(data, direction), tokenizer, seed, tag=lang_tag(direction[1])
    )


@dataclasses.dataclass
class MultilingualTask:
    """The TranslationTask interface over several tagged directions (module docstring)."""

    data: Any  # config.data
    tokenizer: Tokenizer
    seed: int
    directions: dict[str, tasks.TranslationTask]  # training directions, by name ('en-de')
    probabilities: dict[str, float]  # sampling probability of each training direction
    extra: dict[str, tasks.TranslationTask] = dataclasses.field(default_factory=dict)
    shard_eval: bool = True  # as TranslationTask.shard_eval

    @property
    def bleu_directions(self) -> list[str]:
        """Directions decoded for BLEU: the training ones, then `extra_eval_directions`."""
        return [*self.directions, *self.extra]

    def split_name(self, split: str) -> str:
        return {"validation": self.data.eval_split, "test": self.data.test_split}.get(split, split)

    def direction(self, name: str) -> tasks.TranslationTask:
        """One direction's task ('de-fr'); one that was not configured is built on the fly."""
        task = self.directions.get(name) or self.extra.get(name)
        if task is None:
            task = direction_task(self.data, self.tokenizer, self.seed, name)
            self.extra[name] = task
        return dataclasses.replace(task, shard_eval=self.shard_eval)

    def pairs(self, split: str, limit: int | None = None) -> Sequence[tuple[str, str]]:
        """The training directions' pairs one after another (`limit` per direction)."""
        return Concat([self.direction(n).pairs(split, limit) for n in self.directions])

    def train_iterator(
        self, batch_multiple: int, spans: Sequence[Span] | None = None
    ) -> ShardedTrainIterator:
        """This process's rows of the global batches mixing the directions (every input shard
        draws the same corpus sequence from its share of each corpus)."""
        build = functools.partial(
            shards.make_mixture_train_iterator,
            {n: t.train_pairs() for n, t in self.directions.items()},
            [self.probabilities[n] for n in self.directions],
            self.tokenizer,
            source_prefixes={n: t.source_prefix for n, t in self.directions.items()},
        )
        return sharded_train_iterator(self.data, self.seed, build, batch_multiple, spans)

    def eval_batches(
        self, split: str, batch_multiple: int, limit: int | None = None, *, one_shape=False
    ):
        """Every training direction's eval batches, one after another (for the loss: their
        'example_index' counts within each direction); `one_shape` as TranslationTask's."""
        parts = [
            self.direction(n).eval_batches(split, batch_multiple, limit, one_shape=one_shape)
            for n in self.directions
        ]
        stats = {k: sum(p.stats[k] for p in parts) for k in parts[0].stats}
        batches = [b for p in parts for b in p.batches]
        return EvalBatches(batches, sum(p.num_examples for p in parts), stats)


def _tokenizer_texts(
    data: Any, train_pairs: Sequence[Sequence[tuple[str, str]]], seed: int
) -> Iterator[str]:
    """Both sides of a uniform sample (streams.Sample, `seed`) of data.tokenizer_pairs of each
    language pair's `train_pairs` (all of them when it has no more), each distinct sentence
    once (English of en-de and en-fr is the same text in Multi30k)."""
    seen: set[str] = set()
    for pairs in train_pairs:
        for pair in Sample(pairs, data.tokenizer_pairs, seed):
            for text in pair:
                if text not in seen:
                    seen.add(text)
                    yield text


def prepare_multilingual_task(
    data: Any, workdir: str | epath.Path, *, seed: int, tokenizer: Tokenizer | None = None
) -> MultilingualTask:
    """Splits of every direction, the shared tokenizer (trained once with the tags, or
    `tokenizer` / data.tokenizer_path, checked for the tags) and the mixture."""
    trained, extra = train_directions(data), extra_directions(data)
    if not trained:
        raise ValueError("data.directions is empty: name the directions, e.g. 'en-de,de-en'")
    run_tokenizer.tokenizer_options(data)  # a bad option fails before the data is prepared
    workdir = epath.Path(workdir)
    by_pair: dict[frozenset, Direction] = {}  # one direction per unordered language pair
    for d in trained:
        by_pair.setdefault(frozenset(d), d)
    corpus = [direction_data(data, d) for d in by_pair.values()]  # the tokenizer's corpus
    # Extra directions' data is prepared too (a zero-shot pair is a dataset config of its own).
    also = [direction_data(data, d) for d in extra]
    sources = preparation.open_train_splits(corpus, workdir, also_prepare=also)
    train_pairs = [kept_train_pairs(d, s) for d, s in zip(corpus, sources)]
    languages = tag_languages(data)
    tok = run_tokenizer.load_or_train_tokenizer(
        data,
        workdir,
        lambda: _tokenizer_texts(data, train_pairs, seed),
        given=tokenizer,
        given_by="train.init_from",
        symbols=[lang_tag(x) for x in languages],
    )
    check_tags(tok, languages, str(workdir / run_tokenizer.TOKENIZER_FILE))
    opened = dict(zip(by_pair.values(), sources))

    def make(d: Direction) -> tasks.TranslationTask:
        splits = {"train": opened[d]} if d in opened else {}
        return tasks.TranslationTask(
            direction_data(data, d), tok, seed, splits=splits, tag=lang_tag(d[1])
        )

    train_tasks = {direction_name(d): make(d) for d in trained}
    extra_tasks = {direction_name(d): make(d) for d in extra}
    sizes = [len(t.train_pairs()) for t in train_tasks.values()]
    probs = streams.mixture_probabilities(
        sizes, study_value(data, "mixture"), study_value(data, "temperature")
    )
    return MultilingualTask(
        data, tok, seed, train_tasks, dict(zip(train_tasks, probs)), extra_tasks
    )
