"""Hugging Face translator directories built offline for the import tests: SentencePiece
models trained here and tokenizer files laid out as OPUS-MT (Marian) and M2M100 ship them,
read back by transformers' own tokenizer classes."""

from __future__ import annotations

import io
import json
import pathlib

import sentencepiece as spm

EN = [
    "A man in a blue shirt is standing on a ladder.",
    "Two dogs are playing in the snow.",
    "A little girl climbs into a wooden playhouse.",
    "People are walking down a busy street at night.",
    "A woman with a red hat sings on a stage.",
    "The boy kicks a ball across the green field.",
    "Several workers repair the road near the bridge.",
    "An old man reads a newspaper on a bench.",
]
DE = [
    "Ein Mann in einem blauen Hemd steht auf einer Leiter.",
    "Zwei Hunde spielen im Schnee.",
    "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.",
    "Leute gehen nachts eine belebte Straße entlang.",
    "Eine Frau mit einem roten Hut singt auf einer Bühne.",
    "Der Junge kickt einen Ball über das grüne Feld.",
    "Mehrere Arbeiter reparieren die Straße nahe der Brücke.",
    "Ein alter Mann liest auf einer Bank eine Zeitung.",
]


def train_spm(texts: list[str], vocab_size: int, model_type: str = "unigram") -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts * 4),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    return model.getvalue()


def _pieces(model: bytes) -> list[str]:
    sp = spm.SentencePieceProcessor(model_proto=model)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def marian_tokenizer_files(
    out: pathlib.Path, *, languages: tuple[str, ...] = (), separate_vocabs: bool = False
) -> dict:
    """source.spm / target.spm (different models), vocab.json as OPUS-MT's conversion writes
    it (</s> 0, <unk> 1, the pieces, >>xx<< tokens, <pad> last); returns config.json's
    vocabulary keys."""
    out.mkdir(parents=True, exist_ok=True)
    src, tgt = train_spm(EN, 60), train_spm(DE, 70)
    (out / "source.spm").write_bytes(src)
    (out / "target.spm").write_bytes(tgt)

    def vocab(*models: bytes) -> dict[str, int]:
        v = {"</s>": 0, "<unk>": 1}
        for code in languages:
            v.setdefault(f">>{code}<<", len(v))
        for m in models:
            for p in _pieces(m):
                if p not in ("<unk>", "<s>", "</s>"):
                    v.setdefault(p, len(v))
        v["<pad>"] = len(v)
        return v

    config = {}
    if separate_vocabs:
        v, tv = vocab(src), vocab(tgt)
        # transformers' Marian has one pad id for both embeddings: both vocabularies end at it
        size = max(len(v), len(tv))
        v["<pad>"] = tv["<pad>"] = size - 1
        (out / "vocab.json").write_text(json.dumps(v, ensure_ascii=False))
        (out / "target_vocab.json").write_text(json.dumps(tv, ensure_ascii=False))
        config = dict(vocab_size=size, decoder_vocab_size=size, pad_token_id=size - 1)
    else:
        v = vocab(src, tgt)
        (out / "vocab.json").write_text(json.dumps(v, ensure_ascii=False))
        config = dict(vocab_size=len(v), decoder_vocab_size=len(v), pad_token_id=v["<pad>"])
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "MarianTokenizer",
                "source_lang": "en",
                "target_lang": "de",
                "separate_vocabs": separate_vocabs,
                "unk_token": "<unk>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": 512,
            }
        )
    )
    return dict(config, eos_token_id=0, decoder_start_token_id=config["pad_token_id"])


def m2m_100_tokenizer_files(out: pathlib.Path) -> dict:
    """sentencepiece.bpe.model (trained on both languages) and vocab.json as fairseq numbers
    it (<s> <pad> </s> <unk>, then the pieces); M2M100Tokenizer adds the 100 language tokens
    after it; returns config.json's vocabulary keys."""
    out.mkdir(parents=True, exist_ok=True)
    model = train_spm(EN + DE, 90, "bpe")
    (out / "sentencepiece.bpe.model").write_bytes(model)
    v = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for p in _pieces(model):
        v.setdefault(p, len(v))
    (out / "vocab.json").write_text(json.dumps(v, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "M2M100Tokenizer",
                "src_lang": "en",
                "tgt_lang": "de",
                "language_codes": "m2m100",
                "num_madeup_words": 8,
            }
        )
    )
    return dict(
        vocab_size=len(v) + 100 + 8,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=0,
        decoder_start_token_id=2,
    )


def nllb_tokenizer_files(out: pathlib.Path) -> tuple[dict, object]:
    """sentencepiece.bpe.model and the tokenizer.json that transformers' NllbTokenizer writes
    for it with NLLB-200's 202 language codes; returns (config.json's vocabulary keys, the
    transformers tokenizer)."""
    from transformers import NllbTokenizer
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    out.mkdir(parents=True, exist_ok=True)
    (out / "sentencepiece.bpe.model").write_bytes(train_spm(EN + DE, 90, "bpe"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn", "tgt_lang": "deu_Latn"}
        )
    )
    hf = NllbTokenizer.from_pretrained(
        str(out), additional_special_tokens=list(FAIRSEQ_LANGUAGE_CODES)
    )
    hf.save_pretrained(str(out))
    config = dict(
        vocab_size=len(hf), pad_token_id=1, eos_token_id=2, bos_token_id=0, decoder_start_token_id=2
    )
    return config, hf


def randomise(model, seed: int = 0, eos_bias: float = 0.0) -> None:
    """Norm gains and biases, final_logits_bias and every bias away from 1 and 0, so that a
    wrong mapping cannot hide behind them; `eos_bias` added to EOS's output bias makes
    translations end within a few tokens, as a trained model's do."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
                b[0, model.config.eos_token_id] += eos_bias
        for name, p in model.named_parameters():
            if name.endswith("lm_head.bias") or name.endswith("final_logits_bias"):
                p[..., model.config.eos_token_id] += eos_bias


def marian_dir(
    out: pathlib.Path, *, activation: str = "swish", languages=(), eos_bias=1.2, **config
) -> tuple:
    """A tiny random MarianMTModel with the Marian tokenizer files above, saved as
    `save_pretrained` writes it; returns (the model, its tokenizer)."""
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    vocab = marian_tokenizer_files(out, languages=languages)
    torch.manual_seed(0)
    cfg = MarianConfig(
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=128,
        activation_function=activation,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        **{**vocab, **config},
    )
    model = MarianMTModel(cfg).eval()
    randomise(model, eos_bias=eos_bias)
    model.save_pretrained(str(out))
    return model, MarianTokenizer.from_pretrained(str(out))


def m2m_100_dir(out: pathlib.Path) -> tuple:
    """A tiny random M2M100ForConditionalGeneration with the M2M100 tokenizer files above."""
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration, M2M100Tokenizer

    vocab = m2m_100_tokenizer_files(out)
    torch.manual_seed(0)
    cfg = M2M100Config(
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=128,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        **vocab,
    )
    model = M2M100ForConditionalGeneration(cfg).eval()
    randomise(model)
    model.save_pretrained(str(out))
    return model, M2M100Tokenizer.from_pretrained(str(out))
