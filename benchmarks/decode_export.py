"""Decoding speed of one trained model in tx_jax, Transformers and CTranslate2: in process
after compilation, and whole processes timed from outside.

    python benchmarks/decode_export.py --workdir=runs/default [--n 1000] [--threads 2]
        [--batch 64] [--searches greedy,beam4] [--reps 3] [--processes 2] [--skip_in_process]

The checkpoint is exported (tx_jax.interop) to a Transformers MarianMT directory and to
CTranslate2 (float32 and int8) under WORKDIR/export_bench/, then the first N sentences of
the run's test split are translated by each, greedy and beam 4 (length penalty 0.6), on
--threads CPU threads each (JAX: the process's CPU affinity; torch: set_num_threads; CTranslate2:
intra_threads, one translator; each CTranslate2 model with its two x86 matrix libraries,
MKL and oneDNN: CT2_BACKENDS).

In process: tx_jax runs as evaluation and `translate` run it by default (sources sorted by
length, each batch padded to the smallest eval bucket that holds it) and, for reference,
with every source padded to data.max_eval_len (the old default); Transformers and
CTranslate2 get batches of --batch sentences. Each system runs in a process of its own
(their thread pools would compete in one), first translates the N sentences once
(compilation, allocation), then is timed whole --reps times, the fastest run reported.
Target tokens are the hypotheses' SentencePiece pieces plus EOS, counted the same way for
every system. Also reported: sacreBLEU against the references, and the share of
hypotheses identical to tx_jax's.

Whole processes (--processes R > 0, R runs each, the median reported): `python -m
tx_jax evaluate --workdir=W --split=test --beam_size=B` with a cold JAX compilation cache (a
new directory) and a warm one (the same directory, second run), and a process that loads
the CTranslate2 (float32, both libraries) or Transformers export, translates the split and
scores it with sacreBLEU, as a user of those would. Writes
benchmarks/results/decode_export.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
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
    parser.add_argument("--reps", type=int, default=3, help="timed runs per system (fastest)")
    parser.add_argument("--processes", type=int, default=2, help="runs per whole process")
    parser.add_argument("--skip_in_process", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # SYSTEM#:SEARCH:OUT.json
    args = parser.parse_args()
    threads = _common.pin_threads(args.threads)

    import sacrebleu

    from tx_jax.data import datasets
    from tx_jax.inference import restore
    from tx_jax.inference.translation import translate_lines
    from tx_jax.interop import huggingface

    loaded = restore.load(args.workdir)
    tok = loaded.tokenizer
    split = datasets.load_split(loaded.config.data, "test")
    pairs = [split[i] for i in range(min(args.n, len(split)))]
    sources, refs = [s for s, _ in pairs], [r for _, r in pairs]
    out_dir = os.path.join(str(loaded.workdir), "export_bench")
    hf_dir = os.path.join(out_dir, "hf")
    max_len = huggingface.max_decode_len(loaded)
    if not args.one:  # the parent exports; each --one process reads what it wrote
        from tx_jax.interop import ctranslate2 as ct2_export

        huggingface.export(loaded, hf_dir)
        for q in ("float32", "int8"):
            ct2_export.export(loaded, os.path.join(out_dir, f"ct2_{q}"), quantization=q)
    # Each library is imported only by the process that times it: with torch and a
    # Transformers model loaded, CTranslate2 ran 3.5x slower in the same process.
    hf = {}

    def hf_model():
        if not hf:
            import torch
            import transformers

            torch.set_num_threads(threads)
            hf["torch"] = torch
            hf["model"] = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
            hf["tok"] = transformers.AutoTokenizer.from_pretrained(hf_dir)
        return hf["torch"], hf["model"], hf["tok"]

    translators = {}

    def translator(q):
        if q not in translators:
            import ctranslate2

            translators[q] = ctranslate2.Translator(
                os.path.join(out_dir, f"ct2_{q}"),
                device="cpu",
                inter_threads=1,
                intra_threads=threads,
            )
        return translators[q]

    def run_tx_jax(lines, beam, length_buckets=None):
        return translate_lines(
            loaded,
            lines,
            beam_size=beam,
            length_penalty=0.6,
            batch_size=loaded.config.data.eval_batch_size,
            length_buckets=length_buckets,
            warn=lambda m: None,
        )

    def run_tx_jax_padded(lines, beam):
        return run_tx_jax(lines, beam, length_buckets=())

    def run_hf(lines, beam):
        torch, model, hf_tok = hf_model()
        out = []
        for i in range(0, len(lines), args.batch):
            batch = hf_tok(lines[i : i + args.batch], return_tensors="pt", padding=True)
            with torch.no_grad():
                ids = model.generate(**batch, num_beams=beam, length_penalty=0.6, do_sample=False)
            out += [tok.decode(x[1:].tolist()) for x in ids]
        return out

    def run_ct2(q):
        def run(lines, beam):
            pieces = [[tok.id_to_piece(i) for i in tok.encode(s)] for s in lines]
            results = translator(q).translate_batch(
                pieces,
                max_batch_size=args.batch,
                beam_size=beam,
                length_penalty=0.6,
                max_decoding_length=max_len,
            )
            return [tok.decode([tok.piece_to_id(p) for p in r.hypotheses[0]]) for r in results]

        return run

    systems = {
        "tx_jax (sorted, eval buckets: the default)": run_tx_jax,
        "tx_jax, every source padded to max_eval_len": run_tx_jax_padded,
        "transformers generate": run_hf,
    }
    for q in ("float32", "int8"):
        for backend in CT2_BACKENDS:
            systems[f"ctranslate2 {q} ({backend})"] = run_ct2(q)
    if args.one:  # one system, one search, in this process alone: times and hypotheses
        index, search, out = args.one.split(":", 2)
        name = list(systems)[int(index)]
        beam = 1 if search == "greedy" else int(search.removeprefix("beam"))
        systems[name](sources, beam)  # compilation, allocation
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            hyps = systems[name](sources, beam)
            times.append(time.perf_counter() - start)
        with open(out, "w") as f:
            json.dump({"times": times, "hyps": hyps}, f)
        return
    rows, records = [], []
    for search in args.searches.split(",") if not args.skip_in_process else []:
        runs = {name: _alone(args, k, name, search) for k, name in enumerate(systems)}
        reference_hyps = None
        for name, run in runs.items():
            hyps, seconds = run["hyps"], min(run["times"])
            tokens = sum(len(tok.encode(h)) + 1 for h in hyps)
            if reference_hyps is None:
                reference_hyps = hyps
            same = sum(a == b for a, b in zip(hyps, reference_hyps)) / len(hyps)
            bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
            record = dict(
                system=name,
                search=search,
                seconds=seconds,
                all_seconds=[round(t, 3) for t in run["times"]],
                sentences_per_s=len(hyps) / seconds,
                target_tokens_per_s=tokens / seconds,
                bleu=bleu,
                same_as_tx_jax=same,
            )
            records.append(record)
            rows.append([name, search, seconds, len(hyps) / seconds, tokens / seconds, bleu, same])
            print(rows[-1], run["times"], flush=True)
    headers = [
        "system",
        "search",
        "seconds",
        "sentences/s",
        "target tokens/s",
        "BLEU",
        "same as tx_jax",
    ]
    if rows:
        print(_common.table(headers, rows))
    processes = whole_processes(args, loaded, out_dir, len(sources), threads)
    meta = dict(
        n=len(sources),
        threads=threads,
        batch=args.batch,
        reps=args.reps,
        workdir=_common.portable_path(str(loaded.workdir)),
        step=loaded.step,
        versions={
            name: importlib.metadata.version(name)
            for name in ("transformers", "ctranslate2", "torch", "jax")
        },
    )
    payload = dict(meta, results=records, processes=processes)
    print("wrote", _common.write_json("decode_export", payload, args.out or None))


# CTranslate2's matrix library on x86 CPUs (its CT2_USE_MKL): it picks Intel MKL on Intel CPUs
# and oneDNN elsewhere, and neither is fastest everywhere (on a 2-core Sapphire Rapids VM MKL
# made its float32 greedy 4x slower than oneDNN), so it is timed with both.
CT2_BACKENDS = {"MKL": "1", "oneDNN": "0"}


def _ct2_env(name: str) -> dict[str, str]:
    for backend, flag in CT2_BACKENDS.items():
        if name.startswith("ctranslate2") and name.endswith(f"({backend})"):
            return {"CT2_USE_MKL": flag}
    return {}


def _alone(args, index: int, name: str, search: str) -> dict:
    """Time one system in a process of its own (`--one`): the libraries' thread pools (XLA,
    PyTorch's and CTranslate2's OpenMP) then never compete, which in one shared process
    slowed CTranslate2 2-3x."""
    import subprocess
    import tempfile

    out = os.path.join(tempfile.mkdtemp(prefix="decode_alone_"), "run.json")
    argv = [a for a in sys.argv[1:] if not a.startswith("--one")]
    command = [sys.executable, os.path.abspath(__file__), *argv, f"--one={index}:{search}:{out}"]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env.update(_ct2_env(name))
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name} {search}: {proc.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


# A user of the exports: load, translate the test split, score it (the references and
# sources come from a file the benchmark writes).
_CT2_PROCESS = """
import json, sys, ctranslate2, sacrebleu, sentencepiece as spm
d = json.load(open(sys.argv[1]))
tok = spm.SentencePieceProcessor(model_file=d["tokenizer"])
tr = ctranslate2.Translator(d["model"], device="cpu", inter_threads=1, intra_threads=d["threads"])
pieces = [tok.encode(s, out_type=str) for s in d["sources"]]
out = tr.translate_batch(pieces, max_batch_size=64, beam_size=d["beam"], length_penalty=0.6,
                         max_decoding_length=d["max_len"])
hyps = [tok.decode(r.hypotheses[0]) for r in out]
print(sacrebleu.corpus_bleu(hyps, [d["refs"]]).score)
"""
_HF_PROCESS = """
import json, sys, torch, transformers, sacrebleu, sentencepiece as spm
d = json.load(open(sys.argv[1]))
torch.set_num_threads(d["threads"])
tok = spm.SentencePieceProcessor(model_file=d["tokenizer"])
model = transformers.AutoModelForSeq2SeqLM.from_pretrained(d["model"]).eval()
hf_tok = transformers.AutoTokenizer.from_pretrained(d["model"])
hyps = []
for i in range(0, len(d["sources"]), 64):
    batch = hf_tok(d["sources"][i : i + 64], return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = model.generate(**batch, num_beams=d["beam"], length_penalty=0.6, do_sample=False)
    hyps += [tok.decode(x[1:].tolist()) for x in ids]
print(sacrebleu.corpus_bleu(hyps, [d["refs"]]).score)
"""


def whole_processes(args, loaded, out_dir: str, n: int, threads: int) -> list[dict]:
    """Each whole process, timed from outside: tx_jax's evaluate (cold and warm compilation
    cache), CTranslate2 float32 and Transformers; the median of args.processes runs."""
    if args.processes < 1:
        return []
    import json
    import subprocess
    import tempfile

    from tx_jax.data import datasets
    from tx_jax.interop import huggingface

    split = datasets.load_split(loaded.config.data, "test")
    pairs = [split[i] for i in range(n)]
    work = tempfile.mkdtemp(prefix="decode_export_")
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    pin = ["taskset", "-c", cpus]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    results = []

    def timed(name: str, search: str, command: list[str], extra_env=None, fresh=None) -> None:
        times, outputs = [], []
        for _ in range(args.processes):
            if fresh:
                fresh()
            start = time.perf_counter()
            proc = subprocess.run(
                pin + command, env=dict(env, **(extra_env or {})), capture_output=True, text=True
            )
            times.append(time.perf_counter() - start)
            if proc.returncode:
                raise RuntimeError(f"{name}: {proc.stderr[-2000:]}")
            outputs.append(proc.stdout.strip().splitlines()[0])
        record = dict(
            system=name,
            search=search,
            seconds=_common.median(times),
            runs=times,
            output=outputs[-1],
        )
        results.append(record)
        print(f"process: {name} {search}: {record['seconds']:.2f} s (runs {times})", flush=True)

    exports = {
        f"ctranslate2 float32 ({backend})": (_CT2_PROCESS, os.path.join(out_dir, "ct2_float32"))
        for backend in CT2_BACKENDS
    }
    exports["transformers generate"] = (_HF_PROCESS, os.path.join(out_dir, "hf"))
    for search in args.searches.split(","):
        beam = 1 if search == "greedy" else int(search.removeprefix("beam"))
        evaluate = [
            sys.executable,
            "-m",
            "tx_jax",
            "evaluate",
            f"--workdir={args.workdir}",
            "--split=test",
            f"--beam_size={beam}",
        ]
        if n < len(split):
            evaluate.append(f"--limit={n}")
        cold_dir = os.path.join(work, f"jax_cache_cold_{beam}")

        def empty(path=cold_dir):
            subprocess.run(["rm", "-rf", path], check=True)

        cache = {"JAX_COMPILATION_CACHE_DIR": cold_dir, "JAX_PLATFORMS": "cpu"}
        timed("tx_jax evaluate, cold compilation cache", search, evaluate, cache, fresh=empty)
        timed("tx_jax evaluate, warm compilation cache", search, evaluate, cache)
        for name, (code, model) in exports.items():
            spec = os.path.join(work, f"{beam}.json")
            with open(spec, "w") as f:
                json.dump(
                    dict(
                        sources=[s for s, _ in pairs],
                        refs=[r for _, r in pairs],
                        tokenizer=str(loaded.workdir / "tokenizer.model"),
                        model=model,
                        beam=beam,
                        threads=threads,
                        max_len=huggingface.max_decode_len(loaded),
                    ),
                    f,
                )
            timed(name, search, [sys.executable, "-c", code, spec], _ct2_env(name))
    print(
        _common.table(
            ["whole process", "search", "seconds (median)", "first line of output"],
            [[r["system"], r["search"], r["seconds"], r["output"][:60]] for r in results],
        )
    )
    return results


if __name__ == "__main__":
    main()
