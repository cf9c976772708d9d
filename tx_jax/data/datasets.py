"""The dataset table: a dataset name -> a random-access view of (source, target) sentences.

`load_translation_split(name, split, source_lang=..., target_lang=...)` is the one place that
turns a dataset name into data, and `load_split(config.data, split)` the same from a config;
the rest of the pipeline only sees a `TranslationSource`, a `Sequence[tuple[str, str]]` over a
TFDS ArrayRecord data source. `DATASETS` says, for each name, how its TFDS builder is made, when
it may be prepared without the network, and which config.data keys become builder arguments:

    'synthetic'              tx_jax.data.synthetic.SyntheticTranslation, languages 'src'/'tgt';
                             generated locally, so prepared on first use whatever `download`
                             says; its sizes come from config.data.synthetic
    'multi30k'               tx_jax.data.multi30k.Multi30k, the pair config chosen from the two
                             languages in either order ('en'/'de' and 'de'/'en' share 'en-de');
                             prepared offline from a manual_dir of raw files
    'text'                   tx_jax.data.text_corpus.TextTranslation: the user's plain-text
                             files that data.train / data.validation / data.test name (local or
                             gs://), each split prepared on its own, keyed by its files' content
    any other name           the TFDS catalog (`TFDS_CATALOG`): e.g. 'wmt14_translate/de-en'.
                             source_lang and target_lang name two text features, the direction
                             being source -> target whatever the config name's order; so any
                             dataset with text supervised keys works (gigaword: 'document' ->
                             'summary'), as in flax's input pipeline

A new dataset is one entry in `DATASETS` plus its TFDS builder (and `make_builder`, when its
builder arguments depend on the languages, as Multi30k's do).

Nothing here needs TensorFlow: data is prepared with `file_format='array_record'` and read with
`builder.as_data_source(split)`. With `download=False` (the default) nothing touches the
network: data that is not prepared in `data_dir` raises FileNotFoundError saying what to do,
unless its entry prepares it locally (synthetic; Multi30k with a `manual_dir`).
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
    """(source_text, target_text) pairs over a TFDS random-access data source.

    Attributes:
      data_source: records {lang: bytes or str}, e.g. a TFDS ArrayRecordDataSource.
      source_lang: feature key of the source side.
      target_lang: feature key of the target side.
      name: the dataset spec it came from (for messages).
      split: the split it came from (for messages).
    """

    data_source: Sequence[Mapping[str, Any]]
    source_lang: str
    target_lang: str
    name: str = ""
    split: str = ""

    def __len__(self) -> int:
        """Returns the number of sentence pairs."""
        return len(self.data_source)

    def _index(self, index: Any) -> int:
        """Returns `index` as a non-negative int; raises TypeError or IndexError."""
        if isinstance(index, slice):
            raise TypeError(f"TranslationSource takes int indices, not slices ({index}).")
        i = operator.index(index)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {self.name}:{self.split} of size {n}")
        return i % n

    def _pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        """Returns (source_text, target_text) of a record, bytes decoded as UTF-8."""
        return _text(record[self.source_lang]), _text(record[self.target_lang])

    def __getitem__(self, index: int) -> tuple[str, str]:
        """Returns the (source_text, target_text) pair at `index` (negative counts from the end)."""
        return self._pair(self.data_source[self._index(index)])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[str, str]]:
        """Returns the pairs at `indices`, read in one batch when the data source can."""
        keys = [self._index(i) for i in indices]
        getitems = getattr(self.data_source, "__getitems__", None)
        records = getitems(keys) if getitems else [self.data_source[k] for k in keys]
        return [self._pair(r) for r in records]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        """Yields every pair in order, reading chunks (cheaper than one read per record)."""
        n = len(self)
        for start in range(0, n, _ITER_CHUNK):
            yield from self.__getitems__(range(start, min(start + _ITER_CHUNK, n)))


def _text(value: Any) -> str:
    """Returns a TFDS Text value as str: bytes (real data) are UTF-8 decoded, str kept."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


# ------------------------------------------------------------------ the table


def config_builder_kwargs(data: Any) -> dict:
    """`data.builder_kwargs`: extra TFDS builder arguments (config, version, ...) as given."""
    return dict(data.get("builder_kwargs") or {})


def network_only(builder: tfds.core.DatasetBuilder, manual_dir: str | None, download: bool):
    """A catalog dataset is prepared from its downloads: never without the network."""
    del builder, manual_dir, download
    return False


def catalog_builder(
    name: str, *, source_lang: str, target_lang: str, data_dir: str | None, builder_kwargs: dict
) -> tfds.core.DatasetBuilder:
    """The TFDS catalog's builder of `name` ('wmt14_translate/de-en'); the languages are
    feature keys, read in either order, so they do not choose the builder."""
    del source_lang, target_lang
    _import_tfds_translate()
    try:
        return tfds.builder(name, data_dir=data_dir, **builder_kwargs)
    except tfds.core.registered.DatasetNotFoundError:
        raise ValueError(_unknown_dataset_message(name)) from None


@dataclasses.dataclass(frozen=True)
class DatasetEntry:
    """One row of `DATASETS`: how a named dataset becomes prepared data.

    Attributes:
      builder: (name, *, source_lang, target_lang, data_dir, builder_kwargs) -> its TFDS
        builder, not prepared yet; ValueError for languages or a config it cannot give.
      prepares_locally: (builder, manual_dir, download) -> whether it can be prepared without
        the network; it raises FileNotFoundError when local files it would read are missing.
      hint: what to do when the data is not prepared and cannot be prepared locally.
      config_kwargs: config.data -> the builder's keyword arguments.
      extra_splits: config.data -> the splits a run reads besides train that are prepared on
        their own (a text corpus's); empty when preparing train prepares every split.
      per_split: whether a builder is one split's (builder_kwargs['split']), not every one's.
      raw_bytes: builder -> how much it reads to prepare, None when unknown (downloads): what
        a multi-host run may prepare itself without waiting long (preparation.py).
    """

    builder: Callable[..., tfds.core.DatasetBuilder]
    prepares_locally: Callable[[tfds.core.DatasetBuilder, str | None, bool], bool] = network_only
    hint: str = "pass download=True to download and prepare it (network)"
    config_kwargs: Callable[[Any], dict] = config_builder_kwargs
    extra_splits: Callable[[Any], list[str]] = lambda data: []
    per_split: bool = False
    raw_bytes: Callable[[tfds.core.DatasetBuilder], int | None] = lambda builder: None


DATASETS: dict[str, DatasetEntry] = {
    "synthetic": DatasetEntry(
        builder=synthetic.make_builder,
        prepares_locally=synthetic.prepares_locally,
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
        prepares_locally=text_corpus.prepares_locally,
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
    """The table's row of a dataset name; 'multi30k/en-de' is Multi30k's row (its builder
    checks the config), a name the table lacks is the TFDS catalog's."""
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
    """Opens one split of a translation dataset for random access.

    Args:
      name: a name of `DATASETS` ('synthetic', 'multi30k') or of the TFDS catalog
        ('wmt14_translate/de-en').
      split: a split of the dataset ('train', 'validation', 'test_2016_flickr', ...); TFDS
        slices such as 'train[:1000]' work too.
      source_lang: feature key of the source side ('en', 'src', ...).
      target_lang: feature key of the target side.
      data_dir: where TFDS data is (or is prepared); None for TFDS's default
        (~/tensorflow_datasets or $TFDS_DATA_DIR). A gs:// data_dir must hold the prepared
        data, which is read from a verified local copy (staging.py).
      manual_dir: directory of raw files (Multi30k: train.en.gz, val.en.gz, ...); passed to TFDS
        as DownloadConfig(manual_dir=...).
      download: whether data that is not prepared may be downloaded and prepared.
      builder_kwargs: extra keyword arguments of the TFDS builder (config, version, ...).
      data_cache_dir: where a gs:// data_dir is staged (None: staging.cache_root's default).

    Returns:
      A TranslationSource whose items are (source_text, target_text) str pairs.

    Raises:
      ValueError: unknown dataset name, language or split (the message lists valid ones).
      FileNotFoundError: the data is not prepared and may not be prepared here.
    """
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
        _announce_counts(builder)
    return TranslationSource(
        data_source=builder.as_data_source(split),
        source_lang=source_lang,
        target_lang=target_lang,
        name=name,
        split=split,
    )


def _maker(entry, name, split, source_lang, target_lang, builder_kwargs) -> Callable:
    """entry.builder with everything but data_dir; a dataset prepared split by split gets
    the split in its builder_kwargs."""
    kwargs = {**(builder_kwargs or {}), **({"split": split} if entry.per_split else {})}
    return functools.partial(
        entry.builder,
        name,
        source_lang=source_lang,
        target_lang=target_lang,
        builder_kwargs=kwargs,
    )


def _staged(make, entry, remote, data_cache_dir, manual_dir, download) -> str:
    """The local data_dir to read a gs:// data_dir's prepared data from (staging.py: the
    version directory this builder reads, copied and verified). Data that is not there yet
    and may be prepared here is prepared in a temporary directory and published to the store
    first, so that other hosts (and later runs) read the same files."""
    # array_record's reader opens local files only, hence the copy.
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
def _announce_counts_once(key: str, line: str) -> None:
    del key
    print(line, flush=True)


def _announce_counts(builder: text_corpus.TextTranslation) -> None:
    """The counts of a text corpus's split (read, dropped, kept), once per split and process,
    on process 0's console."""
    line = text_corpus.counts_line(builder)
    if line and jax.process_index() == 0:
        _announce_counts_once(builder.builder_config.name, line)


def has_split(data: Any, split: str) -> bool:
    """Whether config.data can give `split`: for a dataset prepared split by split (a text
    corpus), whether its files are named; for the others, assumed (TFDS says when opened)."""
    return text_corpus.has_split(data, split) if entry_of(data.dataset).per_split else True


def run_splits(data: Any) -> list[str]:
    """'train' and the other splits a run of config.data reads that are prepared on their
    own (a text corpus's validation and test); for other datasets preparing train prepares
    every split."""
    return ["train", *entry_of(data.dataset).extra_splits(data)]


def unprepared_bytes(data: Any, split: str) -> int | None:
    """0 when config.data's `split` is prepared where a run reads it (data_dir, or published
    in a gs:// data_dir); else how many bytes preparing it reads, None when unknown (a
    download)."""
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
    """One split of config.data's dataset: `data.dataset` read source_lang -> target_lang,
    from data_dir (prepared there from manual_dir, or downloaded, as `data.download` allows),
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


def _import_tfds_translate() -> None:
    """Registers TFDS's translation builders (wmt14_translate, ...).

    TFDS imports its legacy builder packages in a fixed order and stops at the first
    ImportError; without h5py (`nearest_neighbors`) it never reaches `translate`, so
    'wmt14_translate' would be "not found". Importing the package directly avoids that.
    """
    # A trimmed TFDS may lack the package; tfds.builder then reports what it finds.
    with contextlib.suppress(ImportError):
        import tensorflow_datasets.translate  # noqa: F401


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
    pair = f" (supervised keys: {keys[0]} -> {keys[1]})" if _is_key_pair(keys) else ""
    for role, lang in (("source_lang", source_lang), ("target_lang", target_lang)):
        if lang not in available:
            raise ValueError(
                f"{role}={lang!r} is not a feature of {label}; available: {', '.join(available)}"
                f"{pair}."
            )
    if source_lang == target_lang:
        raise ValueError(f"source_lang and target_lang are both {source_lang!r} for {label}.")


def _is_key_pair(keys: Any) -> bool:
    """Whether TFDS supervised_keys are (input feature, target feature), two names."""
    return isinstance(keys, tuple) and len(keys) == 2 and all(isinstance(k, str) for k in keys)


def _ensure_prepared(
    builder: tfds.core.DatasetBuilder,
    entry: DatasetEntry,
    label: str,
    *,
    manual_dir: str | None,
    download: bool,
) -> None:
    """Prepares the data as ArrayRecord when allowed; raises FileNotFoundError otherwise.

    Allowed: when the table entry prepares it locally (synthetic always; Multi30k with a
    manual_dir, whose files it checks first, so a wrong directory fails here rather than
    falling back to a download), and for any dataset with download=True.
    """
    if builder.is_prepared():
        return
    if not (entry.prepares_locally(builder, manual_dir, download) or download):
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
