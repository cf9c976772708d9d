"""config.data's train input: which train pairs a run keeps, how they are batched, the
batch shapes that gives, and the sharded stream every task's `train_iterator` returns.

`data.max_train_pairs` keeps only the first N train pairs (the tokenizer, if trained in the
run, sees only those): N for every direction, or per direction ('en-fr=3000,fr-en=3000').

Multi-process training reads the train stream as `data.input_shards` shards (input_shards.py):
the global batch at a step is every shard's batch in shard order, fixed by the config whatever
the number of processes and devices, and each process reads, tokenizes and batches only the
shards that its devices' rows fall in (`train_iterator(batch_multiple, spans)`, the spans from
`parallel.Strategy.process_row_spans`). With input_shards a multiple of the process count,
each process does 1/P of the input work; the iterator state holds every shard's position, so
a checkpoint resumes on any process and device count. input_shards=1 (the default) is one
stream that every process reads whole, keeping its own rows (any batching, buckets included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tx_jax.config import study_value
from tx_jax.data import input_shards, pipeline
from tx_jax.data.views import Prefix


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
    spec = parse_max_train_pairs(study_value(data, "max_train_pairs"))
    if isinstance(spec, dict):
        direction = direction or f"{data.source_lang}-{data.target_lang}"
        return spec.get(direction) or None
    return spec


def kept_train_pairs(data: Any, train: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
    """The train split `train` of `data`'s direction, cut to its first `data.max_train_pairs`
    pairs when that is set (a view: nothing is copied)."""
    n = max_train_pairs(data)
    return train if n is None else Prefix(train, n)


def train_options(data: Any, *, seed: int, batch_multiple: int) -> pipeline.TrainOptions:
    """The train batching of config.data for the whole global batch (process 0 of 1; each
    input shard takes its part, input_shards.py), rows a multiple of `batch_multiple`."""
    return pipeline.TrainOptions(
        max_len=data.max_train_len,
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
