"""Corpus translation throughput: `tx_jax translate --input --output_dir` in 1 and
2 processes against CTranslate2's translate_file on the exported model, whole processes
timed from outside (start-up, compilation and file I/O included, as a user sees them).

    python benchmarks/corpus_speed.py --workdir=runs/default [--lines 4000] [--beam 4]

The corpus: the run's test-split sources repeated to --lines lines, in two files. tx_jax:
one process on every core of this host; two processes (jax.distributed on 127.0.0.1), each
pinned to half the cores, sharing the shards; each with a fresh output directory and a cold
JAX compilation cache. CTranslate2: the checkpoint exported (float32) and
`Translator.translate_file` on SentencePiece pieces with the same beam, length penalty 0.6
(GNMT alpha, as tx_jax's) and max batch 64, intra_threads = the cores. Reported: lines/s of
each, and the share of lines on which CTranslate2's detokenized output equals tx_jax's.
Writes benchmarks/results/corpus_speed.json.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

_CT2 = """
import sys, ctranslate2, sentencepiece as spm
model, spm_file, src, out, threads, beam, max_len = sys.argv[1:]
tok = spm.SentencePieceProcessor(model_file=spm_file)
pieces = out + ".src.pieces"
with open(src) as f, open(pieces, "w") as g:
    for line in f:
        g.write(" ".join(tok.encode(line.rstrip("\\n"), out_type=str)) + "\\n")
tr = ctranslate2.Translator(model, device="cpu", inter_threads=1, intra_threads=int(threads))
tr.translate_file(pieces, out + ".pieces", max_batch_size=64, beam_size=int(beam),
                  length_penalty=0.6, max_decoding_length=int(max_len))
with open(out + ".pieces") as f, open(out, "w") as g:
    for line in f:
        g.write(tok.decode(line.split()) + "\\n")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(commands: list[tuple[list[str], dict]]) -> float:
    """Start every command at once, wait for all: seconds from the first start to the last end."""
    start = time.perf_counter()
    procs = [subprocess.Popen(c, env=e) for c, e in commands]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a process failed: exit codes {codes}")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default=os.path.join(_common.ROOT, "runs", "default"))
    p.add_argument("--lines", type=int, default=4000)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--out", default="")
    args = p.parse_args()

    from tx_jax.data import datasets
    from tx_jax.inference import restore
    from tx_jax.interop import ctranslate2 as ct2_export
    from tx_jax.interop import huggingface

    loaded = restore.load(args.workdir)
    split = datasets.load_split(loaded.config.data, "test")
    sources = [split[i][0] for i in range(len(split))]
    lines = [sources[i % len(sources)] for i in range(args.lines)]
    work = tempfile.mkdtemp(prefix="corpus_speed_")
    half = len(lines) // 2
    inputs = []
    for i, part in enumerate((lines[:half], lines[half:])):
        inputs.append(os.path.join(work, f"part{i}.txt"))
        with open(inputs[-1], "w") as f:
            f.write("\n".join(part) + "\n")
    cpus = sorted(os.sched_getaffinity(0))
    threads = len(cpus)
    base = [
        sys.executable,
        "-m",
        "tx_jax",
        "translate",
        f"--workdir={args.workdir}",
        f"--input={','.join(inputs)}",
        f"--beam_size={args.beam}",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    rows = {}

    out1 = os.path.join(work, "one")
    env1 = dict(env, JAX_COMPILATION_CACHE_DIR=os.path.join(work, "cache1"))
    rows["tx_jax, 1 process"] = _run([(base + [f"--output_dir={out1}"], env1)])

    out2 = os.path.join(work, "two")
    port = _free_port()
    commands = []
    for pid, cpu_set in enumerate((cpus[: threads // 2], cpus[threads // 2 :])):
        e = dict(
            env,
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(pid),
            JAX_COMPILATION_CACHE_DIR=os.path.join(work, f"cache2_{pid}"),
        )
        pin = ["taskset", "-c", ",".join(map(str, cpu_set or cpus))]
        commands.append((pin + base + [f"--output_dir={out2}"], e))
    rows["tx_jax, 2 processes"] = _run(commands)

    ct2_dir = os.path.join(work, "ct2_float32")
    ct2_export.export(loaded, ct2_dir, quantization="float32")
    spm_file = str(loaded.workdir / "tokenizer.model")
    max_len = huggingface.max_decode_len(loaded)
    ct2_out = os.path.join(work, "ct2")
    os.makedirs(ct2_out)
    commands = []
    for path in inputs:
        out = os.path.join(ct2_out, os.path.basename(path))
        script = [
            sys.executable,
            "-c",
            _CT2,
            ct2_dir,
            spm_file,
            path,
            out,
            str(threads),
            str(args.beam),
            str(max_len),
        ]
        commands.append((script, env))
    start = time.perf_counter()
    for c in commands:  # one file after another: CTranslate2 uses every core on each
        _run([c])
    rows["CTranslate2 translate_file (float32)"] = time.perf_counter() - start

    def read(folder: str) -> list[str]:
        out = []
        for path in inputs:
            with open(os.path.join(folder, os.path.basename(path))) as f:
                out += f.read().splitlines()
        return out

    one, two, ct2 = read(out1), read(out2), read(ct2_out)
    result = {
        "workdir": _common.portable_path(args.workdir),
        "lines": len(lines),
        "beam": args.beam,
        "cores": threads,
        "seconds": rows,
        "lines_per_second": {k: len(lines) / v for k, v in rows.items()},
        "two_processes_equal_one": one == two,
        "ctranslate2_same_as_tx_jax": sum(a == b for a, b in zip(one, ct2)) / len(one),
        "machine": _common.machine(),
    }
    for name, seconds in rows.items():
        print(f"{name}: {seconds:.1f} s, {len(lines) / seconds:.1f} lines/s")
    same = 100 * result["ctranslate2_same_as_tx_jax"]
    print(
        f"2 processes == 1 process: {result['two_processes_equal_one']}; "
        f"CTranslate2 same as tx_jax on {same:.1f}% of lines"
    )
    path = _common.write_json("corpus_speed", result, args.out or None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
