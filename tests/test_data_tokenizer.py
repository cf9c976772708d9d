"""Tests for tx_jax.data.tokenizer: reserved ids, round trips, unk handling, serialization."""

import io
import os
import pickle
import random

import numpy as np
import pytest
import sentencepiece as spm

from tx_jax.data import tokenizer as tk

_VOCAB = """a the cat dog sat on mat red blue house tree bird flew over small big
ein der die das Haus Baum Vogel klein groß über rot blau"""
WORDS = _VOCAB.split()


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return _sentences(400)


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory) -> tk.Tokenizer:
    path = tmp_path_factory.mktemp("spm") / "spm.model"
    return tk.train_tokenizer(corpus, vocab_size=100, model_path=str(path))


def test_reserved_ids(tok):
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tk.PAD_ID == 0 and tk.UNK_ID == 1 and tk.BOS_ID == 2 and tk.EOS_ID == 3
    assert 40 <= tok.vocab_size <= 100


def test_round_trip_on_seen_text(tok, corpus):
    for sentence in corpus:
        ids = tok.encode(sentence)
        assert ids, sentence
        assert 0 not in ids and tok.eos_id not in ids and tok.bos_id not in ids
        assert tok.decode(ids) == sentence


def test_unseen_characters_are_unk_never_pad(tok):
    ids = tok.encode("the cat ☃ sat")
    assert tok.unk_id in ids
    assert 0 not in ids
    assert tok.encode("☃")[-1] == 1
    assert all(i != 0 for i in tok.encode("ж ☃ 漢字 the"))


def test_decode_stops_at_eos_and_ignores_padding(tok):
    a, b = tok.encode("the red cat"), tok.encode("ein Haus")
    ids = [tok.bos_id, *a, tok.eos_id, *b, tok.eos_id, 0, 0]
    assert tok.decode(ids) == "the red cat"
    assert tok.decode(np.array([*a, 0, 0, 0], np.int32)) == "the red cat"
    assert tok.decode([tok.eos_id, *a]) == ""
    assert tok.decode([]) == ""
    batch = np.zeros((2, 8), np.int32)
    batch[0, : len(a) + 1] = [*a, tok.eos_id]
    batch[1, : len(b)] = b
    assert tok.decode_batch(batch) == ["the red cat", "ein Haus"]


def test_encode_batch_matches_encode(tok, corpus):
    assert tok.encode_batch(corpus[:50]) == [tok.encode(s) for s in corpus[:50]]
    assert tok.encode_batch(tuple(corpus[:3]), num_threads=1) == [tok.encode(s) for s in corpus[:3]]


def test_bytes_round_trip_and_pickle(tok, corpus):
    blob = tok.to_bytes()
    assert isinstance(blob, bytes) and len(blob) > 0
    again = tk.Tokenizer.from_bytes(blob)
    assert again == tok and again.to_bytes() == blob
    assert [again.encode(s) for s in corpus[:20]] == [tok.encode(s) for s in corpus[:20]]
    assert pickle.loads(pickle.dumps(tok)) == tok


def test_model_saved_at_path(corpus, tmp_path):
    path = tmp_path / "run" / "nested" / "spm.model"  # parent folders are created
    tok = tk.train_tokenizer(corpus, vocab_size=80, model_path=path)
    assert path.read_bytes() == tok.to_bytes()
    assert os.listdir(path.parent) == ["spm.model"]  # no temporary file left behind
    assert tk.Tokenizer.load(path) == tok
    tok.save(path)  # overwriting is fine
    assert tk.Tokenizer.load(str(path)) == tok


def test_training_is_deterministic(corpus, tmp_path):
    a = tk.train_tokenizer(corpus, 90, tmp_path / "a.model", seed=3)
    b = tk.train_tokenizer(list(corpus), 90, tmp_path / "b.model", seed=3)
    assert a.to_bytes() == b.to_bytes()


def test_vocab_larger_than_corpus_supports(corpus, tmp_path):
    tok = tk.train_tokenizer(corpus[:50], vocab_size=5000, model_path=tmp_path / "big.model")
    assert tok.vocab_size < 5000
    assert tok.decode(tok.encode(corpus[0])) == corpus[0]


@pytest.mark.parametrize("model_type", ["bpe", "char", "word"])
def test_other_model_types(corpus, tmp_path, model_type):
    tok = tk.train_tokenizer(corpus, 5000, tmp_path / "m.model", model_type=model_type)
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.decode(tok.encode(corpus[1])) == corpus[1]


def test_bad_training_arguments_raise(corpus, tmp_path):
    with pytest.raises(ValueError, match="vocab_size=5"):
        tk.train_tokenizer(corpus, vocab_size=5, model_path=tmp_path / "x.model")
    with pytest.raises(ValueError, match="no non-empty"):
        tk.train_tokenizer(["", "   ", "\n"], vocab_size=50, model_path=tmp_path / "y.model")
    assert not (tmp_path / "x.model").exists()


def test_user_defined_symbols_and_bytes_input(corpus, tmp_path):
    texts = [s.encode() for s in corpus] + [b"<2de> ein Haus", b"\xff\xfe bad"]
    tok = tk.train_tokenizer(texts, 100, tmp_path / "u.model", user_defined_symbols=["<2de>"])
    assert tok.piece_to_id("<2de>") == 4 and tok.id_to_piece(4) == "<2de>"
    assert 4 in tok.encode("<2de> the cat")


def test_max_sentences_subsample_is_seeded(tmp_path):
    texts = _sentences(300, seed=1)
    a = tk.train_tokenizer(texts, 60, tmp_path / "a.model", max_sentences=100, seed=7)
    b = tk.train_tokenizer(iter(texts), 60, tmp_path / "b.model", max_sentences=100, seed=7)
    assert a == b
    assert tk.sample_sentences(texts, 100, seed=7) == tk.sample_sentences(texts, 100, seed=7)
    assert len(tk.sample_sentences(texts, 100, seed=7)) == 100
    assert tk.sample_sentences(texts, 100, seed=8) != tk.sample_sentences(texts, 100, seed=7)
    assert tk.sample_sentences(texts, 1000, seed=7) == texts  # nothing dropped: corpus order


def test_pair_texts_interleaves():
    assert list(tk.iter_pair_texts([("a", "b"), ("c", "d")])) == ["a", "b", "c", "d"]


def test_rejects_model_without_pad_zero(corpus, tmp_path):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=40, minloglevel=2
    )  # SentencePiece defaults: unk=0, bos=1, eos=2, no pad
    with pytest.raises(ValueError, match="pad_id=0"):
        tk.Tokenizer.from_bytes(model.getvalue())


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_byte_fallback_round_trips_characters_never_seen(corpus, tmp_path, model_type):
    """With byte_fallback, a character absent from the training text is its UTF-8 bytes (one
    piece each) and decodes back to itself; without it, it is <unk>."""
    text = "the cat ☃ sat on ж 漢字"  # none of ☃ ж 漢 字 is in the corpus
    assert not set("☃ж漢字") & set("".join(corpus))
    kw = dict(vocab_size=320, model_type=model_type)
    fallback = tk.train_tokenizer(corpus, model_path=tmp_path / "b.model", byte_fallback=True, **kw)
    ids = fallback.encode(text)
    assert tk.UNK_ID not in ids and 0 not in ids
    snowman = [fallback.piece_to_id(f"<0x{b:02X}>") for b in "☃".encode()]  # E2 98 83
    assert [fallback.id_to_piece(i) for i in snowman] == ["<0xE2>", "<0x98>", "<0x83>"]
    assert any(ids[i : i + 3] == snowman for i in range(len(ids)))
    assert fallback.decode(ids) == text
    assert fallback.decode([fallback.bos_id, *ids, fallback.eos_id, 0, 0]) == text
    assert fallback.decode_batch([ids, fallback.encode("ж")]) == [text, "ж"]
    assert tk.Tokenizer.from_bytes(fallback.to_bytes()).encode(text) == ids
    for sentence in corpus[:50]:  # seen text is not written as bytes
        seen = fallback.encode(sentence)
        assert fallback.decode(seen) == sentence
        assert not any(fallback.id_to_piece(i).startswith("<0x") for i in seen)
    plain = tk.train_tokenizer(corpus, model_path=tmp_path / "p.model", **kw)
    assert plain.encode("☃")[-1] == tk.UNK_ID and tk.UNK_ID in plain.encode(text)
    assert plain.decode(plain.encode(text)) != text


def test_byte_fallback_needs_room_for_the_256_byte_pieces(corpus, tmp_path):
    with pytest.raises(ValueError, match="byte_fallback adds 256 byte pieces"):
        tk.train_tokenizer(corpus, 160, tmp_path / "small.model", byte_fallback=True)
    assert not (tmp_path / "small.model").exists()
