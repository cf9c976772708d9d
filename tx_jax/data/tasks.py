"""A translation task: the config's data section turned into splits, a tokenizer and batches.

    task = prepare_translation_task(config.data, workdir, seed=config.seed)
    task.train_iterator(n, spans)              this process's rows of the global batches
    task.eval_batches('validation', n)         every example once, static shapes
    task.pairs('test')                          raw (source, reference) text pairs

    task = prepare_lm_task(config.data, workdir, seed=config.seed)    (config.task == 'lm')
    the same interface over one side of the pairs (`data.lm_side`): 'targets' batches only

The joint SentencePiece model is trained on the train split once and saved as
WORKDIR/tokenizer.model; resuming and evaluation load it from there (and checkpoints carry a
copy). `data.tokenizer_path` (or `train.init_from`'s checkpoint) gives an existing model to
use instead, so that runs share one vocabulary. `data.max_train_pairs` keeps only the first N
train pairs (the tokenizer, if trained here, sees only those). In a multi-process run process 0
prepares data and tokenizer, the others wait. Several directions in one model
(`data.directions`): directions.py.

Multi-process training reads the train stream as `data.input_shards` shards (input_shards.py):
the global batch at a step is every shard's batch in shard order, fixed by the config whatever
the number of processes and devices, and each process reads, tokenizes and batches only the
shards that its devices' rows fall in (`train_iterator(batch_multiple, spans)`, the spans from
`parallel.Strategy.process_row_spans`). With input_shards a multiple of the process count,
each process does 1/P of the input work; the iterator state holds every shard's position, so
a checkpoint resumes on any process and device count. input_shards=1 (the default) is one
stream that every process reads whole, keeping its own rows (any batching, buckets included).
Validation loss batches stay per-process shards (their sums are reduced over all devices);
decoding for BLEU runs the same examples on every process (`shard_eval=False`), since the
parameters it reads are spread over all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from etils import epath
from jax.experimental import multihost_utils

from tx_jax import paths
from tx_jax.data import datasets, eval_pipeline, input_shards, pipeline
from tx_jax.data.tokenizer import Tokenizer, iter_pair_texts, train_tokenizer

TOKENIZER_FILE = "tokenizer.model"


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
    """The first `n` items of a sequence, without copying it."""

    def __init__(self, seq: Sequence, n: int | None):
        self._seq, self._n = seq, len(seq) if n is None else min(n, len(seq))

    def __len__(self) -> int:
        return self._n

    def item_at(self, i: int):
        return self._seq[i]


def parse_max_train_pairs(spec: Any) -> int | dict[str, int] | None:
    """`data.max_train_pairs`: N (every direction), 'en-fr=3000,fr-en=3000' ('+' works too) or
    {'en-fr': 3000} (per direction; the others keep every pair); None for 0 / '' / None."""
    key = "data.max_train_pairs"
    if not spec:
        return None
    if isinstance(spec, str) and spec.strip().isdigit():
        spec = int(spec)
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"{key}={spec} must be >= 0 (0: every pair)")
        return spec or None
    items = spec.items() if hasattr(spec, "items") else None
    if items is None:
        parts = [p for p in str(spec).replace("+", ",").split(",") if p.strip()]
        items = [p.partition("=")[::2] for p in parts]
    table = {}
    for direction, n in items:
        direction, n = str(direction).strip(), str(n).strip()
        if "-" not in direction or not n.isdigit():
            raise ValueError(
                f"{key}={spec!r}: write N, or SRC-TGT=N per direction ('en-fr=3000,fr-en=3000')"
            )
        table[direction] = int(n)
    return table


def max_train_pairs(data: Any, direction: str | None = None) -> int | None:
    """How many train pairs `direction` keeps (default: source_lang-target_lang of `data`):
    `data.max_train_pairs` read by `parse_max_train_pairs`; None: all of them."""
    spec = parse_max_train_pairs(data.get("max_train_pairs"))
    if isinstance(spec, dict):
        direction = direction or f"{data.source_lang}-{data.target_lang}"
        return spec.get(direction) or None
    return spec


def train_options(data: Any, *, seed: int, batch_multiple: int) -> pipeline.TrainOptions:
    """The train batching of config.data for the whole global batch (process 0 of 1; each
    input shard takes its part, input_shards.py), rows a multiple of `batch_multiple`."""
    return pipeline.TrainOptions(
        max_len=data.max_len,
        tokens_per_batch=data.tokens_per_batch,
        batch_multiple=batch_multiple,
        bucket_boundaries=data.bucket_boundaries,
        packing=data.packing,
        seed=seed,
        process_index=0,
        process_count=1,
    )


def train_batch_shapes(data: Any, *, batch_multiple: int, lm: bool) -> list[dict[str, tuple]]:
    """The global train batches of config.data without reading any data: one {array name:
    (B, L)} per bucket, as the train iterator would make them (rows a multiple of
    `batch_multiple`: devices x grad_accum_steps)."""
    options = train_options(data, seed=0, batch_multiple=batch_multiple)
    shapes = input_shards.global_batch_shapes(options, int(data.get("input_shards", 1)))
    keys = pipeline.batch_keys(("targets",) if lm else ("inputs", "targets"), data.packing)
    return [dict.fromkeys(keys, shape) for shape in shapes]


def sharded_train_iterator(
    data: Any,
    seed: int,
    build: Callable[[pipeline.TrainOptions], pipeline.TrainIterator],
    batch_multiple: int,
    spans: Sequence[input_shards.Span] | None,
) -> input_shards.ShardedTrainIterator:
    """The `data.input_shards` streams that `build` makes, this process's `spans` of them."""
    return input_shards.make_sharded_iterator(
        build,
        train_options(data, seed=seed, batch_multiple=batch_multiple),
        input_shards=int(data.get("input_shards", 1)),
        spans=spans,
    )


@dataclasses.dataclass
class TranslationTask:
    data: Any  # config.data
    tokenizer: Tokenizer
    seed: int
    _splits: dict[str, datasets.TranslationSource] = dataclasses.field(default_factory=dict)
    # False: eval_batches gives every process all the examples (decoding with parameters
    # sharded over several processes runs the same batches everywhere)
    shard_eval: bool = True
    # A multilingual model's target-language tag ('<2de>'): its id goes before every source
    # (train and eval), so the pairs themselves stay plain text; '' for none.
    tag: str = ""

    @property
    def source_prefix(self) -> list[int]:
        """The ids put before every source: [id of the tag], or none."""
        return [self.tokenizer.piece_to_id(self.tag)] if self.tag else []

    def split_name(self, split: str) -> str:
        """'validation' / 'test' are aliases for the config's eval_split / test_split."""
        return {"validation": self.data.eval_split, "test": self.data.test_split}.get(split, split)

    def source(self, split: str) -> datasets.TranslationSource:
        name = self.split_name(split)
        if name not in self._splits:
            self._splits[name] = load_split(self.data, name)
        return self._splits[name]

    def train_pairs(self) -> Sequence[tuple[str, str]]:
        """The train split, cut to its first `data.max_train_pairs` pairs when that is set."""
        n = max_train_pairs(self.data)
        return self.source("train") if n is None else Prefix(self.source("train"), n)

    def pairs(self, split: str, limit: int | None = None) -> Sequence[tuple[str, str]]:
        pairs = self.train_pairs() if self.split_name(split) == "train" else self.source(split)
        return Prefix(pairs, limit)

    def train_iterator(
        self, batch_multiple: int, spans: Sequence[input_shards.Span] | None = None
    ) -> input_shards.ShardedTrainIterator:
        """This process's rows (`spans`; None: all) of the global batches, whose rows are a
        multiple of `batch_multiple` (module docstring)."""
        build = functools.partial(
            pipeline.make_train_iterator,
            self.train_pairs(),
            self.tokenizer,
            source_prefix=self.source_prefix,
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
            **shapes,
            **every,
        )


def builder_kwargs(data: Any) -> dict:
    """Extra TFDS builder arguments the config asks for (the synthetic corpus's sizes)."""
    if data.dataset == "synthetic":
        from tx_jax.data import synthetic

        s = data.synthetic
        return {
            "config": synthetic.make_config(
                num_train=s.num_train,
                num_validation=s.num_validation,
                num_test=s.num_test,
                seed=s.seed,
            )
        }
    return dict(data.get("builder_kwargs") or {})


def load_split(data: Any, split: str) -> datasets.TranslationSource:
    return datasets.load_translation_split(
        data.dataset,
        split,
        source_lang=data.source_lang,
        target_lang=data.target_lang,
        data_dir=data.data_dir,
        manual_dir=data.manual_dir,
        download=data.download,
        builder_kwargs=builder_kwargs(data),
    )


def given_tokenizer(data: Any) -> Tokenizer | None:
    """The tokenizer `data.tokenizer_path` names (a .model file, or a run directory holding
    tokenizer.model), or None when unset: a run that must share another run's vocabulary."""
    path = data.get("tokenizer_path")
    if not path:
        return None
    path = epath.Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.exists():
        raise FileNotFoundError(f"data.tokenizer_path={data.tokenizer_path!r}: no {path}")
    return Tokenizer.load(path)


def load_or_train_tokenizer(
    data: Any,
    workdir: epath.Path,
    texts: Callable[[], Iterable[str]],
    *,
    given: Tokenizer | None = None,
    given_by: str = "data.tokenizer_path",
    symbols: Sequence[str] = (),
) -> Tokenizer:
    """WORKDIR/tokenizer.model if present, else `given` (or `data.tokenizer_path`'s) saved
    there, else a `data.vocab_size` model trained on `texts()` (e.g. both sides of the first
    `data.tokenizer_pairs` train pairs: a joint vocabulary) with `symbols` (and
    `data.user_defined_symbols`) as single pieces. A WORKDIR/tokenizer.model that differs
    from the given one is an error naming `given_by`: the vocabularies would not match."""
    path = workdir / TOKENIZER_FILE
    if given is None:
        given = given_tokenizer(data)
    elif data.get("tokenizer_path") and given_tokenizer(data) != given:
        raise ValueError(
            f"data.tokenizer_path={data.tokenizer_path!r} and {given_by} name different "
            "tokenizers; set only one"
        )
    if jax.process_count() == 1 and path.exists():
        existing = Tokenizer.from_bytes(path.read_bytes())
        if given is not None and existing != given:
            raise ValueError(
                f"{path} differs from the tokenizer of {given_by}: a workdir keeps the "
                "vocabulary it started with; use a new workdir"
            )
        return existing
    # Only process 0 looks at the file: another process could see it appear (half written)
    # and skip the barrier that process 0 then waits at.
    if jax.process_index() == 0 and not path.exists():
        if given is not None:
            given.save(path)
        else:
            logging.info("training a %d-piece SentencePiece model", data.vocab_size)
            symbols = (*symbols, *(data.get("user_defined_symbols") or ()))
            _train_tokenizer_to(path, texts(), data.vocab_size, symbols)
    barrier("tokenizer")
    tokenizer = Tokenizer.from_bytes(path.read_bytes())
    if given is not None and tokenizer != given:
        raise ValueError(f"{path} differs from the tokenizer of {given_by}; use a new workdir")
    return tokenizer


def _train_tokenizer_to(
    path: epath.Path, texts: Iterable[str], vocab_size: int, symbols: Sequence[str]
) -> None:
    """Trains a tokenizer on `texts` and writes it to `path`. For a remote (gs://) path it is
    trained into a temporary directory of this run (train_tokenizer writes a local file and
    renames it), so concurrent runs never share the file; the directory is removed afterwards."""
    if not paths.is_remote(path):
        train_tokenizer(texts, vocab_size, str(path), user_defined_symbols=symbols)
        return
    with tempfile.TemporaryDirectory(prefix="tx_jax_tokenizer_") as local:
        model = os.path.join(local, TOKENIZER_FILE)
        trained = train_tokenizer(texts, vocab_size, model, user_defined_symbols=symbols)
    path.write_bytes(trained.to_bytes())


def prepare_translation_task(
    data: Any, workdir: str | epath.Path, *, seed: int, tokenizer: Tokenizer | None = None
) -> TranslationTask:
    """Splits and tokenizer of one language pair; `tokenizer`, when given (another run's, for
    `train.init_from`), is used and saved as WORKDIR/tokenizer.model instead of training one."""
    workdir = epath.Path(workdir)
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        load_split(data, "train")  # prepares the TFDS data once, before the others read it
    barrier("data")
    task = TranslationTask(data, None, seed)  # type: ignore[arg-type]  (set below)
    task._splits["train"] = load_split(data, "train")
    pairs = Prefix(task.train_pairs(), data.tokenizer_pairs)
    task.tokenizer = load_or_train_tokenizer(
        data, workdir, lambda: iter_pair_texts(pairs), given=tokenizer, given_by="train.init_from"
    )
    return task


# ------------------------------------------------------------------ language modelling

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
        return SideTexts(self.pair_task.pairs(split, limit), self.data.get("lm_side", "target"))

    def train_iterator(
        self, batch_multiple: int, spans: Sequence[input_shards.Span] | None = None
    ) -> input_shards.ShardedTrainIterator:
        """This process's rows of the global batches of 'targets' (texts + EOS)."""
        build = functools.partial(
            pipeline.make_lm_train_iterator, self.texts("train"), self.tokenizer
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
    only (`data.lm_side`), saved as WORKDIR/tokenizer.model like a translation one."""
    side = data.get("lm_side", "target")
    if side not in LM_SIDES:
        raise ValueError(f"data.lm_side={side!r}; expected one of {LM_SIDES}")
    workdir = epath.Path(workdir)
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        load_split(data, "train")
    barrier("data")
    pair_task = TranslationTask(data, None, seed)  # type: ignore[arg-type]  (set below)
    pair_task._splits["train"] = load_split(data, "train")
    pairs = Prefix(pair_task.train_pairs(), data.tokenizer_pairs)
    pair_task.tokenizer = load_or_train_tokenizer(
        data,
        workdir,
        lambda: iter(SideTexts(pairs, side)),
        given=tokenizer,
        given_by="train.init_from",
    )
    return LMTask(data, pair_task.tokenizer, seed, pair_task)


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (nothing in a one-process run):
    what process 0 prepares (data, tokenizer) is complete before the others read it."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"tx_jax:{name}")
