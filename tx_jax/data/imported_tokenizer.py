"""The tokenizer of an imported pretrained translator (OPUS-MT/Marian, M2M100, NLLB-200).

Those models number SentencePiece pieces with a vocabulary of their own and put their special
tokens elsewhere (Marian: EOS 0, pad last; M2M100/NLLB: pad 1); the vocabulary is reordered at
import so that pad is 0 (interop.pretrained.vocab_permutation): every id here is a tx_jax id.
`encode` / `encode_target` cut with the source / target SentencePiece and number with the
(target) vocabulary; `decode` drops special pieces.

Languages: a multi-target Marian model reads `>>xx<<` before the source (`source_prefix`) and
decodes from pad; M2M100/NLLB sources are [__xx__] + pieces + EOS and the decoder starts at EOS
and is forced to the target's language token (`target_prefix`), which training targets carry
too, as transformers' labels do. NLLB_CODES maps two-letter codes to NLLB's (`deu_Latn`).

`to_bytes()` is a header line and JSON (models in base64), stored where a run stores its
SentencePiece model; `tokenizer.Tokenizer.from_bytes` recognises it.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import sentencepiece as spm
from etils import epath

from tx_jax import paths

MAGIC = b"tx_jax.ImportedTokenizer/1\n"
FAMILIES = ("marian", "m2m_100", "nllb")
PAD_ID = 0
# NLLB-200 names languages by ISO 639-3 code and script; datasets name them by ISO 639-1.
# Only the languages tx_jax's datasets hold (Multi30k): a wrong guess at a script would
# pick another language's token silently, so other codes must be given in full.
NLLB_CODES = {"cs": "ces_Latn", "de": "deu_Latn", "en": "eng_Latn", "fr": "fra_Latn"}


@dataclasses.dataclass(frozen=True, eq=False)
class ImportedTokenizer:
    """A foreign piece vocabulary in tx_jax's numbering (pad 0); see the module docstring."""

    family: str  # marian | m2m_100 | nllb
    source_model: bytes  # SentencePiece proto that cuts source text
    target_model: bytes  # ... target text (Marian's target.spm; otherwise the same)
    # tx_jax id -> piece (the source vocabulary; the target's too when shared)
    pieces: tuple[str, ...]
    target_pieces: tuple[str, ...] | None  # a separate target vocabulary (Marian separate_vocabs)
    unk_id: int
    eos_id: int
    bos_id: int  # the decoder's first input (Marian: pad = 0; M2M100/NLLB: EOS)
    languages: Mapping[str, int]  # language code -> the id of its token
    source_lang: str | None = None  # the defaults of the checkpoint's tokenizer_config
    target_lang: str | None = None
    special_ids: tuple[int, ...] = ()  # ids `decode` drops (pad, EOS, unk, language tokens, ...)
    # The source directory's config.json and tokenizer files (name -> base64 bytes): export
    # writes them back as they were, from any run that descends from the import.
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(
                f"ImportedTokenizer.family={self.family!r}; expected one of {FAMILIES}"
            )
        if PAD_ID in (self.unk_id, self.eos_id):
            raise ValueError("ImportedTokenizer: id 0 must be padding, unk and EOS elsewhere")

    def to_bytes(self) -> bytes:
        d = dataclasses.asdict(self)
        for key in ("source_model", "target_model"):
            d[key] = base64.b64encode(d[key]).decode("ascii")
        d["languages"] = dict(self.languages)
        d["files"] = dict(self.files)
        return MAGIC + json.dumps(d, ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> ImportedTokenizer:
        if not data.startswith(MAGIC):
            raise ValueError("not an ImportedTokenizer (no header line)")
        d = json.loads(data[len(MAGIC) :].decode("utf-8"))
        for key in ("source_model", "target_model"):
            d[key] = base64.b64decode(d[key])
        for key in ("pieces", "target_pieces", "special_ids"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        return cls(**d)

    def save(self, path) -> None:
        """Writes `to_bytes()` to `path` (local or gs://), atomically."""
        paths.write_atomic(path, self.to_bytes())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImportedTokenizer) and other.to_bytes() == self.to_bytes()

    def __hash__(self) -> int:
        return hash(self.to_bytes())

    @property
    def hf_config(self) -> dict | None:
        """The config.json the model was imported with (None if not kept)."""
        raw = self.files.get("config.json")
        return json.loads(base64.b64decode(raw)) if raw else None

    def write_hf(self, out) -> None:
        """Writes the source's tokenizer files into the directory `out`, byte for byte."""
        for name, raw in self.files.items():
            if name != "config.json":  # the exporter writes the model's own
                paths.write_atomic(epath.Path(out) / name, base64.b64decode(raw))

    @functools.cached_property
    def _source_sp(self) -> spm.SentencePieceProcessor:
        return spm.SentencePieceProcessor(model_proto=self.source_model)

    @functools.cached_property
    def _target_sp(self) -> spm.SentencePieceProcessor:
        return spm.SentencePieceProcessor(model_proto=self.target_model)

    @functools.cached_property
    def _source_ids(self) -> dict[str, int]:
        return {p: i for i, p in reversed(list(enumerate(self.pieces)))}  # first id wins

    @functools.cached_property
    def _target_ids(self) -> dict[str, int]:
        if self.target_pieces is None:
            return self._source_ids
        return {p: i for i, p in reversed(list(enumerate(self.target_pieces)))}

    @functools.cached_property
    def _dropped(self) -> frozenset[int]:
        return frozenset(self.special_ids) | {PAD_ID, self.eos_id}

    @property
    def vocab_size(self) -> int:
        """Source vocabulary size (the model's vocab_size; the target's when shared)."""
        return len(self.pieces)

    @property
    def target_vocab_size(self) -> int:
        return len(self.target_pieces or self.pieces)

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @functools.cached_property
    def max_piece_chars(self) -> int:
        return max(len(p.replace("\u2581", " ")) for p in self.pieces)

    def id_to_piece(self, i: int) -> str:
        return self.pieces[int(i)]

    def piece_to_id(self, piece: str) -> int:
        return self._source_ids.get(piece, self.unk_id)

    def language_id(self, code: str) -> int:
        """The id of language `code`'s token (`de`, `__de__`, `>>de<<`, `deu_Latn`; NLLB also
        maps NLLB_CODES: `de` -> `deu_Latn`)."""
        keys = [code, f"__{code}__", f">>{code}<<"]
        if self.family == "nllb" and code in NLLB_CODES:
            keys.append(NLLB_CODES[code])
        for key in keys:
            if key in self.languages:
                return self.languages[key]
        known = ", ".join(sorted(self.languages)[:12]) or "none"
        more = ", ..." if len(self.languages) > 12 else ""
        short = f"; two-letter codes known: {', '.join(sorted(NLLB_CODES))}"
        short = short if self.family == "nllb" else ""
        raise ValueError(
            f"language {code!r} is not one of this {self.family} model's "
            f"{len(self.languages)} language tokens ({known}{more}{short})"
        )

    def source_prefix(self, source_lang: str | None = None, target_lang: str | None = None):
        """Ids before every source: M2M100/NLLB's source language, multi-target Marian's >>xx<<."""
        if self.family == "marian":
            target_lang = target_lang or self.target_lang
            if not self.languages:
                return []
            if target_lang is None:
                raise ValueError("this Marian model has several targets: give --target_lang")
            return [self.language_id(target_lang)]
        source_lang = source_lang or self.source_lang
        if source_lang is None:
            raise ValueError(f"this {self.family} model needs --source_lang")
        return [self.language_id(source_lang)]

    def target_prefix(self, target_lang: str | None = None) -> list[int]:
        """Ids the decoder is forced to emit first (M2M100/NLLB: the target's language)."""
        if self.family == "marian":
            return []
        target_lang = target_lang or self.target_lang
        if target_lang is None:
            raise ValueError(f"this {self.family} model needs --target_lang")
        return [self.language_id(target_lang)]

    def _encode(self, text: str, sp: spm.SentencePieceProcessor, ids: dict[str, int]):
        code = []
        if self.family == "marian" and text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2 :]  # a >>xx<< code is one token
        return [ids.get(p, self.unk_id) for p in code + sp.encode(text, out_type=str)]

    def encode(self, text: str) -> list[int]:
        """Source text -> ids, without language tokens or EOS (the pipeline adds those)."""
        return self._encode(text, self._source_sp, self._source_ids)

    def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        return [self.encode(t) for t in texts]  # in Python: `num_threads` does not apply

    def encode_target(self, text: str) -> list[int]:
        """Target text -> ids with the target SentencePiece model and vocabulary."""
        return self._encode(text, self._target_sp, self._target_ids)

    def _strip(self, ids: Iterable[int]) -> list[int]:
        out = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if i == self.eos_id:
                break
            if i not in self._dropped:
                out.append(i)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Target ids -> text: stops at the first EOS, drops special and language tokens."""
        names = self.target_pieces or self.pieces
        pieces = [names[i] for i in self._strip(ids) if 0 <= i < len(names)]
        text = self._target_sp.decode_pieces(pieces)
        return text.replace("\u2581", " ").strip()

    def decode_batch(self, ids: Iterable[Iterable[int]]) -> list[str]:
        return [self.decode(row) for row in ids]


def is_imported(data: bytes) -> bool:
    return data.startswith(MAGIC)
