"""A batch's path, step 5: this process's rows of the global batch, and the whole stream's state.

    build = functools.partial(make_train_iterator, streams, tokenizer)
    it = make_sharded_iterator(build, train_options(config.data, ...), input_shards=S, spans=spans)
    batch = next(it)                  this process's rows of the global batch
    it.get_state() / it.set_state()   every shard's position (any process count restores it)

`data.input_shards` S cuts the train examples into S shards fixed for the run: shard s reads
examples [s::S] under a budget of tokens_per_batch // S, and the global batch at step t is
every shard's batch t in shard order, so it depends on S and the config, not on the process or
device count. A process builds the shards its `spans` (fractions of the global rows,
`parallel.Strategy.process_row_spans`) fall in and keeps exactly its rows. With S > 1 batches
share one shape (`data.packing=True` or one bucket); rows per shard are a multiple of
m / gcd(m, S), m = devices x grad_accum_steps. The state, {'input_shards': S, 'shards': {'0':
TrainIterator state, ...}}, restores on any topology whose batch shapes match.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from tx_jax.config import study_value
from tx_jax.data.batches import (
    Batch,
    TrainIterator,
    TrainOptions,
    batch_keys,
    batch_shapes,
    bucket_batch_sizes,
)
from tx_jax.data.features import process_shard, shard_records
from tx_jax.data.streams import ExampleIterator, MixtureIterator, Prefix, StreamDataset
from tx_jax.data.tokenizer import Tokenizer

Span = tuple[Fraction, Fraction]
KEY = "data.input_shards"


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


def kept_train_pairs(data: Any, train: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
    """The train split `train` of `data`'s direction (source_lang-target_lang), cut to its
    first `data.max_train_pairs` pairs when that is set (a view: nothing is copied)."""
    n = parse_max_train_pairs(study_value(data, "max_train_pairs"))
    if isinstance(n, dict):
        n = n.get(f"{data.source_lang}-{data.target_lang}") or None
    return train if n is None else Prefix(train, n)


def train_options(data: Any, *, seed: int, batch_multiple: int) -> TrainOptions:
    """config.data's batching of the whole global batch (each input shard takes its part)."""
    return TrainOptions(
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
    """config.data's global train batches without reading data: {array name: (B, L)} per
    bucket, rows a multiple of `batch_multiple` (devices x grad_accum_steps)."""
    options = train_options(data, seed=0, batch_multiple=batch_multiple)
    input_shards = int(data.get("input_shards", 1))
    check_shape_rule(input_shards, options.packing, options.bucket_boundaries)
    shard = shard_options(options, 0, input_shards)
    shapes = [(b * input_shards, n) for b, n in batch_shapes(shard)]  # every shard's rows
    keys = batch_keys(("targets",) if lm else ("inputs", "targets"), data.packing)
    return [dict.fromkeys(keys, shape) for shape in shapes]


@dataclasses.dataclass(frozen=True)
class Stream:
    """One train stream: its items (pairs; texts for a language model), its weight in a
    mixture, and the ids put before every source and target (counted toward max_len)."""

    items: Sequence[Any]
    weight: float = 1.0
    source_prefix: Sequence[int] = ()
    target_prefix: Sequence[int] = ()


def make_train_iterator(
    streams: Stream | Mapping[str, Stream],
    tokenizer: Tokenizer,
    options: TrainOptions,
    *,
    lm: bool = False,
) -> TrainIterator:
    """One shard's train batches ('inputs', 'targets'; `lm`: 'targets') of one stream, or
    drawn by weight from named streams (in the state's order) forever (num_epochs None)."""
    mixed = isinstance(streams, Mapping)
    named = dict(streams) if mixed else {"": streams}
    probs = [float(x.weight) for x in named.values()]
    if mixed and (min(probs) < 0 or not math.isclose(sum(probs), 1.0)):
        raise ValueError(f"stream weights {probs} must be >= 0, summing to 1")
    if mixed and options.num_epochs is not None:
        raise ValueError(
            f"num_epochs={options.num_epochs}: a mixture repeats every corpus forever; use None"
        )
    keys = ("targets",) if lm else ("inputs", "targets")
    shard = process_shard(options.process_index, options.process_count)
    sources = [[int(i) for i in x.source_prefix] for x in named.values()]
    targets = [[int(i) for i in x.target_prefix] for x in named.values()]
    cut = dict(max_len=options.max_len, cache=options.cache_tokens)
    records = [
        shard_records(x.items, keys, tokenizer, shard, **cut, source_prefix=p, target_prefix=t)
        for x, p, t in zip(named.values(), sources, targets)
    ]
    sizes = [len(x.items) for x in named.values()]
    # Prefix entries only when set: the fingerprints of earlier checkpoints stay as saved.
    if mixed:
        kept = StreamDataset(MixtureIterator, records, probs, options.seed, list(named))
        mixture = {"names": list(named), "probabilities": probs, "sizes": sizes}
        mixture["prefixes"] = sources
        if any(targets):
            mixture["target_prefixes"] = targets
        extra = {"mixture": mixture}
    else:
        kept = StreamDataset(ExampleIterator, records[0], options.seed, options.num_epochs)
        prefixes = {"source_prefix": sources[0], "target_prefix": targets[0]}
        extra = {k: v for k, v in prefixes.items() if v} or None
    counts = dict(num_examples=sum(sizes), shard_size=sum(len(r) for r in records))
    return TrainIterator(kept, keys, tokenizer, options, shard, **counts, fingerprint_extra=extra)


def shard_options(options: TrainOptions, shard: int, input_shards: int) -> TrainOptions:
    """Shard `shard` of `input_shards`: its examples, token budget and row multiple."""
    m = options.batch_multiple
    return TrainOptions(
        **{
            **vars(options),
            "tokens_per_batch": options.tokens_per_batch // input_shards,
            "batch_multiple": m // math.gcd(m, input_shards),
            "process_index": shard,
            "process_count": input_shards,
        }
    )


def check_shape_rule(input_shards: int, packing: bool, boundaries: Sequence[int] | None) -> None:
    """Several shards form one array only if every batch has the same shape."""
    if input_shards < 1:
        raise ValueError(f"{KEY}={input_shards} must be >= 1")
    if input_shards > 1 and not packing and len(boundaries or [0, 0]) > 1:
        raise ValueError(
            f"{KEY}={input_shards} needs one batch shape for all shards: set data.packing=True "
            "or a single bucket (data.bucket_boundaries=[data.max_train_len])"
        )


class ShardedTrainIterator:
    """This process's rows of the global batches: `shards` its owned shards' iterators,
    `spans` the fractions of the global rows it keeps (sorted, inside those shards)."""

    def __init__(self, shards: dict[int, TrainIterator], input_shards: int, spans: Sequence[Span]):
        self._shards = shards
        self.input_shards = input_shards
        self._spans = [(Fraction(a), Fraction(b)) for a, b in spans]
        self.share = sum((b - a for a, b in self._spans), Fraction(0))
        first = next(iter(shards.values()))
        self.keys, self.packing = first.keys, first.packing
        # the global shapes: every shard's rows at each length
        self.batch_shapes = tuple((b * input_shards, n) for b, n in first.batch_shapes)

    def __iter__(self) -> ShardedTrainIterator:
        return self

    def __next__(self) -> Batch:
        batches = {s: next(it) for s, it in self._shards.items()}
        if len(batches) == 1 and self.share * self.input_shards == 1:
            return next(iter(batches.values()))  # one whole shard: no copy (the default)
        rows = len(next(iter(batches.values()))[self.keys[0]])  # per shard
        pieces = []  # (shard, its rows) in global row order
        for a, b in self._spans:
            start, stop = int(a * rows * self.input_shards), int(b * rows * self.input_shards)
            for s in range(start // rows, -(-stop // rows)):
                lo, hi = max(start, s * rows), min(stop, (s + 1) * rows)
                pieces.append((s, slice(lo - s * rows, hi - s * rows)))
        return {
            k: np.concatenate([batches[s][k][rows_of] for s, rows_of in pieces])
            for k in batches[pieces[0][0]]
        }

    def get_state(self) -> dict[str, Any]:
        """Every shard's state (gathered from all processes: call it on each at one step)."""
        local = {str(s): it.get_state() for s, it in self._shards.items()}  # str: JSON keys
        return {"input_shards": self.input_shards, "shards": gather(local)}

    def set_state(self, state: dict[str, Any]) -> None:
        if "shards" not in state:  # a state saved before input shards: one stream
            state = {"input_shards": 1, "shards": {"0": state}}
        if state["input_shards"] != self.input_shards:
            raise ValueError(
                f"the checkpoint's data stream has {KEY}={state['input_shards']}, this run "
                f"{self.input_shards}: keep {KEY}={state['input_shards']} to continue the "
                "stream (or set train.restore_data_iterator=False to start it afresh)"
            )
        for s, it in self._shards.items():
            shard = state["shards"][str(s)]
            shard = {**shard, "fingerprint": upgrade_fingerprint(shard["fingerprint"])}
            try:
                it.set_state(shard)
            except ValueError as e:
                if "batch_shapes" not in str(e):
                    raise
                raise ValueError(f"{e}{_SHAPES_HINT}") from e

    def local_stats(self) -> dict[str, Any]:
        """This process's shards and their example counts summed (no collective)."""
        counts = [it.stats() for it in self._shards.values()]
        return {"shards": sorted(self._shards)} | {
            k: sum(c[k] for c in counts) for k in counts[0] if k != "epoch"
        }

    def stats(self) -> dict[str, int]:
        """Example counts over every shard since the start of training ('epoch': passes over
        the whole corpus); gathered from all processes like `get_state`."""
        local = {
            str(s): {**it.stats(), "_position": it.position(), "_size": it.shard_size}
            for s, it in self._shards.items()
        }
        per_shard = list(gather(local).values())
        out = {k: sum(x[k] for x in per_shard) for k in per_shard[0] if not k.startswith("_")}
        out["epoch"] = sum(x["_position"] for x in per_shard) // sum(x["_size"] for x in per_shard)
        return out


_SHAPES_HINT = (
    "; rows per batch are data.tokens_per_batch / L rounded down to a multiple of devices x "
    "train.grad_accum_steps: choose data.tokens_per_batch whose rows divide by both device "
    "counts, or set train.restore_data_iterator=False to start the stream afresh"
)


def upgrade_fingerprint(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """An old shard fingerprint's 'batch_multiple' (the device count) as the shapes it gave."""
    if "batch_shapes" in fingerprint or "batch_multiple" not in fingerprint:
        return fingerprint
    out = dict(fingerprint)
    bounds = out["bucket_boundaries"]
    sizes = bucket_batch_sizes(bounds, out["tokens_per_batch"], out.pop("batch_multiple"))
    out["batch_shapes"] = [[b, n] for b, n in zip(sizes, bounds)]
    return out


def gather(local: dict[str, Any]) -> dict[str, Any]:
    """The union of every process's `local` (JSON-able dicts by shard), sorted by shard."""
    import jax

    if jax.process_count() == 1:
        return dict(sorted(local.items(), key=lambda kv: int(kv[0])))
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(local).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray(len(data), np.int64))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: len(data)] = data
    everything = multihost_utils.process_allgather(padded)
    merged: dict[str, Any] = {}
    for row, n in zip(np.asarray(everything), np.asarray(sizes)):
        merged.update(json.loads(row[: int(n)].tobytes().decode()))
    return dict(sorted(merged.items(), key=lambda kv: int(kv[0])))


def make_sharded_iterator(
    build: Callable[[TrainOptions], TrainIterator],
    options: TrainOptions,
    *,
    input_shards: int,
    spans: Sequence[Span] | None = None,
) -> ShardedTrainIterator:
    """This process's `spans` (None: all) of the global rows of `input_shards` shards, each
    built by `build` from `options` cut to its share."""
    n = input_shards
    check_shape_rule(n, options.packing, options.bucket_boundaries)
    spans = sorted(spans or [(Fraction(0), Fraction(1))])
    # the shards the spans (fractions of the global batch's rows) fall in
    owned = sorted({s for a, b in spans for s in range(math.floor(a * n), math.ceil(b * n))})
    share = sum((b - a for a, b in spans), Fraction(0))
    if len(owned) > share * n:
        logging.warning(
            "this process reads %d shard(s) of %s=%d for %s of the batch; a multiple of the "
            "process count would let each read only its share",
            *(len(owned), KEY, n, share),
        )
    shards = {s: build(shard_options(options, s, input_shards)) for s in owned}
    return ShardedTrainIterator(shards, input_shards, spans)
