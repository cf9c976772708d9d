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


def _examples(batch):
    """(inputs, targets) id lists of every example of a train or eval batch, packed or not."""
    out = []
    for r in range(batch["inputs"].shape[0]):
        if "inputs_segmentation" not in batch:
            row = [[int(i) for i in batch[k][r] if i != 0] for k in ("inputs", "targets")]
            out += [tuple(row)] if row[0] else []
            continue
        for s in sorted(set(batch["inputs_segmentation"][r].tolist()) - {0}):
            out.append(
                tuple(
                    [int(i) for i in batch[k][r][batch[f"{k}_segmentation"][r] == s]]
                    for k in ("inputs", "targets")
                )
            )
    return out


def _task(tok, source_lang, target_lang):
    """A Multi30k-configured Task (the data section fine-tuning reads) over the
    fixture pairs, held in memory as its train and validation splits."""
    from tx_jax.config import load_config
    from tx_jax.data import tasks

    data = load_config("configs/multi30k.py:pair=en-de").data
    data.update(source_lang=source_lang, target_lang=target_lang, max_train_len=48)
    data.update(tokens_per_batch=2048, bucket_boundaries=[48], max_eval_len=48)
    pairs = list(zip(pf.EN, pf.DE, strict=True))
    return tasks.Task(data, tok, 0, splits={"train": pairs, data.eval_split: pairs})


@pytest.mark.parametrize("family", ["m2m_100", "nllb"])
def test_task_batches_hold_transformers_ids_for_the_data_languages(tmp_path, family):
    # en -> fr, not the tokenizer config's en -> de: the data languages choose the tokens
    # (NLLB's from the two-letter codes a dataset uses).
    if family == "m2m_100":
        cfg = pf.m2m_100_tokenizer_files(tmp_path)
        hf = transformers.M2M100Tokenizer.from_pretrained(str(tmp_path))
        hf.src_lang, hf.tgt_lang = "en", "fr"
    else:
        cfg, hf = pf.nllb_tokenizer_files(tmp_path)
        hf.src_lang, hf.tgt_lang = "eng_Latn", "fra_Latn"
    ours = hf_tokenizers.read(tmp_path, dict(cfg, model_type="m2m_100"))
    assert ours.family == family
    perm = hf_tokenizers.swap_pad(cfg["vocab_size"], 1)
    want = set()
    for source, target in zip(pf.EN, pf.DE, strict=True):
        enc = hf(source, text_target=target)
        want.add((tuple(_tx(perm, enc["input_ids"])), tuple(_tx(perm, enc["labels"]))))
    task = _task(ours, "en", "fr")
    en, fr = ours.language_id("en"), ours.language_id("fr")
    assert (task.source_prefix, task.target_prefix) == ([en], [fr])
    assert fr == perm[hf.convert_tokens_to_ids("__fr__" if family == "m2m_100" else "fra_Latn")]
    # Validation (loss and BLEU batches): every pair once, as transformers encodes it.
    evals = [x for b in task.eval_batches("validation", 1) for x in _examples(b)]
    assert {(tuple(s), tuple(t)) for s, t in evals} == want and len(evals) == len(pf.EN)
    # Training (packed rows): [__en__] + pieces + EOS -> [__fr__] + pieces + EOS.
    train = _examples(next(task.train_iterator(1)))
    assert train and all((tuple(s), tuple(t)) in want for s, t in train)
    assert all(s[0] == en and t[0] == fr and t[-1] == ours.eos_id for s, t in train)


def test_unknown_language_codes_are_refused_naming_the_known_ones(tmp_path):
    cfg, _ = pf.nllb_tokenizer_files(tmp_path)
    ours = hf_tokenizers.read(tmp_path, dict(cfg, model_type="m2m_100"))
    assert ours.language_id("de") == ours.language_id("deu_Latn")
    assert ours.language_id("cs") == ours.language_id("ces_Latn")
    message = (
        r"data.source_lang='en', data.target_lang='xx': language 'xx' is not one of this "
        r"nllb model's 202 language tokens \(ace_Arab, .*; two-letter codes known: "
        r"cs, de, en, fr\)"
    )
    with pytest.raises(ValueError, match=message):
        _task(ours, "en", "xx").eval_batches("validation", 1)
    with pytest.raises(ValueError, match="'sv' is not one of this nllb model's 202"):
        ours.source_prefix("sv")  # Swedish has a token (swe_Latn) but no entry in the table
