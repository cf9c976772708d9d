"""Synthetic parallel corpora mixed with the real train split: back-translation's data side.

    data.backtranslation = [
        {"source": "gs://b/bt/mono.de.en-*.txt", "target": "gs://b/bt/mono.de-*.txt",
         "ratio": 1.0, "tag": True},
    ]
    data.backtranslation_tag = "<BT>"

A corpus is two line-aligned plain-text sides (a path, a glob or a list, read in sorted order;
'.gz', local or gs://), e.g. `tx_jax translate --input mono.de`'s output as source and mono.de
as target (Sennrich et al., 2016). `ratio`: synthetic examples per real one (1.0: half of every
batch; `proportions`). With "tag": True the id of data.backtranslation_tag (one tokenizer
piece) goes before every source of that corpus, after the task's own prefix (Caswell et al.,
2019). The mixture's state (streams.py) holds each corpus's size, so a file that changed length
is an error at restore. Evaluation reads only the real dataset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from math import inf
from typing import Any

from tx_jax import paths
from tx_jax.config import study_value
from tx_jax.data import text_corpus
from tx_jax.data.tokenizer import Tokenizer

KEY = "data.backtranslation"
REAL = "train"  # the real train split's name in the mixture (its 'kept/train' count)
_FIELDS = {"source", "target", "ratio", "tag", "name"}


@dataclasses.dataclass(frozen=True)
class SyntheticCorpus:
    """One entry of data.backtranslation, checked (module docstring)."""

    name: str  # in the mixture's state and its 'kept/<name>' count: 'synthetic0' unless named
    source: tuple[str, ...]  # paths or globs, read in order
    target: tuple[str, ...]
    ratio: float
    tag: bool


def _files(spec: Any, key: str) -> tuple[str, ...]:
    items = [spec] if isinstance(spec, str) else list(spec or ())
    if not items or not all(isinstance(x, str) and x.strip() for x in items):
        raise ValueError(f"{key}={spec!r}: give a path, a glob or a list of paths")
    return tuple(x.strip() for x in items)


def parse_corpora(data: Any) -> list[SyntheticCorpus]:
    """config.data's synthetic corpora, checked without reading them; [] when unset.
    ValueError names the entry and key (`data.backtranslation[1].ratio`)."""
    spec = study_value(data, "backtranslation") or []
    spec = spec.to_dict() if hasattr(spec, "to_dict") else spec  # a ConfigDict of one dict
    if isinstance(spec, Mapping) or not isinstance(spec, Sequence) or isinstance(spec, str):
        raise ValueError(f"{KEY}={spec!r}: a list of {{'source', 'target', 'ratio', 'tag'}}")
    out = []
    for i, entry in enumerate(spec):
        where = f"{KEY}[{i}]"
        entry = entry.to_dict() if hasattr(entry, "to_dict") else entry
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}={entry!r}: a dict with 'source', 'target' and 'ratio'")
        if unknown := set(entry) - _FIELDS:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(_FIELDS)}")
        for field in ("source", "target", "ratio"):
            if field not in entry:
                raise ValueError(f"{where} has no {field!r}")
        ratio = entry["ratio"]
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < inf:
            raise ValueError(f"{where}.ratio={ratio!r} must be a positive finite number")
        tag = entry.get("tag", False)
        if not isinstance(tag, bool):
            raise ValueError(f"{where}.tag={tag!r} must be true or false")
        name = str(entry.get("name") or f"synthetic{i}")
        if name == REAL or name in [c.name for c in out]:
            raise ValueError(f"{where}.name={name!r} is taken; give each corpus its own name")
        source, target = (_files(entry[side], f"{where}.{side}") for side in ("source", "target"))
        out.append(SyntheticCorpus(name, source, target, float(ratio), tag))
    return out


def backtranslation_tag(data: Any) -> str:
    return study_value(data, "backtranslation_tag")


def validate_config(data: Any, task: str = "translation") -> None:
    """The back-translation keys of config.data, before anything is read."""
    corpora = parse_corpora(data)
    if not corpora:
        return
    if task == "lm":
        raise ValueError(f"{KEY} is for translation; task='lm' reads one side of the pairs")
    if study_value(data, "directions"):
        raise ValueError(
            f"{KEY} with data.directions: synthetic corpora mix into one direction's train "
            "split; a multilingual run has no single one (not supported yet)"
        )
    tag = backtranslation_tag(data)
    if any(c.tag for c in corpora) and not (isinstance(tag, str) and len(tag.split()) == 1):
        raise ValueError(f"data.backtranslation_tag={tag!r} must be one word, e.g. '<BT>'")


def proportions(ratios: Sequence[float]) -> list[float]:
    """The mixture's probabilities of [real, *synthetic] from the synthetic ratios."""
    total = 1.0 + sum(ratios)
    return [1.0 / total, *(r / total for r in ratios)]


def read_side(specs: Sequence[str], key: str) -> tuple[list[str], list[tuple[str, int]]]:
    """Every line of the files `specs` name, in order -> (lines, [(file, line count)]);
    text_corpus.CorpusError naming the file and line for text that is not UTF-8."""
    lines: list[str] = []
    counts: list[tuple[str, int]] = []
    for spec in specs:
        try:
            found = paths.glob(spec)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        if not found:
            raise FileNotFoundError(f"{key}: no file matches {spec!r}")
        for path in found:
            part = list(text_corpus.read_lines(str(path), key))
            lines += part
            counts.append((str(path), len(part)))
    return lines, counts


def _show(files: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{f} ({n} lines)" for f, n in files)


def load_corpus(corpus: SyntheticCorpus, where: str = KEY) -> list[tuple[str, str]]:
    """The aligned (source, target) pairs of one synthetic corpus. A ValueError names both
    sides' files and line counts when they do not align."""
    src, src_files = read_side(corpus.source, f"{where}.source")
    tgt, tgt_files = read_side(corpus.target, f"{where}.target")
    aligned = len(src) == len(tgt)
    if len(src_files) == len(tgt_files):  # file by file: the first pair that differs
        aligned = aligned and all(a[1] == b[1] for a, b in zip(src_files, tgt_files))
    if not aligned:
        raise ValueError(
            f"{where} ({corpus.name}): source and target are not aligned line for line: "
            f"source {_show(src_files)} = {len(src)} lines; target {_show(tgt_files)} = "
            f"{len(tgt)} lines"
        )
    if not src:
        raise ValueError(f"{where} ({corpus.name}): {_show(src_files)}: no lines")
    return list(zip(src, tgt))


def check_tag(tokenizer: Tokenizer, tag: str, where: str) -> int:
    """The id of `tag`, which must be one piece of `tokenizer` -> ValueError naming `where`."""
    i = tokenizer.piece_to_id(tag)
    if i in (tokenizer.unk_id, tokenizer.pad_id):
        raise ValueError(
            f"the tokenizer of {where} has no piece {tag!r}: tagged back-translation "
            f"({KEY}[...].tag) needs the tag as one piece (a tokenizer trained with it as a "
            "user-defined symbol, as this run trains its own; or set the corpora's tag to false)"
        )
    return i
