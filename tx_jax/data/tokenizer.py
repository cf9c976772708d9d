"""SentencePiece subword tokenizer: one joint source-target vocabulary (paper, Section 5.1).

Reserved ids of every model trained here: 0 <pad> (only padding), 1 <unk>, 2 <s> (BOS, the
decoders' start token, never added by `encode`), 3 </s> (EOS, appended by the input pipeline;
`decode` stops at the first one). `to_bytes()`/`from_bytes()` carry the model proto, so a
checkpoint stores the exact vocabulary it was trained with.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm
from etils import epath

from tx_jax import paths

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3

# Sentences beyond this many are subsampled (seeded reservoir) before training.
DEFAULT_MAX_SENTENCES = 2_000_000


def sample_sentences(texts: Iterable[str | bytes], max_sentences: int, seed: int) -> list[str]:
    """Non-empty lines of `texts`, reservoir-sampled down to `max_sentences` (seeded; corpus
    order when nothing is dropped)."""
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for raw in texts:
        line = (raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw).strip()
        if not line:
            continue
        if len(sample) < max_sentences:
            sample.append(line)
        else:
            j = rng.randint(0, seen)
            if j < max_sentences:
                sample[j] = line
        seen += 1
    return sample


def train_tokenizer(
    texts: Iterable[str | bytes],
    vocab_size: int,
    model_path: str | epath.PathLike,
    *,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    byte_fallback: bool = False,
    user_defined_symbols: Sequence[str] = (),
    max_sentences: int = DEFAULT_MAX_SENTENCES,
    max_sentence_length: int = 8192,
    seed: int = 0,
    num_threads: int = 1,
) -> Tokenizer:
    """Trains a joint SentencePiece model on `texts`, writes it to `model_path` atomically and
    returns it; the same input gives identical bytes (1 thread). `vocab_size` counts the
    reserved ids and may come out smaller on a small corpus; `byte_fallback` adds 256 byte
    pieces for unknown characters; `user_defined_symbols` (tags) get ids 4, 5, ... ValueError
    for no usable text or a vocabulary too small for the characters."""
    sentences = sample_sentences(texts, max_sentences, seed)
    if not sentences:
        raise ValueError("train_tokenizer: no non-empty sentence in `texts`.")
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            byte_fallback=byte_fallback,
            user_defined_symbols=list(user_defined_symbols),
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            hard_vocab_limit=False,
            input_sentence_size=0,  # we sample ourselves (seeded) above
            shuffle_input_sentence=False,
            max_sentence_length=max_sentence_length,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as e:
        hint = " (byte_fallback adds 256 byte pieces to the vocabulary)" if byte_fallback else ""
        raise ValueError(
            f"SentencePiece training failed (vocab_size={vocab_size}, model_type={model_type},"
            f" {len(sentences)} sentences){hint}: {e}"
        ) from e
    tokenizer = Tokenizer.from_bytes(model.getvalue())
    tokenizer.save(model_path)
    return tokenizer


class Tokenizer:
    """A loaded SentencePiece model with pad id 0, an <unk> id != 0 and an EOS."""

    def __init__(self, model_proto: bytes):
        self._proto = bytes(model_proto)
        self._sp = sp = spm.SentencePieceProcessor(model_proto=self._proto)
        self.pad_id, self.unk_id = sp.pad_id(), sp.unk_id()
        self.bos_id, self.eos_id = sp.bos_id(), sp.eos_id()
        if self.pad_id != PAD_ID or self.unk_id == PAD_ID:
            raise ValueError(
                f"Tokenizer needs pad_id=0 and unk_id!=0, got pad_id={self.pad_id},"
                f" unk_id={self.unk_id}."
            )
        if self.eos_id < 0:
            raise ValueError("Tokenizer needs an EOS piece (eos_id >= 0).")
        # a text of n characters needs at least n / max_piece_chars ids
        self.max_piece_chars = max(len(sp.id_to_piece(i)) for i in range(self.vocab_size))

    @classmethod
    def load(cls, path: str | epath.PathLike) -> Tokenizer:
        """Loads the tokenizer file at `path` (local or any epath); see `from_bytes`."""
        return cls.from_bytes(epath.Path(path).read_bytes())

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> Tokenizer:
        """The tokenizer `to_bytes` wrote: a SentencePiece model proto, or an imported model's
        (imported_tokenizer.py), so no reader needs to know which."""
        from tx_jax.data import imported_tokenizer

        if imported_tokenizer.is_imported(model_proto):
            return imported_tokenizer.ImportedTokenizer.from_bytes(model_proto)
        return cls(model_proto)

    def to_bytes(self) -> bytes:
        """The serialized model proto; `Tokenizer.from_bytes(t.to_bytes())` equals `t`."""
        return self._proto

    def save(self, path: str | epath.PathLike) -> None:
        """Writes the model to `path` atomically, making its directory."""
        epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
        paths.write_atomic(path, self._proto)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and other._proto == self._proto

    def __hash__(self) -> int:
        return hash(self._proto)

    def __getstate__(self) -> bytes:
        return self._proto

    def __setstate__(self, state: bytes) -> None:
        self.__init__(state)

    @property
    def vocab_size(self) -> int:
        """Number of ids, reserved ones included (ids are 0 .. vocab_size - 1)."""
        return self._sp.vocab_size()

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self._sp.piece_to_id(piece)

    def encode(self, text: str) -> list[int]:
        """Text -> ids, without BOS or EOS. Unseen characters become `unk_id`, never 0 (or
        their UTF-8 byte pieces, '<0xE2>', in a model trained with byte_fallback)."""
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        """`encode` over many texts, in parallel C++ threads (-1: one per core)."""
        return self._sp.encode(list(texts), num_threads=num_threads)

    def encode_target(self, text: str) -> list[int]:
        """Target text -> ids: `encode` (an imported model may cut targets otherwise)."""
        return self._sp.encode(text)

    @property
    def target_vocab_size(self) -> int:
        return self.vocab_size

    def source_prefix(self, source_lang: str | None = None, target_lang: str | None = None):
        """Ids before every source (none: a multilingual run's tags come from its config)."""
        return []

    def target_prefix(self, target_lang: str | None = None) -> list[int]:
        """Ids the decoder is forced to start with (none for a model trained here)."""
        return []

    def _strip(self, ids: Iterable[int]) -> list[int]:
        """Ids up to (excluding) the first EOS, without padding and BOS."""
        out = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if i == self.eos_id:
                break
            if i != PAD_ID and i != self.bos_id:
                out.append(i)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Ids (list or 1-D array) -> text; stops at the first EOS, ignores padding and BOS."""
        return self._sp.decode(self._strip(ids))

    def decode_batch(self, ids: Iterable[Iterable[int]]) -> list[str]:
        """`decode` for each row of a [B, L] array or a list of id lists."""
        return [self.decode(row) for row in ids]


def iter_pair_texts(pairs: Iterable[tuple[str, str]]) -> Iterator[str]:
    """Source and target of each pair, interleaved: the input for a joint vocabulary."""
    for source, target in pairs:
        yield source
        yield target
