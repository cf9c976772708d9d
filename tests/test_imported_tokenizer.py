"""Imported translators' tokenizers (data/imported_tokenizer.py, interop/hf_tokenizers.py)
against transformers' own MarianTokenizer, M2M100Tokenizer and NllbTokenizer on files built
here: the same ids (after tx_jax's pad swap) for sources and targets, the same text back."""

import json

import pretrained_fixtures as pf
import pytest

from tx_jax.data.imported_tokenizer import ImportedTokenizer
from tx_jax.data.tokenizer import Tokenizer
from tx_jax.interop import hf_tokenizers

transformers = pytest.importorskip("transformers")


def _tx(perm, ids):
    return [int(perm[i]) for i in ids]


@pytest.mark.parametrize("separate_vocabs", [False, True])
def test_marian_ids_and_text_equal_transformers(tmp_path, separate_vocabs):
    languages = () if separate_vocabs else ("de", "fr")
    cfg = pf.marian_tokenizer_files(tmp_path, languages=languages, separate_vocabs=separate_vocabs)
    hf = transformers.MarianTokenizer.from_pretrained(str(tmp_path))
    ours = hf_tokenizers.read(tmp_path, dict(cfg, model_type="marian"))
    perm = hf_tokenizers.swap_pad(cfg["vocab_size"], cfg["pad_token_id"])
    target_perm = hf_tokenizers.swap_pad(cfg["decoder_vocab_size"], cfg["pad_token_id"])
    assert ours.pad_id == 0 and ours.bos_id == 0  # Marian's decoder starts at pad
    assert ours.eos_id == perm[0] == cfg["vocab_size"] - 1 if not separate_vocabs else True
    for source, target in zip(pf.EN, pf.DE, strict=True):
        if languages:
            source = ">>fr<< " + source
        enc = hf(source, text_target=target)
        assert ours.encode(source) + [ours.eos_id] == _tx(perm, enc["input_ids"])
        assert ours.encode_target(target) + [ours.eos_id] == _tx(target_perm, enc["labels"])
        text = hf.decode(enc["labels"], skip_special_tokens=True)
        assert ours.decode(_tx(target_perm, enc["labels"])) == text == target
    if languages:
        assert ours.source_prefix(target_lang="fr") == [ours.piece_to_id(">>fr<<")]
        assert ours.encode(">>fr<< x")[0] == ours.piece_to_id(">>fr<<")
        with pytest.raises(ValueError, match="'es' is not one of this marian model's 2"):
            ours.source_prefix(target_lang="es")
    else:
        assert ours.source_prefix() == [] and ours.target_prefix() == []


def test_m2m_100_language_tokens_equal_transformers(tmp_path):
    cfg = pf.m2m_100_tokenizer_files(tmp_path)
    hf = transformers.M2M100Tokenizer.from_pretrained(str(tmp_path))
    ours = hf_tokenizers.read(tmp_path, dict(cfg, model_type="m2m_100"))
    perm = hf_tokenizers.swap_pad(cfg["vocab_size"], 1)
    assert (ours.pad_id, ours.eos_id, ours.bos_id) == (0, 2, 2)  # pad 1 <-> <s> 0
    for src_lang, tgt_lang in (("en", "de"), ("de", "fr")):
        hf.src_lang, hf.tgt_lang = src_lang, tgt_lang
        for source, target in zip(pf.EN, pf.DE, strict=True):
            enc = hf(source, text_target=target)
            ids = ours.source_prefix(src_lang) + ours.encode(source) + [ours.eos_id]
            assert ids == _tx(perm, enc["input_ids"])
            labels = ours.target_prefix(tgt_lang) + ours.encode_target(target) + [ours.eos_id]
            assert labels == _tx(perm, enc["labels"])
            # transformers keeps the language token in the text; translations drop it
            assert ours.decode(labels) == hf.decode(enc["labels"][1:], skip_special_tokens=True)
    assert ours.language_id("de") == ours.language_id("__de__") == perm[hf.get_lang_id("de")]


def test_nllb_language_codes_equal_transformers(tmp_path):
    cfg, hf = pf.nllb_tokenizer_files(tmp_path)
    ours = hf_tokenizers.read(tmp_path, dict(cfg, model_type="m2m_100"))
    assert ours.family == "nllb" and len(ours.languages) == 202
    perm = hf_tokenizers.swap_pad(cfg["vocab_size"], 1)
    hf.src_lang, hf.tgt_lang = "eng_Latn", "deu_Latn"
    for source, target in zip(pf.EN, pf.DE, strict=True):
        enc = hf(source, text_target=target)
        ids = ours.source_prefix() + ours.encode(source) + [ours.eos_id]
        assert ids == _tx(perm, enc["input_ids"])
        labels = ours.target_prefix() + ours.encode_target(target) + [ours.eos_id]
        assert labels == _tx(perm, enc["labels"])
        assert ours.decode(labels) == hf.decode(enc["labels"][1:], skip_special_tokens=True)


def test_bytes_round_trip_through_tokenizer_from_bytes(tmp_path):
    cfg = pf.marian_tokenizer_files(tmp_path, languages=("de",))
    ours = hf_tokenizers.read(tmp_path, dict(cfg, model_type="marian"))
    again = Tokenizer.from_bytes(ours.to_bytes())  # what checkpoints and workdirs hold
    assert isinstance(again, ImportedTokenizer) and again == ours
    ours.save(tmp_path / "tokenizer.model")
    assert Tokenizer.load(tmp_path / "tokenizer.model") == ours
    assert again.encode(pf.EN[1]) == ours.encode(pf.EN[1])
    assert again.decode(ours.encode_target(pf.DE[1])) == pf.DE[1]


def test_refusals_name_the_file(tmp_path):
    cfg = pf.marian_tokenizer_files(tmp_path)
    with pytest.raises(hf_tokenizers.TokenizerImportError, match="model_type='bart'"):
        hf_tokenizers.read(tmp_path, dict(cfg, model_type="bart"))
    (tmp_path / "target.spm").unlink()
    with pytest.raises(hf_tokenizers.TokenizerImportError, match=r"target.spm: missing"):
        hf_tokenizers.read(tmp_path, dict(cfg, model_type="marian"))
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    vocab["x"] = 10_000
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(hf_tokenizers.TokenizerImportError, match="'x' has id 10000"):
        hf_tokenizers.read(tmp_path, dict(cfg, model_type="marian"))
