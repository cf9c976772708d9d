"""A Hugging Face translator's tokenizer files -> tx_jax's ImportedTokenizer, and back.

    marian   source.spm, target.spm, vocab.json (target_vocab.json with separate_vocabs),
             tokenizer_config.json (source_lang, target_lang, separate_vocabs)
    m2m_100  sentencepiece.bpe.model, vocab.json, language tokens after the vocabulary
             (tokenizer_config.json's added_tokens_decoder, else its language_codes list)
    nllb     sentencepiece.bpe.model with fairseq's numbering (<s> <pad> </s> <unk>, then
             SentencePiece id + 1), the language codes after it, then <mask>

Ids are renumbered by `swap_pad`: the foreign pad id and 0 trade places (data/
imported_tokenizer.py says why); `export` writes the files with the foreign numbering again.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from tx_jax.data.imported_tokenizer import ImportedTokenizer


class TokenizerImportError(ValueError):
    """Tokenizer files that cannot be read exactly; the message names the file and key."""


MARIAN_LANGUAGE = re.compile(r"^>>.+<<$")
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")


def swap_pad(size: int, pad_id: int) -> np.ndarray:
    """perm[tx_id] = foreign id: the foreign pad and id 0 swapped (an involution)."""
    perm = np.arange(size)
    perm[[0, pad_id]] = perm[[pad_id, 0]]
    return perm


def _json(path: epath.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TokenizerImportError(f"{path}: missing (the tokenizer needs it)") from None
    except json.JSONDecodeError as e:
        raise TokenizerImportError(f"{path}: not JSON ({e})") from None


def _bytes(path: epath.Path) -> bytes:
    if not path.exists():
        raise TokenizerImportError(f"{path}: missing (the tokenizer needs it)")
    return path.read_bytes()


def _pieces(vocab: Mapping[str, int], size: int, where: str) -> list[str]:
    """Foreign id -> piece for ids < size; ids no piece names get names no text produces."""
    out: list[str | None] = [None] * size
    for piece, i in vocab.items():
        if not 0 <= int(i) < size:
            raise TokenizerImportError(
                f"{where}: piece {piece!r} has id {i}, outside the model's vocabulary of {size}"
            )
        if out[int(i)] is None:
            out[int(i)] = piece
    return [p if p is not None else f"<tx_jax_unused_{i}>" for i, p in enumerate(out)]


def _unused(pieces: list[str]) -> set[int]:
    """Foreign ids no piece names (e.g. M2M100's made-up words): decoding drops them."""
    return {i for i, p in enumerate(pieces) if p.startswith("<tx_jax_unused_")}


def _special(hf: Mapping[str, Any], key: str) -> int:
    value = hf.get(key)
    if value is None:
        raise TokenizerImportError(f"config.json: {key} is missing")
    return int(value)


def _renumber(pieces: list[str], perm: np.ndarray) -> tuple[str, ...]:
    return tuple(pieces[int(j)] for j in perm)


def _marian(source: epath.Path, hf: Mapping[str, Any]) -> ImportedTokenizer:
    tc = (
        _json(source / "tokenizer_config.json")
        if (source / "tokenizer_config.json").exists()
        else {}
    )
    size = int(hf["vocab_size"])
    pad = _special(hf, "pad_token_id")
    perm = swap_pad(size, pad)
    vocab = _json(source / "vocab.json")
    pieces = _pieces(vocab, size, str(source / "vocab.json"))
    target_pieces, unused = None, _unused(pieces)  # decoded ids: the target vocabulary's
    if tc.get("separate_vocabs"):
        target_size = int(hf.get("decoder_vocab_size") or size)
        target_vocab = _json(source / "target_vocab.json")
        raw = _pieces(target_vocab, target_size, str(source / "target_vocab.json"))
        target_pieces, unused = _renumber(raw, swap_pad(target_size, pad)), _unused(raw)
        languages = {}  # transformers reads >>xx<< tokens only from a shared vocabulary
    else:
        languages = {p: int(perm[i]) for p, i in vocab.items() if MARIAN_LANGUAGE.match(p)}
    unk = vocab.get(tc.get("unk_token", "<unk>"))
    if unk is None:
        raise TokenizerImportError(f"{source / 'vocab.json'}: no <unk> piece")
    eos = _special(hf, "eos_token_id")
    specials = {pad, eos, int(unk)} | unused
    specials |= {int(vocab[p]) for p in tc.get("additional_special_tokens") or () if p in vocab}
    return ImportedTokenizer(
        family="marian",
        source_model=_bytes(source / "source.spm"),
        target_model=_bytes(source / "target.spm"),
        pieces=_renumber(pieces, perm),
        target_pieces=target_pieces,
        unk_id=int(perm[int(unk)]),
        eos_id=int(perm[eos]),
        bos_id=int(perm[_special(hf, "decoder_start_token_id")]),
        languages=languages,
        source_lang=tc.get("source_lang"),
        target_lang=tc.get("target_lang"),
        special_ids=tuple(sorted(int(perm[i]) for i in specials)),
    )


def _added_tokens(tc: Mapping[str, Any], source: epath.Path) -> dict[str, int]:
    """Added (language) tokens -> foreign ids, from tokenizer.json's added_tokens,
    tokenizer_config.json's added_tokens_decoder or added_tokens.json."""
    if (source / "tokenizer.json").exists():
        added = _json(source / "tokenizer.json").get("added_tokens") or []
        return {t["content"]: int(t["id"]) for t in added}
    out = {v["content"]: int(k) for k, v in (tc.get("added_tokens_decoder") or {}).items()}
    if not out and (source / "added_tokens.json").exists():
        out = {k: int(v) for k, v in _json(source / "added_tokens.json").items()}
    return out


def _tokenizer_json_vocab(source: epath.Path) -> dict[str, int] | None:
    """tokenizer.json's piece -> id table (a BPE dict, or a Unigram list in id order)."""
    if not (source / "tokenizer.json").exists():
        return None
    vocab = (_json(source / "tokenizer.json").get("model") or {}).get("vocab")
    if isinstance(vocab, list):
        return {entry[0]: i for i, entry in reversed(list(enumerate(vocab)))}
    return {k: int(v) for k, v in vocab.items()} if vocab else None


def _language_codes(tc: Mapping[str, Any], family: str) -> list[str]:
    """The family's language codes in id order, as transformers numbers them."""
    try:
        if family == "nllb":
            from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

            return list(FAIRSEQ_LANGUAGE_CODES)
        from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

        return [f"__{c}__" for c in FAIRSEQ_LANGUAGE_CODES[tc.get("language_codes", "m2m100")]]
    except ImportError:
        raise TokenizerImportError(
            "tokenizer_config.json has no added_tokens_decoder: the language tokens' ids need "
            "transformers' language-code lists (pip install -e '.[export]')"
        ) from None


def _m2m_100(source: epath.Path, hf: Mapping[str, Any], nllb: bool) -> ImportedTokenizer:
    tc = _json(source / "tokenizer_config.json")
    size = int(hf["vocab_size"])
    pad = _special(hf, "pad_token_id")
    perm = swap_pad(size, pad)
    model = _bytes(source / "sentencepiece.bpe.model")
    exact = _tokenizer_json_vocab(source) if nllb else None
    if exact is not None:
        vocab, base = exact, len(exact)
    elif nllb:  # fairseq's numbering: four specials, then SentencePiece id + 1
        sp_pieces = _sentencepiece_pieces(model)
        vocab = dict(zip(FAIRSEQ_SPECIALS, range(4), strict=True))
        for i, p in enumerate(sp_pieces[3:], start=4):
            vocab.setdefault(p, i)
        base = len(sp_pieces) + 1
    else:
        vocab = {k: int(v) for k, v in _json(source / "vocab.json").items()}
        base = len(vocab)
    added = _added_tokens(tc, source)
    codes = _language_codes(tc, "nllb" if nllb else "m2m_100")
    languages = {c: added.get(c, base + i) for i, c in enumerate(codes)}
    for token, i in added.items():
        vocab.setdefault(token, i)
    vocab.update(languages)
    pieces = _pieces({p: i for p, i in vocab.items() if i < size}, size, str(source))
    unk, eos = vocab["<unk>"], _special(hf, "eos_token_id")
    specials = {pad, eos, unk, vocab["<s>"]} | set(added.values()) | set(languages.values())
    specials |= _unused(pieces)
    return ImportedTokenizer(
        family="nllb" if nllb else "m2m_100",
        source_model=model,
        target_model=model,
        pieces=_renumber(pieces, perm),
        target_pieces=None,
        unk_id=int(perm[unk]),
        eos_id=int(perm[eos]),
        bos_id=int(perm[_special(hf, "decoder_start_token_id")]),
        languages={c: int(perm[i]) for c, i in languages.items() if i < size},
        source_lang=tc.get("src_lang"),
        target_lang=tc.get("tgt_lang"),
        special_ids=tuple(sorted(int(perm[i]) for i in specials if i < size)),
    )


def _sentencepiece_pieces(model: bytes) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def is_nllb(source: epath.Path) -> bool:
    tc = source / "tokenizer_config.json"
    cls = json.loads(tc.read_text()).get("tokenizer_class", "") if tc.exists() else ""
    return cls.startswith("Nllb") or not (source / "vocab.json").exists()


# The files a translator's tokenizer is made of, kept in the ImportedTokenizer for export.
KEPT_FILES = (
    "source.spm",
    "target.spm",
    "vocab.json",
    "target_vocab.json",
    "sentencepiece.bpe.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
)


def _kept(source: epath.Path, hf_config: Mapping[str, Any]) -> dict[str, str]:
    files = {"config.json": json.dumps(dict(hf_config), indent=2).encode("utf-8")}
    files.update({n: (source / n).read_bytes() for n in KEPT_FILES if (source / n).exists()})
    return {n: base64.b64encode(b).decode("ascii") for n, b in files.items()}


def read(source: str | epath.PathLike, hf_config: Mapping[str, Any]) -> ImportedTokenizer:
    """The tokenizer of the Hugging Face directory `source` whose config.json is hf_config."""
    source = epath.Path(source)
    kind = hf_config.get("model_type")
    if kind == "marian":
        tokenizer = _marian(source, hf_config)
    elif kind == "m2m_100":
        tokenizer = _m2m_100(source, hf_config, nllb=is_nllb(source))
    else:
        raise TokenizerImportError(f"config.json: model_type={kind!r}; expected marian or m2m_100")
    return dataclasses.replace(tokenizer, files=_kept(source, hf_config))
