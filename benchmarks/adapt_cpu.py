"""LoRA against full fine-tuning on this CPU: a Multi30k en-de model trained without the
animal sentences, adapted to them (BENCHMARKS.md "Adapting a trained translator").

    python benchmarks/adapt_cpu.py --out=runs/adapt_cpu [--multi30k=../shared/data/multi30k]
        [--base_minutes=12] [--steps=300]

1. The corpus: Multi30k's train, val and test_2016_flickr split by a pattern over the English
   side (dogs, cats, horses, birds, ... : 'animals') into a general part and a domain part.
2. The base: configs/text.py on the general train split (sizes from the data) under a time
   budget of --base_minutes.
3. Two adaptations of the base on the domain train split, --steps updates each, the same
   schedule (configs/finetune.py:data=text): full fine-tuning, and LoRA (rank 16, alpha 32,
   every attention and FFN projection); each under /usr/bin/time -v.
4. Each of the three translates both test parts (beam 4, tx_jax translate); sacreBLEU scores
   them. Printed and written to OUT/results.json: BLEU on the domain and the general test
   sets, trainable parameters, checkpoint bytes, seconds per update, peak resident memory.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOMAIN = re.compile(
    r"\b(dogs?|puppy|puppies|cats?|horses?|cows?|sheep|birds?|animals?|bulls?|camels?|goats?"
    r"|ducks?|elephants?)\b",
    re.IGNORECASE,
)
SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
ADAPTATIONS = {
    "full": ["--config.train.peak_lr=1e-4"],
    "lora": [
        "--config.train.peak_lr=1e-3",
        "--config.train.lora.rank=16",
        "--config.train.lora.alpha=32",
    ],
}


def _lines(path: pathlib.Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def split_corpus(multi30k: pathlib.Path, out: pathlib.Path) -> dict[str, int]:
    """OUT/corpus/{general,domain}_{train,val,test}.{en,de}; returns the line counts."""
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, stem in SPLITS.items():
        en, de = (_lines(multi30k / f"{stem}.{lang}.gz") for lang in ("en", "de"))
        parts = {"general": [], "domain": []}
        for a, b in zip(en, de, strict=True):
            parts["domain" if DOMAIN.search(a) else "general"].append((a, b))
        for part, pairs in parts.items():
            for i, lang in enumerate(("en", "de")):
                text = "".join(p[i] + "\n" for p in pairs)
                (out / f"{part}_{name}.{lang}").write_text(text)
            counts[f"{part}_{name}"] = len(pairs)
    return counts


def run(argv: list[str], log: pathlib.Path) -> None:
    with open(log, "w") as f:
        done = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{' '.join(argv[:6])} ... failed ({done.returncode}): see {log}")


def python(*args: str) -> list[str]:
    return ["/usr/bin/time", "-v", sys.executable, *args]


def translate(workdir: pathlib.Path, source: pathlib.Path, out: pathlib.Path) -> list[str]:
    with open(source) as src, open(out, "w") as hyp:
        subprocess.run(
            [sys.executable, "-m", "tx_jax", "translate", f"--workdir={workdir}", "--beam_size=4"],
            cwd=ROOT,
            stdin=src,
            stdout=hyp,
            stderr=subprocess.DEVNULL,
            check=True,
        )
    return out.read_text().splitlines()


def measured(workdir: pathlib.Path, log: pathlib.Path) -> dict:
    """Seconds per update, checkpoint bytes, peak RSS and trainable parameters of a run."""
    text = log.read_text()
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    first, last = train[0], train[-1]
    step_s = (last["train_seconds"] - first["train_seconds"]) / (last["step"] - first["step"])
    ckpts = sorted((workdir / "checkpoints").iterdir(), key=lambda p: p.name)
    step_dir = [p for p in ckpts if p.name.isdigit()][-1]
    nbytes = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    from tx_jax.inference import restore
    from tx_jax.training.freezing import Trainable

    loaded = restore.load(workdir)
    trainable, parameters = Trainable.of(loaded.config.train).count(loaded.params)
    return {
        "s_per_update": round(step_s, 4),
        "checkpoint_bytes": nbytes,
        "peak_rss_mib": round(rss / 1024),
        "trainable": trainable,
        "parameters": parameters,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/adapt_cpu")
    ap.add_argument("--multi30k", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    ap.add_argument("--base_minutes", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    out = (ROOT / args.out).resolve()
    corpus = out / "corpus"
    counts = split_corpus(pathlib.Path(args.multi30k), corpus)
    print("corpus:", counts, flush=True)
    tfds = f"--config.data.data_dir={out / 'tfds'}"
    if not (out / "base" / "checkpoints").exists():
        run(
            python(
                "-m", "tx_jax.main", "--config=configs/text.py", f"--workdir={out / 'base'}",
                f"--config.data.train={corpus / 'general_train'}",
                f"--config.data.validation={corpus / 'general_val'}",
                f"--config.data.test={corpus / 'general_test'}",
                f"--config.train.time_budget_minutes={args.base_minutes}", tfds,
            ),
            out / "base.log",
        )  # fmt: skip
    for kind, flags in ADAPTATIONS.items():
        if (out / kind / "checkpoints").exists():
            continue
        run(
            python(
                "-m", "tx_jax.main", f"--workdir={out / kind}",
                f"--config=configs/finetune.py:init_from={out / 'base'},data=text",
                f"--config.data.train={corpus / 'domain_train'}",
                f"--config.data.validation={corpus / 'domain_val'}",
                f"--config.data.test={corpus / 'domain_test'}",
                f"--config.train.num_steps={args.steps}",
                f"--config.train.warmup_steps={args.steps // 10}",
                f"--config.eval.every={args.steps}", f"--config.checkpoint.every={args.steps}",
                f"--config.train.log_every={max(args.steps // 10, 1)}", tfds, *flags,
            ),
            out / f"{kind}.log",
        )  # fmt: skip
    import sacrebleu

    results = {"corpus": counts, "steps": args.steps, "runs": {}}
    for name in ("base", *ADAPTATIONS):
        row = measured(out / name, out / f"{name}.log") if name != "base" else {}
        for part in ("domain", "general"):
            hyps = translate(out / name, corpus / f"{part}_test.en", out / f"{name}.{part}.hyp")
            refs = (corpus / f"{part}_test.de").read_text().splitlines()
            row[f"bleu_{part}"] = round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)
        results["runs"][name] = row
        print(name, row, flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
