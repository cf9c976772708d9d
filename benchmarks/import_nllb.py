"""Import an NLLB-200-1.3B-shaped checkpoint (random weights at full size) in bfloat16, and
plan its fine-tuning for TPU and GPU targets.

    python benchmarks/import_nllb.py --root=/tmp/nllb13 [--targets=tpu:v5e-8,gpu:h100-1]

Builds ROOT/hf once with transformers' M2M100ForConditionalGeneration in NLLB-200-1.3B's
shape (d_model 1024, 24 + 24 layers, 16 heads, d_ff 8192, vocabulary 256,206; stored in
bfloat16 to halve the disk and memory it needs here) and NLLB tokenizer files (a small
SentencePiece model: the ids past it are unused names; only the tensors' sizes matter), then
times `tx_jax import --dtype=bfloat16` into ROOT/workdir and runs `tx_jax plan` on
configs/finetune.py:init_from=ROOT/workdir for each target. Prints one JSON line per step.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

NLLB_13B = dict(
    d_model=1024,
    encoder_layers=24,
    decoder_layers=24,
    encoder_attention_heads=16,
    decoder_attention_heads=16,
    encoder_ffn_dim=8192,
    decoder_ffn_dim=8192,
    vocab_size=256_206,
    max_position_embeddings=1024,
    scale_embedding=True,
    activation_function="relu",
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
)


def build(hf: pathlib.Path) -> dict:
    import pretrained_fixtures as pf
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    start = time.time()
    _, tok = pf.nllb_tokenizer_files(hf)
    del tok
    torch.manual_seed(0)
    config = M2M100Config(**NLLB_13B, dtype="bfloat16")
    with torch.device("cpu"):
        model = M2M100ForConditionalGeneration(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(hf))
    return {"step": "build", "params": params, "seconds": round(time.time() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", default="/tmp/tx_jax_nllb13")
    parser.add_argument("--targets", default="tpu:v5e-8,gpu:h100-1")
    parser.add_argument(
        "--override", action="append", default=[], help="key=value for the plan's config"
    )
    parser.add_argument("--name", default="", help="suffix of the plan's JSON file")
    args = parser.parse_args()
    root = pathlib.Path(args.root)
    hf, workdir = root / "hf", root / "workdir"
    if not (hf / "config.json").exists():
        print(json.dumps(build(hf)), flush=True)
    if not (workdir / "checkpoints").exists():
        start = time.time()
        cmd = [sys.executable, "-m", "tx_jax", "import", f"--source={hf}"]
        subprocess.run([*cmd, f"--workdir={workdir}", "--dtype=bfloat16"], check=True, cwd=REPO)
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        size = sum(p.stat().st_size for p in (workdir / "checkpoints").rglob("*") if p.is_file())
        print(
            json.dumps(
                {
                    "step": "import",
                    "seconds": round(time.time() - start, 1),
                    "peak_rss_gib": round(children, 2),
                    "checkpoint_gib": round(size / 2**30, 2),
                }
            ),
            flush=True,
        )
    for target in filter(None, args.targets.split(",")):
        out = root / f"plan_{target.replace(':', '_')}{args.name}.json"
        start = time.time()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tx_jax",
                "plan",
                f"--config=configs/finetune.py:init_from={workdir}",
                f"--target={target}",
                "--programs=train",
                f"--json={out}",
                *(f"--config.{o}" for o in args.override),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        print(proc.stdout[-3000:], proc.stderr[-2000:] if proc.returncode > 2 else "", flush=True)
        print(
            json.dumps(
                {
                    "step": f"plan {target}",
                    "exit": proc.returncode,
                    "seconds": round(time.time() - start, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
