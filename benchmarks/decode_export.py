"""Decoding speed of one trained model in tx_jax, Transformers and CTranslate2.

    python benchmarks/decode_export.py --workdir=runs/default [--n 1000] [--threads 2]
        [--batch 64] [--searches greedy,beam4]

The checkpoint is exported (tx_jax.interop) to a Transformers MarianMT directory and to
CTranslate2 (float32 and int8) under WORKDIR/export_bench/, then the first N sentences of
the run's test split are translated by each, greedy and beam 4 (alpha 0.6), in batches of
--batch sentences, on --threads CPU threads each (JAX: the process's CPU affinity; torch:
set_num_threads; CTranslate2: intra_threads, one translator). tx_jax runs twice: every
source padded to data.max_eval_len, as evaluation pads it, and with --length_buckets (each
batch padded to the smallest bucket that holds it). Each system first translates one batch
(one per bucket: compilation, allocation), then the N sentences are timed once, whole.
Target tokens are the hypotheses' SentencePiece pieces plus EOS, counted the same way for
every system. Also reported: sacreBLEU against the references, and the share of hypotheses
identical to tx_jax's (padded). Writes benchmarks/results/decode_export.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts this checkout first on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=os.path.join(_common.ROOT, "runs", "default"))
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--searches", default="greedy,beam4")
    parser.add_argument("--length_buckets", default="16,32,64", help="tx_jax's second row")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    threads = _common.pin_threads(args.threads)

    import ctranslate2
    import sacrebleu
    import torch
    import transformers

    from tx_jax.data import tasks
    from tx_jax.inference import restore
    from tx_jax.inference.translation import translate_lines
    from tx_jax.interop import ctranslate2 as ct2_export
    from tx_jax.interop import huggingface

    torch.set_num_threads(threads)
    loaded = restore.load(args.workdir)
    tok = loaded.tokenizer
    split = tasks.load_split(loaded.config.data, "test")
    pairs = [split[i] for i in range(min(args.n, len(split)))]
    sources, refs = [s for s, _ in pairs], [r for _, r in pairs]
    out_dir = os.path.join(str(loaded.workdir), "export_bench")
    hf_dir = huggingface.export(loaded, os.path.join(out_dir, "hf"))
    hf_model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    translators = {}
    for q in ("float32", "int8"):
        path = ct2_export.export(loaded, os.path.join(out_dir, f"ct2_{q}"), quantization=q)
        translators[q] = ctranslate2.Translator(
            str(path), device="cpu", inter_threads=1, intra_threads=threads
        )
    max_len = huggingface.max_decode_len(loaded)

    buckets = [int(x) for x in args.length_buckets.split(",") if x]

    def run_tx_jax(lines, beam, length_buckets=()):
        return translate_lines(
            loaded,
            lines,
            beam_size=beam,
            alpha=0.6,
            batch_size=args.batch,
            length_buckets=length_buckets,
        )

    def run_tx_jax_buckets(lines, beam):
        return run_tx_jax(lines, beam, buckets)

    def warm_tx_jax_buckets(lines, beam):  # one batch per bucket: every program compiles
        bounds = [0] + buckets + [loaded.config.data.max_eval_len]
        for lo, hi in zip(bounds, bounds[1:]):
            part = [s for s in lines if lo < len(tok.encode(s)) + 1 <= hi][: args.batch]
            if part:
                run_tx_jax_buckets(part, beam)

    def run_hf(lines, beam):
        out = []
        for i in range(0, len(lines), args.batch):
            batch = hf_tok(lines[i : i + args.batch], return_tensors="pt", padding=True)
            with torch.no_grad():
                ids = hf_model.generate(
                    **batch, num_beams=beam, length_penalty=0.6, do_sample=False
                )
            out += [tok.decode(x[1:].tolist()) for x in ids]
        return out

    def run_ct2(q):
        def run(lines, beam):
            pieces = [[tok.id_to_piece(i) for i in tok.encode(s)] for s in lines]
            results = translators[q].translate_batch(
                pieces,
                max_batch_size=args.batch,
                beam_size=beam,
                length_penalty=0.6,
                max_decoding_length=max_len,
            )
            return [tok.decode([tok.piece_to_id(p) for p in r.hypotheses[0]]) for r in results]

        return run

    systems = {
        "tx_jax (jit, KV cache)": run_tx_jax,
        f"tx_jax, length buckets {args.length_buckets}": run_tx_jax_buckets,
        "transformers generate": run_hf,
        "ctranslate2 float32": run_ct2("float32"),
        "ctranslate2 int8": run_ct2("int8"),
    }
    warmups = {f"tx_jax, length buckets {args.length_buckets}": warm_tx_jax_buckets}
    rows, records = [], []
    for search in args.searches.split(","):
        beam = 1 if search == "greedy" else int(search.removeprefix("beam"))
        reference_hyps = None
        for name, run in systems.items():
            warm = warmups.get(name, lambda lines, beam, run=run: run(lines[: args.batch], beam))
            warm(sources, beam)  # compilation, allocation
            start = time.perf_counter()
            hyps = run(sources, beam)
            seconds = time.perf_counter() - start
            tokens = sum(len(tok.encode(h)) + 1 for h in hyps)
            if reference_hyps is None:
                reference_hyps = hyps
            same = sum(a == b for a, b in zip(hyps, reference_hyps)) / len(hyps)
            bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
            record = dict(
                system=name,
                search=search,
                seconds=seconds,
                sentences_per_s=len(hyps) / seconds,
                target_tokens_per_s=tokens / seconds,
                bleu=bleu,
                same_as_tx_jax=same,
            )
            records.append(record)
            rows.append(
                [
                    name,
                    search,
                    seconds,
                    record["sentences_per_s"],
                    record["target_tokens_per_s"],
                    bleu,
                    same,
                ]
            )
            print(rows[-1], flush=True)
    headers = [
        "system",
        "search",
        "seconds",
        "sentences/s",
        "target tokens/s",
        "BLEU",
        "same as tx_jax",
    ]
    print(_common.table(headers, rows))
    meta = dict(
        n=len(sources),
        threads=threads,
        batch=args.batch,
        workdir=_common.portable_path(str(loaded.workdir)),
        step=loaded.step,
        versions={
            "transformers": transformers.__version__,
            "ctranslate2": ctranslate2.__version__,
        },
    )
    print(
        "wrote", _common.write_json("decode_export", dict(meta, results=records), args.out or None)
    )


if __name__ == "__main__":
    main()
