"""A batch's path, step 3: text -> ids, the same way for training and evaluation.

`Featurizer` turns one raw item (a text, or a tuple of texts) into int32 ids ending in EOS and
says why an example is dropped (train) or how it was truncated (eval, eval_pipeline.py);
`shard_records` featurizes one shard [process_index::process_count] for the train stream.

Train filtering: a pair is dropped when a side is empty, whitespace-only or encodes to no id,
or is longer than max_len ids (EOS and a prefix included). A side over
`max_len * max_piece_chars * 4` non-space characters is dropped before tokenization (a 1 MB
line costs no tokenizer time; the factor 4 allows for NFKC composition). Invalid UTF-8 is
decoded with U+FFFD and kept (`clean_text`; SentencePiece's nmt_nfkc then deletes U+FFFD).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import grain
import numpy as np

from tx_jax.data.tokenizer import Tokenizer

Text = str | bytes
PRECHECK_SLACK = 4  # NFKC can merge a few characters into one; stay conservative.


def clean_text(x: Text) -> tuple[str, bool]:
    """Returns (text, was_invalid): bytes/surrogates that are not UTF-8 become U+FFFD."""
    if isinstance(x, bytes | bytearray):
        try:
            return bytes(x).decode("utf-8"), False
        except UnicodeDecodeError:
            return bytes(x).decode("utf-8", errors="replace"), True
    x = str(x)
    if x.isascii():
        return x, False
    try:
        x.encode("utf-8")
        return x, False
    except UnicodeEncodeError:  # lone surrogates, e.g. from errors='surrogateescape'
        try:
            raw = x.encode("utf-8", errors="surrogateescape")
        except UnicodeEncodeError:
            raw = x.encode("utf-8", errors="replace")
        return raw.decode("utf-8", errors="replace"), True


def _nonspace_len(text: str) -> int:
    return len(text) - text.count(" ")


class Record(NamedTuple):
    """`features` key -> int32 [n <= max_len] ids ending in EOS (None when dropped), `drop` ''
    or 'empty' | 'too_long_chars' | 'too_long', `notes` of 'invalid_utf8', 'empty', 'truncated'."""

    features: dict[str, np.ndarray] | None
    drop: str
    notes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Featurizer:
    """Raw item (one text, str or UTF-8 bytes; texts in `keys` order) -> `Record`. With
    `truncate` (eval) a side keeps its first max_len - 1 ids and EOS, nothing is dropped."""

    tokenizer: Tokenizer
    keys: tuple[str, ...]  # ('inputs', 'targets') for pairs, ('targets',) for LM
    max_len: int  # counting EOS and the prefix
    truncate: bool = False
    source_prefix: tuple[int, ...] = ()  # ids before the 'inputs' pieces (a language tag)
    target_prefix: tuple[int, ...] = ()  # before 'targets' (M2M100/NLLB's language token)

    @property
    def char_limit(self) -> int:
        return self.max_len * self.tokenizer.max_piece_chars * PRECHECK_SLACK

    def _ids(self, text: str, key: str) -> list[int]:
        if self.truncate and len(text) > self.char_limit:
            text = text[: self.char_limit]
        # An imported model may cut its targets with another SentencePiece model (Marian).
        encode = self.tokenizer.encode_target if key == "targets" else self.tokenizer.encode
        ids = encode(text)
        ids.append(self.tokenizer.eos_id)
        return ids

    def __call__(self, item: Any) -> Record:
        raw = (item,) if len(self.keys) == 1 else tuple(item)
        if len(raw) != len(self.keys):
            raise ValueError(f"expected {len(self.keys)} texts per example, got {len(raw)}")
        cleaned = [clean_text(t) for t in raw]
        texts = [t for t, _ in cleaned]
        notes = ("invalid_utf8",) if any(bad for _, bad in cleaned) else ()
        if any(not t or t.isspace() for t in texts):
            if not self.truncate:
                return Record(None, "empty", notes)
            notes += ("empty",)
        if not self.truncate and any(_nonspace_len(t) > self.char_limit for t in texts):
            return Record(None, "too_long_chars", notes)
        features = {}
        truncated = False
        for key, text in zip(self.keys, texts):
            ids = self._ids(text, key)
            if len(ids) == 1 and "empty" not in notes:  # e.g. only characters NFKC deletes
                if not self.truncate:
                    return Record(None, "empty", notes)
                notes += ("empty",)
            prefix = {"inputs": self.source_prefix, "targets": self.target_prefix}.get(key)
            if prefix:
                ids = [*prefix, *ids]
            if len(ids) > self.max_len:
                if not self.truncate:
                    return Record(None, "too_long", notes)
                ids = ids[: self.max_len - 1] + ids[-1:]
                truncated = True
            features[key] = np.asarray(ids, np.int32)
        return Record(features, "", notes + (("truncated",) if truncated else ()))


def process_shard(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    """(process_index, process_count), None from jax; ValueError unless 0 <= index < count."""
    if process_index is None or process_count is None:
        import jax  # only needed for the defaults

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count}).")
    return process_index, process_count


class _ShardRecords(grain.MapDataset):
    """A shard's records, memoized: grain's source -> slice -> map chain monitors each element
    at more cost than tokenizing a pair."""

    def __init__(self, items: Sequence[Any], shard: slice, featurize: Featurizer, cache: bool):
        super().__init__()
        self._items = items
        self._indices = range(len(items))[shard]
        self._featurize = featurize
        self._cache: dict[int, Record] | None = {} if cache else None

    def __len__(self) -> int:
        return len(self._indices)

    def __str__(self) -> str:
        return f"_ShardRecords({self._indices})"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        index %= len(self._indices)
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        record = self._featurize(self._items[self._indices[index]])
        if self._cache is not None:
            self._cache[index] = record
        return record


def shard_records(
    items: Sequence[Any],
    keys: tuple[str, ...],
    tokenizer: Tokenizer,
    shard: tuple[int, int],
    *,
    max_len: int,
    cache: bool = True,
    source_prefix: Sequence[int] = (),
    target_prefix: Sequence[int] = (),
) -> grain.MapDataset:
    """The train `Featurizer` records of items[process_index::process_count], memoized when
    `cache`; ValueError when the shard is empty."""
    pi, pc = shard
    prefixes = dict(source_prefix=tuple(source_prefix), target_prefix=tuple(target_prefix))
    featurize = Featurizer(tokenizer, keys, max_len, **prefixes)
    records = _ShardRecords(items, slice(pi, None, pc), featurize, cache)
    if len(records) == 0:
        raise ValueError(f"Process {pi} of {pc} has no examples ({len(items)} in total).")
    return records
