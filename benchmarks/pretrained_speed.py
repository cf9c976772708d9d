"""Scoring and translation speed of an OPUS-MT-en-de-shaped model: tx_jax against transformers,
same model, same batches, in one process on this CPU.

    python benchmarks/pretrained_speed.py [--pairs=1000] [--translate=200] [--batch_size=32]

The model is transformers' MarianMTModel at OPUS-MT en-de's size (vocabulary 58,101, d_model
512, 6 + 6 layers, 8 heads, d_ff 2048, swish), random weights, saved with save_pretrained and
imported with tx_jax import. Its tokenizer: SentencePiece models trained here on Multi30k
(../shared/data/multi30k) laid out as OPUS-MT's, so sentences cut into realistic pieces. EOS's
output bias is raised so that translations end after a few dozen tokens, as a trained model's
do (random weights otherwise run to the output limit).

Scoring: ln p(target | source) of the first --pairs pairs of test_2016_flickr (tx_jax:
inference.likelihood; transformers: the model's forward with labels, log-softmax, gather),
both in batches of --batch_size sorted by length. Translation: greedy and beam 4 over the first
--translate sources (tx_jax: translate_lines; transformers: generate, batches sorted by length,
max_new_tokens = the batch's longest source + 50, tx_jax's limit). Each timed after a warm-up
pass over the same data (compilation excluded). Prints a JSON line per measurement.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"

OPUS_MT_EN_DE = dict(
    d_model=512,
    encoder_layers=6,
    decoder_layers=6,
    encoder_attention_heads=8,
    decoder_attention_heads=8,
    encoder_ffn_dim=2048,
    decoder_ffn_dim=2048,
    activation_function="swish",
    max_position_embeddings=512,
    scale_embedding=True,
    dropout=0.1,
)
VOCAB = 58_101


def _lines(name: str) -> list[str]:
    with gzip.open(MULTI30K / name, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def build(out: pathlib.Path, eos_bias: float):
    import pretrained_fixtures as pf
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    out.mkdir(parents=True, exist_ok=True)
    src = pf.train_spm(_lines("train.en.gz")[:20000], 8000)
    tgt = pf.train_spm(_lines("train.de.gz")[:20000], 8000)
    (out / "source.spm").write_bytes(src)
    (out / "target.spm").write_bytes(tgt)
    vocab = {"</s>": 0, "<unk>": 1}
    for model in (src, tgt):
        for p in pf._pieces(model):
            if p not in ("<unk>", "<s>", "</s>"):
                vocab.setdefault(p, len(vocab))
    for i in range(len(vocab), VOCAB - 1):
        vocab[f"<unused{i}>"] = i  # OPUS-MT's vocabulary is 58,101 pieces
    vocab["<pad>"] = VOCAB - 1
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"source_lang": "en", "target_lang": "de", "separate_vocabs": False})
    )
    torch.manual_seed(0)
    config = MarianConfig(
        **OPUS_MT_EN_DE,
        vocab_size=VOCAB,
        decoder_vocab_size=VOCAB,
        pad_token_id=VOCAB - 1,
        eos_token_id=0,
        decoder_start_token_id=VOCAB - 1,
    )
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias[0, 0] += eos_bias
    model.save_pretrained(str(out))
    return model, MarianTokenizer.from_pretrained(str(out))


def _timed(fn, reps: int = 1) -> float:
    fn()  # warm-up: compilation, caches
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def hf_scores(model, tok, sources, targets, batch_size):
    import torch

    order = sorted(range(len(sources)), key=lambda i: len(targets[i]))
    out = np.zeros(len(sources))
    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            enc = tok(
                [sources[i] for i in idx],
                text_target=[targets[i] for i in idx],
                return_tensors="pt",
                padding=True,
            )
            logits = model(**enc).logits
            logp = torch.log_softmax(logits, -1)
            labels = enc["labels"]
            mask = labels != tok.pad_token_id
            picked = logp.gather(-1, labels[..., None])[..., 0] * mask
            out[idx] = picked.sum(1).numpy()
    return out


def tx_translate(loaded, sources, batch_size, beams):
    """tx_jax's output ids per source (EOS and padding dropped), batches as translate's."""
    from tx_jax.data import eval_pipeline
    from tx_jax.inference import quality

    tokens: list = [None] * len(sources)
    batches = list(
        eval_pipeline.encode_sources(
            sources,
            loaded.tokenizer,
            max_len=256,
            batch_size=batch_size,
            bucket_boundaries=[16, 24, 40, 64, 256],
            sort_by_length=True,
        )
    )
    fn = quality._greedy if beams == 1 else quality._beam
    static = dict(config=loaded.model_config, eos_id=loaded.tokenizer.eos_id)
    if beams > 1:
        static.update(beam_size=beams, length_penalty=1.0, length_penalty_kind="fairseq")
    import jax

    for b in batches:
        out = jax.device_get(fn(loaded.params, b["inputs"], **static))
        out = np.asarray(out[0])[:, 0] if beams > 1 else np.asarray(out)  # the best beam
        for row, (i, ok) in enumerate(zip(b["example_index"], b["example_mask"], strict=True)):
            if ok:
                ids = out[row].tolist()
                eos = loaded.tokenizer.eos_id
                tokens[int(i)] = ids[: ids.index(eos)] if eos in ids else [x for x in ids if x]
    return tokens


def hf_translate(model, tok, sources, batch_size, beams):
    import torch

    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out: list = [None] * len(sources)
    perm_to_tx = np.arange(model.config.vocab_size)
    pad = model.config.pad_token_id
    perm_to_tx[[0, pad]] = perm_to_tx[[pad, 0]]
    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            enc = tok([sources[i] for i in idx], return_tensors="pt", padding=True)
            gen = model.generate(
                **enc,
                num_beams=beams,
                do_sample=False,
                max_new_tokens=enc["input_ids"].shape[1] + 50,
                length_penalty=1.0,
            )
            for i, ids in zip(idx, gen.tolist(), strict=True):
                ids = ids[1:]  # the decoder's start token
                ids = ids[: ids.index(0)] if 0 in ids else ids  # EOS is 0 in Marian's ids
                out[i] = [int(perm_to_tx[x]) for x in ids if x != tok.pad_token_id]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--translate", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--eos_bias", type=float, default=0.0)
    parser.add_argument("--skip_score", action="store_true")
    parser.add_argument("--beams", default="1,4", help="beam sizes to translate with")
    parser.add_argument("--root", default=None)
    args = parser.parse_args()

    import torch

    from tx_jax.config import load_config
    from tx_jax.inference import restore
    from tx_jax.interop import importer

    root = pathlib.Path(args.root or tempfile.mkdtemp(prefix="tx_jax_opus_"))
    if (root / "w").exists():  # a previous run's model
        import transformers

        model = transformers.MarianMTModel.from_pretrained(str(root / "hf")).eval()
        tok = transformers.MarianTokenizer.from_pretrained(str(root / "hf"))
    else:
        model, tok = build(root / "hf", args.eos_bias)
        base = load_config("configs/default.py")
        importer.import_model(root / "hf", root / "w", base_config=base)
    loaded = restore.load(root / "w")
    sources = _lines("test_2016_flickr.en.gz")[: args.pairs]
    targets = _lines("test_2016_flickr.de.gz")[: args.pairs]
    info = dict(torch_threads=torch.get_num_threads(), batch_size=args.batch_size)

    if not args.skip_score:
        score(loaded, model, tok, sources, targets, args.batch_size, info)
    few = sources[: args.translate]
    for beams in (int(b) for b in args.beams.split(",")):
        translate(loaded, model, tok, few, args.batch_size, beams, info)


def score(loaded, model, tok, sources, targets, batch_size, info) -> None:
    from tx_jax.inference import likelihood

    ours: list = []
    t = _timed(
        lambda: ours.__setitem__(
            slice(None), likelihood.score_pairs(loaded, sources, targets, batch_size=batch_size)
        )
    )
    theirs = np.zeros(len(sources))
    h = _timed(
        lambda: theirs.__setitem__(slice(None), hf_scores(model, tok, sources, targets, batch_size))
    )
    diff = np.max(np.abs(np.array([s.logprob for s in ours]) - theirs) / np.abs(theirs))
    print(
        json.dumps(
            dict(
                info,
                what="score",
                pairs=len(sources),
                tx_jax_pairs_per_s=round(len(sources) / t, 1),
                transformers_pairs_per_s=round(len(sources) / h, 1),
                max_rel_diff=float(diff),
            )
        ),
        flush=True,
    )


def translate(loaded, model, tok, sources, batch_size, beams, info) -> None:
    """Output tokens per second of each (random weights: rows run to their limits; tx_jax
    stops each at its own, source + 50, transformers the batch at its longest's)."""
    mine: list = []
    t = _timed(
        lambda: mine.__setitem__(slice(None), tx_translate(loaded, sources, batch_size, beams))
    )
    hf: list = []
    h = _timed(
        lambda: hf.__setitem__(slice(None), hf_translate(model, tok, sources, batch_size, beams))
    )
    ours_tokens, their_tokens = sum(len(x) for x in mine), sum(len(x) for x in hf)
    same = sum(a == b[: len(a)] for a, b in zip(mine, hf, strict=True))
    print(
        json.dumps(
            dict(
                info,
                what=f"translate beam {beams}",
                sentences=len(sources),
                tx_jax_tokens_per_s=round(ours_tokens / t, 1),
                transformers_tokens_per_s=round(their_tokens / h, 1),
                tx_jax_seconds=round(t, 2),
                transformers_seconds=round(h, 2),
                tx_jax_tokens=ours_tokens,
                transformers_tokens=their_tokens,
                same_prefix=same,
            )
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
