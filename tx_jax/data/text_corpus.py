"""A user's plain-text parallel corpus as TFDS data: one prepared dataset per split.

config.data names each split's files, local or gs:// (docs/data.md): a PREFIX is read as
PREFIX.<source_lang> and PREFIX.<target_lang> (plain or .gz, line-aligned; a wildcard matches
shards, paired by name in sorted order), a path ending .tsv[.gz] as source TAB target lines.
A split is prepared once under a config named by a digest of its files and cleaning
(`split_config`), so a changed file is prepared anew. Empty pairs are dropped in every split,
data.clean's filters in train only, the counts kept in the metadata and logged. Bad input
raises CorpusError (a ValueError) naming the file, the line and the config key.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gzip
import hashlib
import itertools
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import fsspec
import tensorflow_datasets as tfds
from absl import logging as absl_logging
from etils import epath

from tx_jax import paths

NAME = "text"
VERSION = "1.0.0"
# The splits a config names files for, besides those data.eval_split and data.test_split name.
SPLITS = ("train", "validation", "test")
_WILDCARDS = "*?["


class CorpusError(ValueError):
    """Bad corpus input; the message names the file, the line and the config key."""


def base_split(split: str) -> str:
    """'train' of 'train[:1000]'; a ValueError for 'a+b' (a text corpus opens one split)."""
    match = re.fullmatch(r"\s*(\w+)\s*(\[[^\]]*\])?\s*", split)
    if match is None:
        raise ValueError(f"text corpus: split {split!r} is not one split (or a slice of one)")
    return match.group(1)


# ------------------------------------------------------------------ finding the files


def _matches(pattern: str) -> list[str]:
    """The files a path or a wildcard pattern names, sorted (empty when none exist)."""
    if not any(c in pattern for c in _WILDCARDS):
        return [pattern] if epath.Path(pattern).is_file() else []
    return paths.glob(pattern)


def resolve(spec: str, key: str, languages: tuple[str, str]) -> list[tuple[str, ...]]:
    """The shards `spec` names, in sorted order: (source file, target file) for a prefix,
    (tsv file,) for a TSV path. CorpusError naming `key` when nothing or half a pair exists."""
    if spec.endswith((".tsv", ".tsv.gz")):
        found = _matches(spec)
        if not found:
            raise CorpusError(f"{key}={spec!r}: no such file")
        return [(f,) for f in found]
    by_lang = {}
    for lang in languages:
        stems: dict[str, str] = {}
        for suffix in (f".{lang}", f".{lang}.gz"):
            for f in _matches(spec + suffix):
                stem = f[: -len(suffix)]
                if stem in stems:
                    raise CorpusError(f"{key}={spec!r}: both {stems[stem]} and {f}; keep one")
                stems[stem] = f
        by_lang[lang] = stems
    source, target = (by_lang[lang] for lang in languages)
    if not source and not target:
        raise CorpusError(
            f"{key}={spec!r}: no file {spec}.{languages[0]}[.gz] or {spec}.{languages[1]}[.gz] "
            "(a prefix P is read as P.<source_lang> and P.<target_lang>, plain or .gz; a path "
            "ending .tsv or .tsv.gz as source TAB target)"
        )
    for stem in sorted(source.keys() ^ target.keys()):
        have, lang = (
            (source[stem], languages[1]) if stem in source else (target[stem], languages[0])
        )
        raise CorpusError(f"{key}={spec!r}: {have} has no partner {stem}.{lang}[.gz]")
    return [(source[stem], target[stem]) for stem in sorted(source)]


@functools.lru_cache(maxsize=4096)
def _local_digest(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # the cache key: a file rewritten since is hashed again
    return "sha256:" + paths.sha256(path)


def content_id(path: str) -> tuple[int, str]:
    """(size, digest) of a file's bytes: SHA-256 locally, the store's MD5 or CRC32C remotely
    (read from its metadata, not downloaded)."""
    if not paths.is_remote(path):
        stat = os.stat(path)
        return stat.st_size, _local_digest(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    fs, root = fsspec.core.url_to_fs(path)
    info = fs.info(root)
    size = int(info["size"])
    for field in ("md5Hash", "crc32c"):
        if info.get(field):
            return size, f"{field}:{info[field]}"
    return size, "sha256:" + paths.sha256(path, size)


# ------------------------------------------------------------------ the builder


@dataclasses.dataclass(eq=False)  # eq=False like tfds.core.BuilderConfig: stays hashable.
class TextSplitConfig(tfds.core.BuilderConfig):
    """One split of a text corpus: its shards, languages and cleaning (see `split_config`)."""

    split: str = "train"
    key: str = "data.train"
    languages: tuple[str, str] = ("src", "tgt")
    shards: tuple[tuple[str, ...], ...] = ()
    max_chars: int = 0
    max_ratio: float = 0.0
    dedup: bool = False
    num_bytes: int = 0


def split_config(
    split: str, spec: str, languages: tuple[str, str], clean: Mapping[str, Any]
) -> TextSplitConfig:
    """The config of one split whose files `spec` names (cleaning applies to train only),
    named '<split>-<digest>' after its files' names, sizes and digests and the cleaning."""
    key = f"data.{split}"
    shards = resolve(spec, key, languages)
    ids = [(os.path.basename(f), *content_id(f)) for shard in shards for f in shard]
    filters = {"max_chars": int(clean.get("max_chars") or 0)}
    filters["max_ratio"] = float(clean.get("max_ratio") or 0.0)
    if clean.get("dedup"):  # named only when on: a corpus prepared before keeps its digest
        filters["dedup"] = True
    if split != "train":
        filters = {"max_chars": 0, "max_ratio": 0.0}
    fingerprint = {"split": split, "languages": languages, "files": ids, "filters": filters}
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    return TextSplitConfig(
        name=f"{split}-{digest[:16]}",
        description=f"{key}={spec!r}: {languages[0]} -> {languages[1]}, {len(ids)} file(s)",
        split=split,
        key=key,
        languages=tuple(languages),
        shards=tuple(shards),
        num_bytes=sum(size for _, size, _ in ids),
        **filters,
    )


def pair_info(
    builder: tfds.core.DatasetBuilder, languages: Sequence[str], description: str, **kwargs: Any
) -> tfds.core.DatasetInfo:
    """The DatasetInfo of a corpus of two Text features in file order (a test split lines up
    with its reference file); DatasetInfo(builder=...) reads no README next to the module."""
    return tfds.core.DatasetInfo(
        builder=builder,
        description=description,
        features=tfds.features.FeaturesDict({lang: tfds.features.Text() for lang in languages}),
        disable_shuffling=True,
        **kwargs,
    )


class TextTranslation(tfds.core.GeneratorBasedBuilder):
    """A split of a plain-text parallel corpus; its configs come from `split_config`."""

    VERSION = tfds.core.Version(VERSION)
    RELEASE_NOTES = {str(VERSION): "Plain-text pairs (prefix.<lang>[.gz] or .tsv[.gz]), cleaned."}
    BUILDER_CONFIGS: list[TextSplitConfig] = []

    def _info(self) -> tfds.core.DatasetInfo:
        return pair_info(
            self,
            self.builder_config.languages,
            self.builder_config.description,
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager
        return {self.builder_config.split: self._generate_examples()}

    def _generate_examples(self) -> Iterator[tuple[int, dict[str, str]]]:
        """(running index, {source: text, target: text}) of the kept pairs, in file order; the
        counts go to the metadata, written with the data once every pair is read."""
        cfg = self.builder_config
        counts = collections.Counter(read=0, empty=0, too_long=0, ratio=0)
        if cfg.dedup:
            counts["duplicate"] = 0
        seen: set[int] = set()  # pair_hash of each kept pair (dedup)
        for shard in cfg.shards:
            for a, b in read_pairs(shard, cfg.key):
                counts["read"] += 1
                reason = drop_reason(a, b, cfg.max_chars, cfg.max_ratio)
                if not reason and cfg.dedup:
                    key = pair_hash(a, b)
                    reason = "duplicate" if key in seen else None
                    seen.add(key)
                if reason:
                    counts[reason] += 1
                    continue
                yield counts["read"] - 1, {cfg.languages[0]: a, cfg.languages[1]: b}
        dropped = ("empty", "too_long", "ratio", "duplicate")
        counts["kept"] = counts["read"] - sum(counts[k] for k in dropped)
        self.info.metadata["counts"] = dict(counts)
        logging.info("%s", describe_counts(cfg, counts))


def drop_reason(a: str, b: str, max_chars: int, max_ratio: float) -> str | None:
    """Why a pair is dropped ('empty', 'too_long', 'ratio'), or None when it is kept."""
    la, lb = len(a.strip()), len(b.strip())
    if not la or not lb:
        return "empty"
    if max_chars and max(la, lb) > max_chars:
        return "too_long"
    if max_ratio and max(la, lb) / min(la, lb) > max_ratio:
        return "ratio"
    return None


def pair_hash(source: str, target: str) -> int:
    """8 bytes of BLAKE2b of a pair, as an int: equal for equal pairs (and, at 2^-64 a pair,
    for no other). A newline joins the sides: no line read holds one."""
    digest = hashlib.blake2b(f"{source}\n{target}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def describe_counts(cfg: TextSplitConfig, counts: Mapping[str, int]) -> str:
    """One log line: what a split read, dropped and kept."""
    line = (
        f"text corpus {cfg.key} ({len(cfg.shards)} shard(s)): {counts['read']:,} pairs read, "
        f"{counts['empty']:,} with an empty side dropped"
    )
    if cfg.max_chars:
        line += f", {counts['too_long']:,} longer than {cfg.max_chars} characters dropped"
    if cfg.max_ratio:
        line += f", {counts['ratio']:,} with a length ratio over {cfg.max_ratio:g} dropped"
    if cfg.dedup:
        line += f", {counts.get('duplicate', 0):,} duplicates dropped"
    return line + f", {counts['kept']:,} kept"


# ------------------------------------------------------------------ reading


def read_lines(path: str, key: str) -> Iterator[str]:
    """A text file's lines (plain or .gz) without their line ends; CorpusError naming the file,
    the line and `key` for bytes that are not UTF-8 or a damaged gzip file."""
    number = 0
    try:
        gunzip = gzip.open if path.endswith(".gz") else lambda raw, _: contextlib.nullcontext(raw)
        with epath.Path(path).open("rb") as raw, gunzip(raw, "rb") as stream:
            for number, line in enumerate(stream, start=1):
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise CorpusError(
                        f"{path} line {number}: not UTF-8 (byte {line[e.start]:#04x} at column "
                        f"{e.start + 1}) ({key})"
                    ) from None
                if number == 1:
                    text = text.removeprefix("\ufeff")  # a byte order mark is not text
                yield text.rstrip("\r\n")
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise CorpusError(f"{path}: damaged gzip data after line {number} ({e}) ({key})") from None


def read_pairs(shard: tuple[str, ...], key: str) -> Iterator[tuple[str, str]]:
    """The (source, target) pairs of one shard: a TSV file, or two line-aligned files whose
    line counts must agree (CorpusError naming both files and both counts)."""
    if len(shard) == 1:
        (path,) = shard
        for number, line in enumerate(read_lines(path, key), start=1):
            if line.count("\t") != 1:
                raise CorpusError(
                    f"{path} line {number}: {line.count(chr(9))} tabs; a TSV line is "
                    f"source TAB target ({key})"
                )
            a, b = line.split("\t")
            yield a, b
        return
    path_a, path_b = shard
    lines_a, lines_b = read_lines(path_a, key), read_lines(path_b, key)
    for count, (a, b) in enumerate(itertools.zip_longest(lines_a, lines_b)):
        if a is None or b is None:
            count_a = count + (a is not None) + sum(1 for _ in lines_a)
            count_b = count + (b is not None) + sum(1 for _ in lines_b)
            raise CorpusError(
                f"{key}: line counts differ: {path_a} has {count_a:,} lines but {path_b} has "
                f"{count_b:,}; the two files of a shard must be line-aligned translations"
            )
        yield a, b


# ------------------------------------------------------------------ the table's entry


def config_builder_kwargs(data: Any) -> dict:
    """The split specs config.data gives (data.train, data.validation, data.test and the
    splits eval_split/test_split name) and its cleaning, as the builder's arguments."""
    named = [base_split(s) for s in (data.get("eval_split"), data.get("test_split")) if s]
    specs = {name: data.get(name) for name in dict.fromkeys([*SPLITS, *named]) if data.get(name)}
    return {"specs": specs, "clean": dict(data.get("clean") or {})}


def make_builder(
    name: str, *, source_lang: str, target_lang: str, data_dir: str | None, builder_kwargs: dict
) -> TextTranslation:
    """The table entry 'text': the builder of one split's files (builder_kwargs['split'])."""
    if name != NAME:
        raise ValueError(f"Dataset {name!r}: a text corpus is dataset 'text' (configs/text.py)")
    split = base_split(builder_kwargs["split"])
    spec = builder_kwargs.get("specs", {}).get(split)
    if not spec:
        raise CorpusError(
            f"data.{split} is not set: the {split} split of a text corpus is read from the "
            f"files data.{split} names (a prefix P for P.{source_lang} and P.{target_lang}, "
            "or a .tsv file)"
        )
    config = split_config(split, spec, (source_lang, target_lang), builder_kwargs.get("clean", {}))
    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # TFDS warns of a config made per corpus
    try:
        return TextTranslation(config=config, data_dir=data_dir)
    finally:
        absl_logging.set_verbosity(level)


def extra_splits(data: Any) -> list[str]:
    """The splits besides train that a run of `data` reads, each prepared on its own; asked at a
    run's start (plan reads no data): CorpusError naming the key unless data.train and the
    data.eval_split split have files (a test split is optional: its score is then skipped)."""
    specs = config_builder_kwargs(data)["specs"]
    for split in ("train", base_split(data.eval_split)):
        if split not in specs:
            raise CorpusError(
                f"data.{split} is not set: give the files of the {split} split, "
                f"--config.data.{split}=PREFIX (PREFIX.{data.source_lang} and "
                f"PREFIX.{data.target_lang}) or FILE.tsv"
            )
    names = [base_split(s) for s in (data.get("eval_split"), data.get("test_split")) if s]
    return [s for s in dict.fromkeys(names) if s in specs and s != "train"]
