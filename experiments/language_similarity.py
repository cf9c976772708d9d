"""Language similarity and multilingual transfer on Multi30k.

    python experiments/language_similarity.py [--root=runs/language_similarity] [--debug]
        [--manual_dir=../shared/data/multi30k] [--data_dir=TFDS_DIR]

Multi30k has the same 31k image captions in English, German, French and Czech, so how much
one language helps another can be measured with everything else held fixed. The hypothesis
is that transfer follows similarity (English and German: both Germanic); here German is
the high-resource language, French (Romance, many English loanwords) and Czech (Slavic) are
the low-resource ones, and the question is which of them gains more from German.

Runs (every one through tx_jax.runner.loop.train_and_evaluate, configs/multilingual.py, the same
model size and one shared SentencePiece vocabulary with the tags <2cs> <2de> <2en> <2fr>):

    multi     one model for en<->de (all 29k pairs) and en<->fr, en<->cs (LOW_PAIRS pairs
              each), temperature sampling over the six directions; trains the vocabulary
    pre_de    en->de alone (all pairs), on multi's vocabulary
    scratch_X en->X (X = fr, cs) from scratch on its LOW_PAIRS pairs, low_steps steps
    matched_X the same for pre_steps + low_steps steps: as many updates as the transfer arm
    from_de_X en->X for low_steps steps, starting from pre_de's parameters (train.init_from),
              so pre_steps + low_steps updates in all

Then, on test_2016_flickr:
  1. transfer: BLEU of en->fr and en->cs for scratch / from en->de / multilingual;
  2. zero-shot: multi (trained on en<->X only) on de->fr and fr->de, directly (the <2fr> tag
     on a German source) and through English (de->en->fr with the same model);
  3. representations: the parallel test sentences of all four languages through multi's
     encoder (tag <2en>, mean-pooled over each sentence's own pieces): linear CKA and cosine
     between languages at every layer (heatmaps), against a surface similarity (chrF between
     the languages' sentences), with Pearson/Spearman over the 6 language pairs.
REPORT.md, results.json and the PNGs go to ROOT. Finished runs are reused on a rerun (their
checkpoints are complete), so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python experiments/language_similarity.py` from anywhere
    sys.path.insert(0, str(REPO))

from tx_jax.analysis import similarity, visualize  # noqa: E402
from tx_jax.config import apply_overrides, sibling_config  # noqa: E402
from tx_jax.data import tasks  # noqa: E402
from tx_jax.inference import multilingual, restore  # noqa: E402
from tx_jax.runner.loop import train_and_evaluate  # noqa: E402

LANGS = ("en", "de", "fr", "cs")
HIGH = "de"  # the high-resource language
LOW = ("fr", "cs")  # the low-resource languages
CONFIG = str(REPO / "configs" / "multilingual.py")


@dataclasses.dataclass(frozen=True)
class Size:
    """How big every run of the study is."""

    name: str
    model: dict  # model.* overrides (every run the same)
    low_pairs: int  # train pairs of each low-resource direction
    vocab_size: int
    tokens_per_batch: int
    multi_steps: int
    pre_steps: int
    low_steps: int
    eval_limit: int  # test sentences decoded per direction (and encoded for similarity)
    beam_size: int  # test decoding
    peak_lr: float = 2e-3  # the schedule's peak (after warmup)
    debug_variant: bool = False  # build on configs/multilingual.py:debug


SIZES = {
    # sized for a 2-core CPU (wall times: docs/experiments.md "Language similarity" and the report)
    "default": Size(
        "default",
        dict(
            d_model=128,
            num_heads=4,
            d_ff=512,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dropout_rate=0.2,
            attention_dropout_rate=0.1,
        ),
        low_pairs=3000,
        vocab_size=6000,
        tokens_per_batch=2048,
        multi_steps=1000,
        pre_steps=700,
        low_steps=250,
        eval_limit=500,
        beam_size=1,
    ),
    # seconds: the CI test (tests/test_language_similarity.py)
    "debug": Size(
        "debug",
        {},
        low_pairs=40,
        vocab_size=200,
        tokens_per_batch=512,
        multi_steps=6,
        pre_steps=4,
        low_steps=4,
        eval_limit=12,
        beam_size=1,
        debug_variant=True,
    ),
}


def _pairs_spec(size: Size) -> str:
    low = [f"{a}-{b}" for x in LOW for a, b in (("en", x), (x, "en"))]
    return ",".join(f"{d}={size.low_pairs}" for d in low)


def run_configs(size: Size, root: pathlib.Path, data_overrides: dict) -> dict[str, Any]:
    """name -> ConfigDict of every training run, in the order they must run."""
    variant = ",variant=debug" if size.debug_variant else ""
    six = "+".join(f"{a}-{b}" for x in (HIGH, *LOW) for a, b in (("en", x), (x, "en")))

    def make(directions: str, steps: int, **overrides):
        c = sibling_config(CONFIG, "multilingual", f"directions={directions}{variant}")
        c.model.update(size.model)
        c.data.update(data_overrides)
        c.data.vocab_size = size.vocab_size
        c.data.tokens_per_batch = size.tokens_per_batch
        c.train.num_steps = steps
        # the paper's rsqrt schedule with its peak held at size.peak_lr whatever the warmup
        # (unscaled, d_model 128 with 200 warmup steps would peak at 6.2e-3)
        c.train.warmup_steps = max(1, min(200, steps // 4))
        c.train.lr_scale = size.peak_lr * (c.model.d_model * c.train.warmup_steps) ** 0.5
        c.eval.every = steps  # validation once, at the end (the study reads test scores)
        c.eval.score_test = False  # the study decodes the test split itself
        c.checkpoint.every = steps
        apply_overrides(c, overrides)
        return c

    multi_dir = root / "multi"
    tokenizer = str(multi_dir / "tokenizer.model")
    configs = {
        "multi": make(
            six,
            size.multi_steps,
            **{
                "data.mixture": "temperature",
                "data.temperature": 5.0,
                "data.max_train_pairs": _pairs_spec(size),
            },
        ),
        "pre_de": make(f"en-{HIGH}", size.pre_steps, **{"data.tokenizer_path": tokenizer}),
    }
    for x in LOW:
        low = {"data.max_train_pairs": size.low_pairs, "data.tokenizer_path": tokenizer}
        configs[f"scratch_{x}"] = make(f"en-{x}", size.low_steps, **low)
        configs[f"matched_{x}"] = make(f"en-{x}", size.pre_steps + size.low_steps, **low)
        configs[f"from_{HIGH}_{x}"] = make(
            f"en-{x}", size.low_steps, **low, **{"train.init_from": str(root / "pre_de")}
        )
    return configs


def train_all(configs: dict, root: pathlib.Path, log=print) -> dict[str, float]:
    """Train (or resume/skip) every run; name -> wall seconds of this call."""
    walls = {}
    for name, config in configs.items():
        start = time.time()
        log(f"[{name}] training in {root / name}")
        final = train_and_evaluate(config, str(root / name))
        walls[name] = round(time.time() - start, 1)
        if "stopped_at" in final:  # SIGTERM/SIGINT: checkpoint saved; rerun to resume
            raise SystemExit(
                f"[{name}] stopped at step {int(final['stopped_at'])}: rerun "
                "the same command to resume the study"
            )
    return walls


def _score(loaded, direction: str, size: Size, pivot: str | None = None) -> dict:
    s = multilingual.measure_direction(
        loaded,
        direction,
        split="test_2016_flickr",
        pivot=pivot,
        limit=size.eval_limit,
        beam_size=size.beam_size,
    )
    return {"bleu": round(s.bleu, 2), "chrf": round(s.chrf, 2), "signature": s.signature}


def transfer_and_zero_shot(root: pathlib.Path, size: Size) -> dict:
    multi = restore.load(root / "multi")
    out: dict[str, Any] = {"transfer": {}, "zero_shot": {}, "multi": {}}
    for d in ("en-de", "de-en", *[f"en-{x}" for x in LOW], *[f"{x}-en" for x in LOW]):
        out["multi"][d] = _score(multi, d, size)
    for x in LOW:
        row = {"multilingual": out["multi"][f"en-{x}"]}
        for kind in ("scratch", "matched", f"from_{HIGH}"):
            row[kind] = _score(restore.load(root / f"{kind}_{x}"), f"en-{x}", size)
        out["transfer"][f"en-{x}"] = row
    for d in ("de-fr", "fr-de"):
        out["zero_shot"][d] = {
            "direct": _score(multi, d, size),
            "pivot_en": _score(multi, d, size, pivot="en"),
        }
    return out


def representation_similarity(root: pathlib.Path, size: Size) -> dict:
    """Per-layer CKA/cosine between the four languages in multi's encoder, and chrF."""
    loaded = restore.load(root / "multi")
    # the same test captions in every language: the en-X test splits share their English side
    texts = {"en": None}
    for x in (HIGH, *LOW):
        task = tasks.direction_task(
            loaded.config.data, loaded.tokenizer, loaded.config.seed, ("en", x)
        )
        pairs = task.pairs("test_2016_flickr", size.eval_limit)
        english, other = zip(*(pairs[i] for i in range(len(pairs))))
        if texts["en"] is not None and list(english) != texts["en"]:
            raise ValueError(f"the en-{x} test split is not aligned with the others' English")
        texts["en"], texts[x] = list(english), list(other)
    model = restore.make_model(loaded.model_config, "translation")
    reps = {
        lang: similarity.encoder_layer_representations(
            model, loaded.params, loaded.tokenizer, texts[lang], tag="<2en>"
        )
        for lang in LANGS
    }
    mats = similarity.similarity_matrices(reps)
    surface = similarity.surface_similarity_matrix({k: texts[k] for k in LANGS}, metric="chrf")
    surface_off = similarity.off_diagonal(surface)
    corr = {
        kind: [similarity.correlation(similarity.off_diagonal(m), surface_off) for m in mats[kind]]
        for kind in ("cka", "cosine")
    }
    visualize.plot_similarity_heatmaps(
        mats["cka"], LANGS, root / "cka_heatmaps.png", metric="linear CKA"
    )
    visualize.plot_similarity_heatmaps(
        mats["cosine"], LANGS, root / "cosine_heatmaps.png", metric="mean-pooled cosine"
    )
    visualize.plot_similarity_vs_surface(mats["cka"], surface, LANGS, root / "cka_vs_chrf.png")
    return {
        "languages": list(LANGS),
        "pairs": similarity.pair_labels(LANGS),
        "cka": mats["cka"].round(4).tolist(),
        "cosine": mats["cosine"].round(4).tolist(),
        "chrf": surface.round(2).tolist(),
        "correlation": corr,
        "sentences": len(texts["en"]),
    }


def _f(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"  # NaN -> n/a


def write_report(root: pathlib.Path, size: Size, results: dict) -> pathlib.Path:
    t, z, s = results["scores"]["transfer"], results["scores"]["zero_shot"], results["similarity"]
    lines = [
        "# Language similarity and multilingual transfer (Multi30k)",
        "",
        f"Size `{size.name}`: model {json.dumps(size.model)}, {size.low_pairs} train pairs per "
        f"low-resource direction, vocabulary {size.vocab_size}, steps multi/pre/low = "
        f"{size.multi_steps}/{size.pre_steps}/{size.low_steps}, test_2016_flickr "
        f"(first {size.eval_limit} sentences), beam {size.beam_size}. Produced by "
        "`python experiments/language_similarity.py`; wall times of this invocation: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in results["wall_s"].items())
        + ".",
        "",
        "## Transfer to a low-resource direction (test BLEU / chrF)",
        "",
        f"Updates: from scratch {size.low_steps}; compute-matched scratch and from en->de "
        f"{size.pre_steps + size.low_steps} each (en->de pre-training {size.pre_steps}, then "
        f"{size.low_steps} on the direction); multilingual {size.multi_steps} over six "
        "directions. The gain is counted against the compute-matched arm.",
        "",
        "| direction | from scratch | scratch, compute-matched | from en->de | multilingual "
        "| gain from en->de |",
        "|---|---|---|---|---|---|",
    ]
    for d, row in t.items():
        gain = row[f"from_{HIGH}"]["bleu"] - row["matched"]["bleu"]
        cells = [
            f"{row[k]['bleu']:.2f} / {row[k]['chrf']:.1f}"
            for k in ("scratch", "matched", f"from_{HIGH}", "multilingual")
        ]
        lines.append(f"| {d} | " + " | ".join(cells) + f" | {gain:+.2f} |")
    lines += [
        "",
        "Multilingual model on its trained directions (BLEU): "
        + ", ".join(f"{d} {v['bleu']:.2f}" for d, v in results["scores"]["multi"].items()),
        "",
        "## Zero-shot (trained on en<->X only)",
        "",
        "| direction | direct (tag only) | through English |",
        "|---|---|---|",
    ]
    for d, row in z.items():
        lines.append(f"| {d} | {row['direct']['bleu']:.2f} | {row['pivot_en']['bleu']:.2f} |")
    lines += [
        "",
        "## Encoder representations vs surface similarity",
        "",
        f"{s['sentences']} parallel test sentences per language through the multilingual "
        "encoder (tag <2en>, mean-pooled over each sentence's own pieces). Layer 0 is the "
        "embeddings plus positions; layer i the output of encoder layer i.",
        "",
        "![CKA](cka_heatmaps.png)",
        "",
        "![cosine](cosine_heatmaps.png)",
        "",
        "![CKA vs chrF](cka_vs_chrf.png)",
        "",
        "| pair | chrF | " + " | ".join(f"CKA L{g}" for g in range(len(s["cka"]))) + " |",
        "|---|---|" + "---|" * len(s["cka"]),
    ]
    k = len(LANGS)
    idx = [(i, j) for i in range(k) for j in range(i + 1, k)]
    for p, (i, j) in zip(s["pairs"], idx):
        cka = " | ".join(f"{layer[i][j]:.3f}" for layer in s["cka"])
        lines.append(f"| {p} | {s['chrf'][i][j]:.1f} | {cka} |")
    lines += [
        "",
        "| layer | Pearson(CKA, chrF) | Spearman(CKA, chrF) | Pearson(cos, chrF) |",
        "|---|---|---|---|",
    ]
    for g, (a, b) in enumerate(zip(s["correlation"]["cka"], s["correlation"]["cosine"])):
        lines.append(f"| {g} | {_f(a['pearson'])} | {_f(a['spearman'])} | {_f(b['pearson'])} |")
    lines += ["", "Signature: " + next(iter(t.values()))["scratch"]["signature"], ""]
    path = root / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=str(REPO / "runs" / "language_similarity"))
    parser.add_argument("--debug", action="store_true", help="the seconds-sized study (CI)")
    parser.add_argument("--manual_dir", default=None, help="raw Multi30k files")
    parser.add_argument("--data_dir", default=None, help="TFDS data dir")
    args = parser.parse_args(argv)
    size = SIZES["debug" if args.debug else "default"]
    root = pathlib.Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    data = {k: v for k, v in (("manual_dir", args.manual_dir), ("data_dir", args.data_dir)) if v}
    configs = run_configs(size, root, data)
    start = time.time()
    walls = train_all(configs, root)
    scores = transfer_and_zero_shot(root, size)
    sims = representation_similarity(root, size)
    walls["evaluation"] = round(time.time() - start - sum(walls.values()), 1)
    results = {
        "size": dataclasses.asdict(size),
        "wall_s": walls,
        "scores": scores,
        "similarity": sims,
    }
    (root / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    report = write_report(root, size, results)
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
