"""The dataset table: a dataset name -> a random-access view of (source, target) sentences.

`load_translation_split` (or `load_split(config.data, split)`) turns a name into a
`TranslationSource` over a TFDS ArrayRecord data source. `DATASETS` holds how each of
'synthetic', 'multi30k' and 'text' is built, prepared and configured; any other name is the
TFDS catalog's ('wmt14_translate/de-en'), source_lang and target_lang naming two text features.
Nothing here needs TensorFlow; with download=False, data not prepared in data_dir raises
FileNotFoundError saying what to do, unless its entry prepares it locally.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import difflib
import functools
import operator
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import tensorflow_datasets as tfds
from etils import epath

from tx_jax import paths
from tx_jax.data import multi30k, staging, synthetic, text_corpus

_ITER_CHUNK = 1024  # Records per batched read when iterating.


@dataclasses.dataclass(frozen=True)
class TranslationSource(collections.abc.Sequence):
    """(source_text, target_text) pairs over records {lang: bytes or str} of a TFDS random-access
    data source; name and split are for messages."""

    data_source: Sequence[Mapping[str, Any]]
    source_lang: str
    target_lang: str
    name: str = ""
    split: str = ""

    def __len__(self) -> int:
        return len(self.data_source)

    def _index(self, index: Any) -> int:
        if isinstance(index, slice):
            raise TypeError(f"TranslationSource takes int indices, not slices ({index}).")
        i = operator.index(index)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {self.name}:{self.split} of size {n}")
        return i % n

    def _pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        """(source_text, target_text) of a record, bytes (real data) decoded as UTF-8."""
        a, b = record[self.source_lang], record[self.target_lang]
        return tuple(x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in (a, b))

    def __getitem__(self, index: int) -> tuple[str, str]:
        return self._pair(self.data_source[self._index(index)])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[str, str]]:
        """The pairs at `indices`, read in one batch when the data source can."""
        keys = [self._index(i) for i in indices]
        getitems = getattr(self.data_source, "__getitems__", None)
        records = getitems(keys) if getitems else [self.data_source[k] for k in keys]
        return [self._pair(r) for r in records]

    def __iter__(self) -> Iterator[tuple[str, str]]:  # in chunks: cheaper than record by record
        n = len(self)
        for start in range(0, n, _ITER_CHUNK):
            yield from self.__getitems__(range(start, min(start + _ITER_CHUNK, n)))


# ------------------------------------------------------------------ the table


def catalog_builder(
    name: str, *, source_lang: str, target_lang: str, data_dir: str | None, builder_kwargs: dict
) -> tfds.core.DatasetBuilder:
    """The TFDS catalog's builder of `name` ('wmt14_translate/de-en'); the languages are
    feature keys, read in either order, so they do not choose the builder."""
    del source_lang, target_lang
    with contextlib.suppress(ImportError):  # TFDS skips these after an ImportError (no h5py)
        import tensorflow_datasets.translate  # noqa: F401
    try:
        return tfds.builder(name, data_dir=data_dir, **builder_kwargs)
    except tfds.core.registered.DatasetNotFoundError:
        raise ValueError(_unknown_dataset_message(name)) from None


@dataclasses.dataclass(frozen=True)
class DatasetEntry:
    """One row of `DATASETS`: `builder` (name, *, source_lang, target_lang, data_dir,
    builder_kwargs) -> its unprepared TFDS builder; `prepares_locally` (or (builder, manual_dir,
    download) -> it) and, when not, `hint`; `config_kwargs` config.data -> builder arguments
    (default: data.builder_kwargs); `extra_splits` and `per_split` for data prepared split by
    split; `raw_bytes` how much preparing reads (None: a download), for preparation.py."""

    builder: Callable[..., tfds.core.DatasetBuilder]
    prepares_locally: bool | Callable[[tfds.core.DatasetBuilder, str | None, bool], bool] = False
    hint: str = "pass download=True to download and prepare it (network)"
    config_kwargs: Callable[[Any], dict] = lambda data: dict(data.get("builder_kwargs") or {})
    extra_splits: Callable[[Any], list[str]] = lambda data: []
    per_split: bool = False
    raw_bytes: Callable[[tfds.core.DatasetBuilder], int | None] = lambda builder: None


DATASETS: dict[str, DatasetEntry] = {
    "synthetic": DatasetEntry(
        builder=synthetic.make_builder,
        prepares_locally=True,
        hint="it is generated on first use",
        config_kwargs=synthetic.config_builder_kwargs,
        raw_bytes=lambda builder: 0,
    ),
    "multi30k": DatasetEntry(
        builder=multi30k.make_builder,
        prepares_locally=multi30k.prepares_locally,
        hint="pass manual_dir=<directory with train.en.gz, val.en.gz, ...> or download=True",
        raw_bytes=lambda builder: 0,  # 4 MB of text
    ),
    text_corpus.NAME: DatasetEntry(
        builder=text_corpus.make_builder,
        prepares_locally=True,  # its files are read where they are (local or gs://)
        hint="its files are read where data.<split> names them",
        config_kwargs=text_corpus.config_builder_kwargs,
        extra_splits=text_corpus.extra_splits,
        per_split=True,
        raw_bytes=lambda builder: builder.builder_config.num_bytes,
    ),
}
# Every other name: a dataset of the TFDS catalog (or any registered TFDS builder).
TFDS_CATALOG = DatasetEntry(builder=catalog_builder)


def entry_of(name: str) -> DatasetEntry:
    """The table's row of a name ('multi30k/en-de': Multi30k's), else the TFDS catalog's."""
    return DATASETS.get(name.partition("/")[0], TFDS_CATALOG)


# ------------------------------------------------------------------ loading


def load_translation_split(
    name: str,
    split: str,
    *,
    source_lang: str,
    target_lang: str,
    data_dir: str | None = None,
    manual_dir: str | None = None,
    download: bool = False,
    builder_kwargs: dict | None = None,
    data_cache_dir: str | None = None,
) -> TranslationSource:
    """One split ('train', 'train[:1000]', ...) of dataset `name` as (source, target) str pairs;
    a gs:// data_dir is read from a local copy in data_cache_dir (staging.py). ValueError for an
    unknown name, language or split (listing valid ones), FileNotFoundError for data not
    prepared that may not be."""
    entry = entry_of(name)
    make = _maker(entry, name, split, source_lang, target_lang, builder_kwargs)
    if data_dir is not None and paths.is_remote(data_dir):
        data_dir = _staged(make, entry, str(data_dir), data_cache_dir, manual_dir, download)
    builder = make(data_dir=data_dir)
    label = f"{name} ({builder.info.full_name})"
    _check_languages(builder, label, source_lang, target_lang)
    _ensure_prepared(builder, entry, label, manual_dir=manual_dir, download=download)
    _check_split(builder, label, split)
    if isinstance(builder, text_corpus.TextTranslation):
        counts = (builder.info.metadata or {}).get("counts")
        line = text_corpus.describe_counts(builder.builder_config, counts) if counts else None
        _announce_counts(builder.builder_config.name, line)
    return TranslationSource(
        data_source=builder.as_data_source(split),
        source_lang=source_lang,
        target_lang=target_lang,
        name=name,
        split=split,
    )


def _maker(entry, name, split, source_lang, target_lang, builder_kwargs) -> Callable:
    """entry.builder with everything but data_dir (and the split, when `entry.per_split`)."""
    kwargs = {**(builder_kwargs or {}), **({"split": split} if entry.per_split else {})}
    return functools.partial(
        entry.builder,
        name,
        source_lang=source_lang,
        target_lang=target_lang,
        builder_kwargs=kwargs,
    )


def _staged(make, entry, remote, data_cache_dir, manual_dir, download) -> str:
    """The local copy (array_record reads local files only) of a gs:// data_dir's prepared data;
    data not there yet is prepared here and published first, so every host reads the same."""
    local_root = staging.local_data_dir(remote, data_cache_dir)
    relative = staging.builder_relative_dir(make(data_dir=local_root), local_root)
    if not staging.is_published(remote, relative):
        with tempfile.TemporaryDirectory(prefix="tx_jax_prepare_") as tmp:
            builder = make(data_dir=tmp)
            label = f"{builder.name} ({builder.info.full_name})"
            try:
                _ensure_prepared(builder, entry, label, manual_dir=manual_dir, download=download)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"{e} (data.data_dir={remote!r})") from None
            staging.publish(os.fspath(builder.data_dir), f"{remote.rstrip('/')}/{relative}")
    return staging.stage_prepared(remote, relative, data_cache_dir)


@functools.cache
def _announce_counts(key: str, line: str | None) -> None:
    """A text corpus split's counts (read, dropped, kept), once per split, on process 0."""
    if line and jax.process_index() == 0:
        print(line, flush=True)


def has_split(data: Any, split: str) -> bool:
    """Whether config.data can give `split`: for a dataset prepared split by split (a text
    corpus), whether its files are named; for the others, assumed (TFDS says when opened)."""
    if not entry_of(data.dataset).per_split:
        return True
    return text_corpus.base_split(split) in text_corpus.config_builder_kwargs(data)["specs"]


def run_splits(data: Any) -> list[str]:
    """'train' and the splits a run of config.data reads that are prepared on their own (a text
    corpus's validation and test; preparing train prepares every split of the others)."""
    return ["train", *entry_of(data.dataset).extra_splits(data)]


def unprepared_bytes(data: Any, split: str) -> int | None:
    """0 when config.data's `split` is prepared where a run reads it (data_dir, or published in
    a gs:// data_dir); else how many bytes preparing it reads, None for a download."""
    entry = entry_of(data.dataset)
    make = _maker(
        entry, data.dataset, split, data.source_lang, data.target_lang, entry.config_kwargs(data)
    )
    if data.data_dir and paths.is_remote(data.data_dir):
        local_root = staging.local_data_dir(str(data.data_dir), data.get("data_cache_dir"))
        builder = make(data_dir=local_root)
        relative = staging.builder_relative_dir(builder, local_root)
        if staging.is_published(str(data.data_dir), relative):
            return 0
    else:
        builder = make(data_dir=data.data_dir)
        if builder.is_prepared():
            return 0
    return entry.raw_bytes(builder)


def load_split(data: Any, split: str) -> TranslationSource:
    """`load_translation_split` of config.data's dataset, languages, directories and download,
    with the builder arguments its table entry reads from `data`."""
    return load_translation_split(
        data.dataset,
        split,
        source_lang=data.source_lang,
        target_lang=data.target_lang,
        data_dir=data.data_dir,
        manual_dir=data.manual_dir,
        download=data.download,
        builder_kwargs=entry_of(data.dataset).config_kwargs(data),
        data_cache_dir=data.get("data_cache_dir"),
    )


def _unknown_dataset_message(name: str) -> str:
    """Returns the message for an unknown dataset name, with close and translation names."""
    known = tfds.core.registered.list_imported_builders()
    base = name.split("/")[0].split(":")[0]
    close = difflib.get_close_matches(base, [*known, *DATASETS], n=3)
    translation = sorted(n for n in known if "translate" in n)
    return (
        f"Unknown dataset {name!r}. Valid names: {', '.join(map(repr, DATASETS))}, or a TFDS "
        f"catalog name such as 'wmt14_translate/de-en'"
        + (f"; did you mean {', '.join(close)}?" if close else ".")
        + f" TFDS translation datasets: {', '.join(translation)}."
    )


def _check_languages(
    builder: tfds.core.DatasetBuilder, label: str, source_lang: str, target_lang: str
) -> None:
    """Raises ValueError unless both languages are distinct text features of the dataset."""
    available = list(builder.info.features.keys())
    keys = builder.info.supervised_keys
    # A dataset whose sides are not languages (gigaword) names them in its supervised keys.
    named = isinstance(keys, tuple) and len(keys) == 2 and all(isinstance(k, str) for k in keys)
    pair = f" (supervised keys: {keys[0]} -> {keys[1]})" if named else ""
    for role, lang in (("source_lang", source_lang), ("target_lang", target_lang)):
        if lang not in available:
            raise ValueError(
                f"{role}={lang!r} is not a feature of {label}; available: {', '.join(available)}"
                f"{pair}."
            )
    if source_lang == target_lang:
        raise ValueError(f"source_lang and target_lang are both {source_lang!r} for {label}.")


def _ensure_prepared(
    builder: tfds.core.DatasetBuilder,
    entry: DatasetEntry,
    label: str,
    *,
    manual_dir: str | None,
    download: bool,
) -> None:
    """Prepares the data as ArrayRecord when its entry prepares it locally or download=True;
    raises FileNotFoundError otherwise."""
    if builder.is_prepared():
        return
    local = entry.prepares_locally
    if not ((local(builder, manual_dir, download) if callable(local) else local) or download):
        raise FileNotFoundError(
            f"{label} is not prepared in {builder.data_dir}. Set data_dir to the directory where "
            f"it is prepared (ArrayRecord), or {entry.hint}."
        )
    builder.download_and_prepare(
        file_format="array_record",
        download_config=tfds.download.DownloadConfig(
            manual_dir=epath.Path(manual_dir) if manual_dir else None
        ),
    )


def _check_split(builder: tfds.core.DatasetBuilder, label: str, split: str) -> None:
    """Raises ValueError unless every split named in `split` ('a+b[:10%]') is in the data."""
    available = list(builder.info.splits.keys())
    for part in split.split("+"):
        base = re.sub(r"\[.*\]$", "", part.strip())
        if base not in available:
            raise ValueError(
                f"Split {base!r} is not in {label} at {builder.data_dir}; "
                f"available: {', '.join(available)}."
            )
