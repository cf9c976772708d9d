"""Multi30k (task 1) as a TFDS builder: line-aligned image captions in en, de, fr and cs.

One gzip text file per split and language (`file_name`; the 2017 tests lack cs), line i of
train.en.gz translating line i of train.de.gz. One BuilderConfig per unordered pair
(`config_name`) with examples {lang1, lang2} keyed by line number in file order: one prepared
pair serves both directions, and a test split lines up with its reference file. Files come from
the manual directory when it is not empty, else from `release_url()`. Pairs with an empty side
are skipped and counted; text_corpus reads the files (CorpusError naming file and line).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from collections.abc import Iterator, Mapping

import requests
import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from tx_jax.data import text_corpus

LANGUAGES: tuple[str, ...] = ("en", "de", "fr", "cs")

# Split name -> file prefix of its raw files.
SPLIT_FILE_PREFIXES: dict[str, str] = {"train": "train", "validation": "val"} | {
    s: s for s in ("test_2016_flickr", "test_2017_flickr", "test_2017_mscoco", "test_2018_flickr")
}
# Splits every prepared pair must have; the test splits are optional.
REQUIRED_SPLITS: tuple[str, ...] = ("train", "validation")
# Languages the public repository has for each split (used only when downloading).
SPLIT_LANGUAGES: dict[str, frozenset[str]] = {
    split: frozenset(LANGUAGES) - ({"cs"} if "2017" in split else set())
    for split in SPLIT_FILE_PREFIXES
}
RELEASE_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
# A mirror of the raw release's data/task1/raw (same file names) replaces RELEASE_URL.
MIRROR_ENV = "TX_JAX_MULTI30K_URL"
# Seconds to wait for the release's host before saying it cannot be reached: TFDS's downloader
# retries an unreachable host without end.
REACH_TIMEOUT = 20


class SourceUnavailable(ValueError):
    """No raw files in data.manual_dir nor to download: one line (the run stops, no traceback)."""


_CITATION = """\
@inproceedings{elliott-etal-2016-multi30k,
  title = {Multi30K: Multilingual English-German Image Descriptions},
  author = {Elliott, Desmond and Frank, Stella and Sima'an, Khalil and Specia, Lucia},
  booktitle = {Proceedings of the 5th Workshop on Vision and Language},
  year = {2016},
  pages = {70--74},
}
"""


def config_name(lang_a: str, lang_b: str) -> str:
    """The config name of an unordered pair: English first, else alphabetical (('fr', 'cs') ->
    'cs-fr'); ValueError for an unknown or repeated language."""
    for lang in (lang_a, lang_b):
        if lang not in LANGUAGES:
            raise ValueError(
                f"Multi30k has no language {lang!r}; valid languages: {', '.join(LANGUAGES)}."
            )
    if lang_a == lang_b:
        raise ValueError(f"Multi30k needs two different languages, got {lang_a!r} twice.")
    first, second = sorted((lang_a, lang_b), key=lambda lang: (lang != "en", lang))
    return f"{first}-{second}"


def file_name(split: str, lang: str) -> str:
    """Returns the raw file name of a split and language: ('validation', 'de') -> 'val.de.gz'."""
    if split not in SPLIT_FILE_PREFIXES:
        raise ValueError(
            f"Multi30k has no split {split!r}; valid splits: {', '.join(SPLIT_FILE_PREFIXES)}."
        )
    return f"{SPLIT_FILE_PREFIXES[split]}.{lang}.gz"


def _required_files(lang1: str, lang2: str) -> str:
    """'train.en.gz, train.de.gz, val.en.gz, val.de.gz': the files a pair cannot do without."""
    return ", ".join(file_name(s, lang) for s in REQUIRED_SPLITS for lang in (lang1, lang2))


def release_url() -> str:
    """The raw release's address: $TX_JAX_MULTI30K_URL (a mirror) or GitHub's, ending in '/'."""
    return (os.environ.get(MIRROR_ENV) or RELEASE_URL).rstrip("/") + "/"


def _split_files(
    directory: epath.Path, lang1: str, lang2: str
) -> tuple[dict[str, dict[str, epath.Path]], list[str]]:
    """({split: {lang: path}} of the splits whose two files exist, the required files missing)."""
    found: dict[str, dict[str, epath.Path]] = {}
    missing: list[str] = []
    for split in SPLIT_FILE_PREFIXES:
        paths = {lang: directory / file_name(split, lang) for lang in (lang1, lang2)}
        exists = {lang: path.exists() for lang, path in paths.items()}
        if all(exists.values()):
            found[split] = paths
        elif split in REQUIRED_SPLITS:
            missing += [paths[lang].name for lang, ok in exists.items() if not ok]
    return found, missing


def download_urls(lang1: str, lang2: str) -> dict[str, dict[str, str]]:
    """Returns {split: {lang: url}} of the public raw files for the splits both languages have."""
    base = release_url()
    return {
        split: {lang: f"{base}{prefix}.{lang}.gz" for lang in (lang1, lang2)}
        for split, prefix in SPLIT_FILE_PREFIXES.items()
        if {lang1, lang2} <= SPLIT_LANGUAGES[split]
    }


def read_parallel(
    path_a: epath.PathLike, path_b: epath.PathLike
) -> tuple[list[tuple[int, str, str]], int]:
    """([(0-based line, text_a, text_b)] in file order without pairs with an empty side, how
    many were skipped) of two line-aligned gzip files; CorpusError when their counts differ."""
    lines = list(text_corpus.read_pairs((str(path_a), str(path_b)), "Multi30k"))
    pairs = [(i, a, b) for i, (a, b) in enumerate(lines) if a.strip() and b.strip()]
    return pairs, len(lines) - len(pairs)


@dataclasses.dataclass(eq=False)  # eq=False like tfds.core.BuilderConfig: stays hashable.
class Multi30kConfig(tfds.core.BuilderConfig):
    """A Multi30k language pair; `languages` is (lang1, lang2) in canonical order."""

    languages: tuple[str, str] = ("en", "de")


def _pair_configs() -> list[Multi30kConfig]:
    """One config per unordered pair of `LANGUAGES`, 'en-de' first (the default)."""
    names = sorted(
        (config_name(a, b) for a, b in itertools.combinations(LANGUAGES, 2)),
        key=lambda name: (not name.startswith("en"), name != "en-de", name),
    )
    about = "Multi30k task 1, {} and {}."
    return [
        Multi30kConfig(
            name=n, languages=tuple(n.split("-")), description=about.format(*n.split("-"))
        )
        for n in names
    ]


class Multi30k(tfds.core.GeneratorBasedBuilder):
    """Multi30k task 1 raw text, one config per language pair (see the module docstring)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Task 1 raw text; optional test splits where files exist."}
    BUILDER_CONFIGS = _pair_configs()
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Optional. Put the raw gzip files (train.en.gz, val.en.gz, test_2016_flickr.en.gz, ...; "
        "from github.com/multi30k/dataset, data/task1/raw) in the manual directory. "
        "Without them the files are downloaded."
    )

    def _info(self) -> tfds.core.DatasetInfo:
        return text_corpus.pair_info(
            self,
            self.builder_config.languages,
            "Multi30k task 1: Flickr30k image captions and their translations.",
            homepage="https://github.com/multi30k/dataset",
            citation=_CITATION,
        )

    def _split_generators(
        self, dl_manager: tfds.download.DownloadManager
    ) -> dict[str, Iterator[tuple[int, dict[str, str]]]]:
        """{split: examples}; every file is read first, so errors come early."""
        lang1, lang2 = self.builder_config.languages
        pair, needed = f"Multi30k {lang1}-{lang2}", _required_files(lang1, lang2)
        try:
            manual_dir = dl_manager.manual_dir
        except AssertionError:  # TFDS's signal for a manual dir unset, missing or empty
            manual_dir = None
        if manual_dir is not None:
            files, missing = _split_files(epath.Path(manual_dir), lang1, lang2)
            if missing:
                raise FileNotFoundError(
                    f"{pair}: {manual_dir} lacks {', '.join(missing)}; it needs {needed} "
                    "(gzip text, one sentence per line)."
                )
        else:
            try:
                files = dl_manager.download(download_urls(lang1, lang2))
            except Exception as e:  # The download backends raise many kinds.
                raise SourceUnavailable(
                    f"{pair}: no raw files in the manual directory and downloading them from "
                    f"{release_url()} failed ({_short_reason(e)}): put {needed} (and test_*.gz) "
                    "in a directory and pass it as data.manual_dir (tfds.download.DownloadConfig"
                    "(manual_dir=...))"
                ) from e
        generators = {}
        for split, paths in files.items():
            pairs, skipped = read_parallel(paths[lang1], paths[lang2])
            if skipped:
                total = len(pairs) + skipped
                logging.warning(
                    f"{pair} {split}: skipped {skipped} of {total} line pairs with an empty side."
                )
            generators[split] = self._generate_examples(pairs)
        return generators

    def _generate_examples(
        self, pairs: list[tuple[int, str, str]]
    ) -> Iterator[tuple[int, Mapping[str, str]]]:
        """Yields (line_number, {lang1: text, lang2: text}) in file order."""
        lang1, lang2 = self.builder_config.languages
        for line, text1, text2 in pairs:
            yield line, {lang1: text1, lang2: text2}


def make_builder(
    name: str, *, source_lang: str, target_lang: str, data_dir: str | None, builder_kwargs: dict
) -> Multi30k:
    """The builder of the two languages' pair config ('multi30k' with 'de'/'en' -> 'en-de');
    a config that the name ('multi30k/en-fr') or builder_kwargs give must be that one."""
    config = config_name(source_lang, target_lang)
    named = name.partition("/")[2] or builder_kwargs.get("config")
    if named and named != config:
        raise ValueError(
            f"Dataset {name!r}: config {named!r} does not match the languages "
            f"{source_lang!r}/{target_lang!r}; pass name='multi30k' (config {config!r})."
        )
    return Multi30k(data_dir=data_dir, **{**builder_kwargs, "config": config})


def prepares_locally(builder: Multi30k, manual_dir: str | None, download: bool) -> bool:
    """Whether `builder` is prepared from data.manual_dir's raw files (True) or downloads them
    (False, said once the release's host answered); SourceUnavailable naming data.manual_dir
    and data.download when it can do neither, or when manual_dir lacks required files."""
    lang1, lang2 = builder.builder_config.languages
    pair = f"Multi30k {lang1}-{lang2}"
    needed = _required_files(lang1, lang2)
    if manual_dir is None:
        where = "data.manual_dir is not set"
    else:
        directory = epath.Path(manual_dir)
        _, missing = _split_files(directory, lang1, lang2)
        if not missing:
            return True
        if directory.exists() and any(directory.iterdir()):
            raise SourceUnavailable(
                f"{pair}: data.manual_dir {directory} lacks {', '.join(missing)} (gzip text, one "
                "sentence per line): add them, or point data.manual_dir at the raw release"
            )
        where = f"data.manual_dir {directory} " + (
            "is empty" if directory.exists() else "does not exist"
        )
    if not download:
        raise SourceUnavailable(
            f"{pair}: {where}: put the raw files there ({needed}, ...: {RELEASE_URL}) "
            "or set data.download=True to download them"
        )
    url = download_urls(lang1, lang2)["train"][lang1]
    try:
        with requests.get(url, stream=True, timeout=REACH_TIMEOUT) as response:
            response.raise_for_status()
    except requests.RequestException as e:
        reason = _short_reason(e)
        raise SourceUnavailable(
            f"{pair}: {where}, and data.download=True cannot reach {url} ({reason}): put the "
            f"raw files ({needed}, ...) in data.manual_dir, or run where that host is reachable"
        ) from None
    print(f"{pair}: {where}: downloading the raw files from {release_url()} (data.download=True)")
    return False


def _short_reason(error: Exception) -> str:
    """What a failed request says, short: the OS's words when it has them ('[Errno -2] Name
    or service not known'), else its first 200 characters."""
    text = " ".join(str(error).split())
    found = re.findall(r"\[Errno [^\]]*\][^)\"']*", text)
    if found:
        return f"{type(error).__name__}: {found[-1].strip()}"
    return text if len(text) <= 200 else text[:200].rsplit(" ", 1)[0] + " ..."
