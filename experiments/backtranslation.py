"""Back-translation on Multi30k en->de: beam, sampling, tagged, against the real pairs.

    python experiments/backtranslation.py [--root=runs/backtranslation]
        [--size=default|long|debug] [--debug] [--record=DIR]
        [--manual_dir=../shared/data/multi30k] [--second_seed=close|all|none]
        [--override KEY=VALUE ...]

Multi30k's 29,000 train pairs are split in two halves with a seeded permutation (SPLIT_SEED):
A (14,500 pairs, parallel) and B (14,500: its German side is the monolingual text; its English
side is used only by the ceiling). Every run reads A as its real dataset (a Multi30k manual
directory under ROOT/data/A holding A's train files and the real validation and test files,
prepared into its own TFDS directory ROOT/tfds), so validation, BLEU during training and the
test score are the real Multi30k splits in every run. One SentencePiece vocabulary
(ROOT/tokenizer.model, trained on both sides of A, with the tag <BT> as one piece) is shared by
all runs.

    de_en       de->en on A alone: the back-translation model
    BT          B's German translated into English with it, `tx_jax translate
                --input=data/B.de` (inference/corpus.py, resumable by shards): beam 4
                (bt/beam/B.de) and top-10 sampling with seed SAMPLE_SEED (bt/topk10/B.de);
                each output is named after its input but holds the English
    a_only      en->de on A alone
    bt_beam     A + BT(B) by beam:        data.backtranslation = [{source: bt/beam/B.de,
                                           target: data/B.de, ratio: 1.0, tag: False}]
    bt_sample   A + BT(B) by sampling:    the same with bt/topk10/B.de
    bt_tagged   A + BT(B) by beam, tagged (Caswell et al., 2019): tag True, <BT> before
                every synthetic source, never before a real one
    a_plus_b    A + B, the ceiling:        the same mixture with B's real English as source

The ceiling goes through the same synthetic-corpus path (not a run on all 29,000 pairs) so
that the five en->de settings differ only in the source side of B: the same mixture (ratio
1.0: half of each batch from B on average, the rest from A), the same steps, vocabulary,
model and schedule, the same real validation and test data. Each run's seed sets its
initialisation, dropout and batch order; the back-translations are made once, by the seed-0
de->en model.

Every en->de model is scored on test_2016_flickr (its last checkpoint, beam 4, length penalty 0.6:
sacreBLEU's BLEU and chrF, inference/evaluation.py). Seeds: every setting trains seed 0;
then, with --second_seed=close (default), seed 1 trains for every setting whose seed-0 BLEU
is within 1 BLEU of another setting's (`all`: every setting; `none`: seed 0 only), those
trained on a back-translation first.

ROOT/REPORT.md (table, curves, conclusion), ROOT/results.json and ROOT/curves.png are
written at the end. Everything is resumable: the split, tokenizer and back-translations are
reused when present; an interrupted run (SIGTERM/SIGINT, or a killed process) resumes from
its last checkpoint when the same command is rerun. A finished run's test score and
validation curve are kept twice: WORKDIR/study_result.json, and the record
(--record, default experiments/results/backtranslation/SIZE, committed to the repository),
so that the study outlives ROOT: a run found in either, trained with the same config (ROOT
written as $ROOT), is not trained again. The de->en model is trained again only where a
back-translation is missing and a run that needs it is not finished; each run records the
sha256 of the synthetic corpus it trained on, and the report names runs whose
back-translation differs from the recorded one (a de->en model retrained on another CPU).
RUN_ORDER puts the back-translated runs early, where they share one back-translation, and
the baseline before the last two, so a study stopped early compares first.

Sizes (--size): `default`, each run within the study's 45 minutes on the 2-core CPU:
configs/multi30k.py's `small` model (d_model 256, 3+3 layers) with dropout 0.1 (600
updates are ~11 epochs of A, where 0.3 mostly slows learning: docs/experiments.md,
"The paper's Table 3 at CPU scale"), float32 compute, batches of 4,096 tokens, 600 updates
(warmup 150, peak 2e-3, linear cooldown over the last 120), validation every 150 updates
(loss; greedy BLEU on the first 500 sentences). On the Zen 4 VM it trains at ~2,000 target
tokens/s in float32 (bfloat16: ~1,450), 1.8 s an update: ~18 min a run, ~25 with its
evaluations and test decode. `long`:
the same model with dropout 0.3 for 1,800 updates (warmup 600, cooldown 360), ~55 min of
training a run on free cores (its partial results: docs/experiments.md). `debug` (--debug): the same
pipeline with a 1-layer d_model-32 model, 40 updates and 400 train pairs: a few minutes
(tests/test_backtranslation_study.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python experiments/backtranslation.py` from anywhere
    sys.path.insert(0, str(REPO))

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from tx_jax.analysis import visualize  # noqa: E402
from tx_jax.config import (  # noqa: E402
    apply_overrides,
    parse_assignments,
    sibling_config,
    upgrade_stored,
    with_study_defaults,
)
from tx_jax.data.tokenizer import iter_pair_texts, train_tokenizer  # noqa: E402
from tx_jax.inference import evaluation, locate  # noqa: E402
from tx_jax.runner.loop import train_and_evaluate  # noqa: E402

CONFIG = str(REPO / "configs" / "multi30k.py")
DEFAULT_MANUAL_DIR = REPO.parent / "shared" / "data" / "multi30k"
TEST_SPLIT = "test_2016_flickr"
SPLIT_SEED = 1234  # the A/B permutation
SAMPLE_SEED = 1  # --seed of the sampled back-translation
TAG = "<BT>"
RESULT = "study_result.json"  # a finished run's test score, reused on a rerun
# setting -> (label, how B enters: None | (which English, tagged))
SETTINGS: dict[str, tuple[str, tuple[str, bool] | None]] = {
    "a_only": ("A alone", None),
    "bt_beam": ("A + BT(B), beam 4", ("beam", False)),
    "bt_sample": ("A + BT(B), top-10 sampling", ("topk10", False)),
    "bt_tagged": ("A + BT(B), beam 4, tagged", ("beam", True)),
    "a_plus_b": ("A + B (real pairs: the ceiling)", ("real", False)),
}
RUN_ORDER = ("bt_beam", "bt_sample", "a_only", "bt_tagged", "a_plus_b")
RECORDS = REPO / "experiments" / "results" / "backtranslation"  # finished runs, committed
BT_METHODS = {"beam": ["--beam_size=4"], "topk10": ["--sampling=topk:10", f"--seed={SAMPLE_SEED}"]}


@dataclasses.dataclass(frozen=True)
class Size:
    """How big every run of the study is (module docstring: why)."""

    name: str
    model: dict  # model.* overrides on the config's variant
    vocab_size: int
    tokens_per_batch: int
    steps: int
    warmup: int
    cooldown: int
    eval_every: int  # validation loss and greedy BLEU (the curves); a checkpoint each time
    bleu_examples: int  # validation sentences decoded for the curves' BLEU
    peak_lr: float
    data: dict = dataclasses.field(default_factory=dict)  # data.* overrides
    train_pairs: int | None = None  # Multi30k train pairs split into A and B (None: all)
    eval_lines: int | None = None  # validation/test lines copied into A's directory (None: all)
    debug_variant: bool = False  # configs/multi30k.py:variant=debug underneath


SIZES = {
    "default": Size(
        "default",
        # 600 updates are ~11 epochs of A: dropout 0.3 only slows learning; float32 is the
        # faster on CPUs without bfloat16 matmul units and the same on every VM kind
        {"dropout_rate": 0.1, "dtype": "float32"},
        vocab_size=8000,
        tokens_per_batch=4096,
        steps=600,
        warmup=150,
        cooldown=120,
        eval_every=150,
        bleu_examples=500,
        peak_lr=2e-3,
    ),
    "debug": Size(
        "debug",
        {},
        vocab_size=1000,
        tokens_per_batch=1024,
        steps=40,
        warmup=10,
        cooldown=0,
        eval_every=20,
        bleu_examples=16,
        peak_lr=1e-2,
        # real captions in a 1,000-piece vocabulary: ~30 pieces each (the variant's 32 would
        # drop most pairs)
        data=dict(max_train_len=64, max_eval_len=64, bucket_boundaries=[64]),
        train_pairs=400,
        eval_lines=40,
        debug_variant=True,
    ),
}


# ---------------------------------------------------------------------- data


SIZES["long"] = dataclasses.replace(  # the first size run (docs/experiments.md)
    SIZES["default"], name="long", model={}, steps=1800, warmup=600, cooldown=360, eval_every=300
)


def _read_gz(path: pathlib.Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n").removesuffix("\r") for line in f]


def _lines(path: pathlib.Path) -> list[str]:
    """A text file's lines, split on '\\n' only (as translate and the corpora split them)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def _write(path: pathlib.Path, lines: list[str]) -> None:
    """Lines to a text file (gzip when .gz, with no timestamp), written atomically."""
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def split_corpus(manual_dir: pathlib.Path, root: pathlib.Path, size: Size) -> dict[str, Any]:
    """A and B from Multi30k's train split (seeded), written under ROOT/data; reused when
    ROOT/data/split.json (written last) says the same split was made."""
    data = root / "data"
    spec = {"seed": SPLIT_SEED, "train_pairs": size.train_pairs, "eval_lines": size.eval_lines}
    marker = data / "split.json"
    if marker.exists():
        done = json.loads(marker.read_text())
        if {k: done.get(k) for k in spec} != spec:
            raise SystemExit(f"{marker} holds another split ({done}); use another --root")
        return done
    if not (manual_dir / "train.de.gz").exists():
        raise SystemExit(f"--manual_dir={manual_dir}: no train.de.gz (raw Multi30k files)")
    en, de = _read_gz(manual_dir / "train.en.gz"), _read_gz(manual_dir / "train.de.gz")
    if len(en) != len(de):
        raise SystemExit(f"{manual_dir}: train.en.gz has {len(en)} lines, train.de.gz {len(de)}")
    n = len(en) if size.train_pairs is None else min(size.train_pairs, len(en))
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    a, b = sorted(order[: n // 2].tolist()), sorted(order[n // 2 :].tolist())
    a_dir = data / "A"
    a_dir.mkdir(parents=True, exist_ok=True)
    for lang, lines in (("en", en), ("de", de)):
        _write(a_dir / f"train.{lang}.gz", [lines[i] for i in a])
        _write(data / f"B.{lang}", [lines[i] for i in b])
        for prefix in ("val", TEST_SPLIT):  # the real validation and test sets
            src = manual_dir / f"{prefix}.{lang}.gz"
            if size.eval_lines is None:
                shutil.copyfile(src, a_dir / src.name)
            else:
                _write(a_dir / src.name, _read_gz(src)[: size.eval_lines])
    done = {**spec, "manual_dir": str(manual_dir), "pairs": n, "a": len(a), "b": len(b)}
    marker.write_text(json.dumps(done, indent=1) + "\n")
    return done


def shared_tokenizer(root: pathlib.Path, size: Size) -> pathlib.Path:
    """ROOT/tokenizer.model: one joint vocabulary over both sides of A, <BT> one piece."""
    path = root / "tokenizer.model"
    if not path.exists():
        a = root / "data" / "A"
        pairs = zip(_read_gz(a / "train.en.gz"), _read_gz(a / "train.de.gz"))
        train_tokenizer(iter_pair_texts(pairs), size.vocab_size, path, user_defined_symbols=[TAG])
    return path


def back_translate(root: pathlib.Path, method: str, ensure_model, log=print) -> pathlib.Path:
    """ROOT/bt/<method>/B.de: B's German in English by the de_en model (tx_jax translate
    --input in a subprocess; a rerun reuses the file, or resumes the shards written).
    ensure_model() trains the de_en model first where its checkpoints are gone."""
    out_dir = root / "bt" / method
    out = out_dir / "B.de"  # named after its input; holds the English
    if not out.exists():
        ensure_model()
        cmd = [
            sys.executable,
            "-m",
            "tx_jax",
            "translate",
            f"--workdir={root / 'de_en'}",
            f"--input={root / 'data' / 'B.de'}",
            f"--output_dir={out_dir}",
            *BT_METHODS[method],
        ]
        log(f"[bt/{method}] " + " ".join(cmd[1:]))
        subprocess.run(cmd, check=True, cwd=REPO)
    source, lines = _lines(root / "data" / "B.de"), _lines(out)
    if len(lines) != len(source):
        raise SystemExit(f"{out}: not one line per line of {root / 'data' / 'B.de'}")
    if not any(x.strip() for x in lines):  # the pipeline skips empty sources: nothing to train
        raise SystemExit(f"{out}: the de->en model translated every line to nothing")
    return out


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bt_stats(path: pathlib.Path) -> dict[str, Any]:
    """Lines, empty lines and mean words per line of B's English (back-translated or real)."""
    lines = _lines(path)
    words = [len(x.split()) for x in lines]
    return {
        "lines": len(lines),
        "empty": sum(1 for x in lines if not x.strip()),
        "mean_words": round(statistics.fmean(words), 2) if words else 0.0,
        "sha256": _sha256(path),
    }


# ---------------------------------------------------------------------- runs


def synthetic_corpora(root: pathlib.Path, setting: str) -> list[dict[str, Any]]:
    """data.backtranslation of an en->de setting (module docstring)."""
    how = SETTINGS[setting][1]
    if how is None:
        return []
    english, tag = how
    source = root / "data" / "B.en" if english == "real" else root / "bt" / english / "B.de"
    return [
        {"source": str(source), "target": str(root / "data" / "B.de"), "ratio": 1.0, "tag": tag}
    ]


def make_config(size: Size, root: pathlib.Path, pair: str, seed: int, synthetic, overrides):
    variant = ",variant=debug" if size.debug_variant else ""
    c = sibling_config(CONFIG, "multi30k", f"pair={pair}{variant}")
    c.seed = seed
    c.model.update(size.model)
    c.data.update(size.data)
    c.data.manual_dir = str(root / "data" / "A")
    c.data.data_dir = str(root / "tfds")  # A's own prepared copy: never the full dataset's
    c.data.tokenizer_path = str(root / "tokenizer.model")
    c.data.vocab_size = size.vocab_size
    c.data.tokens_per_batch = size.tokens_per_batch
    # The study's keys (configs/default.py has none): the corpora mixed in, and their tag.
    c.data.backtranslation = ml_collections.FieldReference(synthetic, field_type=object)
    c.data.backtranslation_tag = TAG  # one piece of the shared tokenizer
    c.train.num_steps = size.steps
    c.train.warmup_steps = size.warmup
    c.train.cooldown_steps = size.cooldown
    # rsqrt peaks at lr_scale * (d_model * warmup)^-0.5: held at size.peak_lr
    c.train.lr_scale = size.peak_lr * (c.model.d_model * size.warmup) ** 0.5
    c.train.log_every = min(c.train.log_every, size.eval_every)
    c.eval.every = size.eval_every
    c.eval.bleu_examples = size.bleu_examples
    c.eval.score_test = False  # the study decodes the test split itself
    c.checkpoint.every = size.eval_every
    c.checkpoint.keep = 2
    apply_overrides(c, overrides, from_text=True)
    return c


def _fingerprint(config, root: pathlib.Path | None = None) -> str:
    """The config as JSON, with ROOT written as $ROOT: a record made under one --root is
    reused under another."""
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return text.replace(json.dumps(str(root))[1:-1], "$ROOT") if root is not None else text


def config_changes(stored: str, config, root: pathlib.Path | None = None) -> list[str]:
    """The dotted keys whose value differs between a stored fingerprint and `config`. Keys
    the stored run did not have are left out: options added to the code since, at defaults
    that keep the old behaviour, must not orphan a finished or half-trained run. Nor does
    parallel.strategy count: pmap and mesh train the same model, and either resumes the
    other's checkpoints."""
    now = with_study_defaults(json.loads(_fingerprint(config, root)))
    old = with_study_defaults(upgrade_stored(json.loads(stored)))  # under today's key names
    for c in (now, old):
        c.get("parallel", {}).pop("strategy", None)

    def walk(old, new, prefix):
        if isinstance(old, dict) and isinstance(new, dict):
            for k in old:
                if k not in new:
                    yield f"{prefix}{k}"
                else:
                    yield from walk(old[k], new[k], f"{prefix}{k}.")
        elif old != new:
            yield prefix.rstrip(".")

    return list(walk(old, now, ""))


def _last_step(workdir: pathlib.Path) -> int:
    if not (workdir / locate.CHECKPOINTS_DIR).exists():
        return 0
    try:
        ckpt = locate.open_checkpoints(workdir / locate.CHECKPOINTS_DIR)
    except locate.CheckpointError:
        return 0
    step = locate.latest_verified(ckpt) or 0
    ckpt.close()
    return step


def _check(result: dict, config, root, where) -> dict:
    changed = config_changes(result["fingerprint"], config, root)
    if changed:
        raise SystemExit(
            f"{where}: trained with another config ({', '.join(changed[:8])} differ); "
            "use another --root / --record"
        )
    return result


def train_model(config, workdir: pathlib.Path, label: str, log=print) -> None:
    """Train to the last step (resuming), or nothing when its last checkpoint is there."""
    if _last_step(workdir) < config.train.num_steps:
        log(f"[{label}] training {config.train.num_steps} steps in {workdir}")
        final = train_and_evaluate(config, str(workdir))
        if "stopped_at" in final:  # SIGTERM/SIGINT: checkpoint saved; rerun to resume
            raise SystemExit(
                f"{workdir}: stopped at step {int(final['stopped_at'])}: rerun the same "
                "command to resume the study"
            )


def train_and_score(
    config,
    workdir: pathlib.Path,
    label: str,
    log=print,
    *,
    root: pathlib.Path | None = None,
    record: pathlib.Path | None = None,
    extra: dict | None = None,
) -> dict[str, Any]:
    """Train (resume, or skip when its last checkpoint is the last step), then score the
    test split once. The result goes to WORKDIR/study_result.json and, with `record`, to
    RECORD.json with its validation records in RECORD.metrics.jsonl: a run found in either
    (trained with the same config) is not trained again, so a record kept in the repository
    outlives ROOT. `extra` (e.g. the hash of the corpus it trained on) joins the result."""
    path = workdir / RESULT
    for where in (path, record.with_suffix(".json") if record else None):
        if where is not None and where.exists():
            result = _check(json.loads(where.read_text()), config, root, where)
            if record is not None and not record.with_suffix(".json").exists():
                _write_record(record, result, workdir)
            log(f"[{label}] reused: {where}")
            return result
    train_model(config, workdir, label, log)
    start = time.time()
    test = evaluation.evaluate(workdir, split=TEST_SPLIT, beam_size=4, length_penalty=0.6)
    train_s, cpu = _training(workdir)
    result = {
        "seed": int(config.seed),
        "step": int(test["step"]),
        "bleu": round(test["bleu"], 2),
        "chrf": round(test["chrf"], 2),
        "signature": test["signature"],
        "chrf_signature": test["chrf_signature"],
        "examples": test["examples"],
        "train_s": round(train_s, 1),
        "test_s": round(time.time() - start, 1),
        "cpu": cpu,
        **(extra or {}),
        "fingerprint": _fingerprint(config, root),
    }
    path.write_text(json.dumps(result, indent=1) + "\n")
    if record is not None:
        _write_record(record, result, workdir)
    log(f"[{label}] {TEST_SPLIT}: BLEU {result['bleu']:.2f} chrF {result['chrf']:.2f}")
    return result


def _write_record(record: pathlib.Path, result: dict, workdir: pathlib.Path) -> None:
    """RECORD.json (the result) and RECORD.metrics.jsonl (its validation records: the
    curves), the metrics first so that a record's .json implies its curve."""
    record.parent.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    rows = [r for r in visualize.read_metrics(metrics) if r.get("split") == "validation"]
    _write(record.with_suffix(".metrics.jsonl"), [json.dumps(r, sort_keys=True) for r in rows])
    _write(record.with_suffix(".json"), [json.dumps(result, indent=1)])


def _training(workdir: pathlib.Path) -> tuple[float, str]:
    """(training seconds over all the run's segments, the CPUs that trained it) from
    WORKDIR/segments.jsonl: a run stopped and resumed counts every segment."""
    segments = [json.loads(x) for x in (workdir / "segments.jsonl").read_text().splitlines()]
    cpus = dict.fromkeys(r.get("cpu", "?") for r in segments)
    return float(segments[-1]["train_seconds"]), "; ".join(cpus)


def second_seed_settings(first: dict[str, float], policy: str) -> list[str]:
    """Settings to train again with seed 1, from their seed-0 BLEU: `close` those within
    1 BLEU of another setting, `all`, or `none`."""
    if policy == "all":
        return list(first)
    if policy == "none":
        return []
    return [s for s in first if any(abs(first[s] - first[t]) < 1.0 for t in first if t != s)]


def second_seed_order(settings: list[str]) -> list[str]:
    """The second seeds in RUN_ORDER, those trained on a back-translation first: while ROOT
    holds it (once ROOT is lost, the de->en model must train again for them)."""
    ordered = [s for s in RUN_ORDER if s in settings]
    uses_bt = [s for s in ordered if SETTINGS[s][1] and SETTINGS[s][1][0] in BT_METHODS]
    return uses_bt + [s for s in ordered if s not in uses_bt]


def validation_curve(metrics: pathlib.Path) -> list[dict[str, float]]:
    """(step, validation loss, greedy validation BLEU) of a run, from its metrics.jsonl."""
    records = visualize.read_metrics(metrics)
    return [
        {"step": r["step"], "loss": round(r["loss"], 4), "bleu": round(r.get("bleu", math.nan), 2)}
        for r in records
        if r.get("split") == "validation"
    ]


# ---------------------------------------------------------------------- report


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    bleu = [r["bleu"] for r in runs]
    return {
        "bleu": round(statistics.fmean(bleu), 2),
        "chrf": round(statistics.fmean(r["chrf"] for r in runs), 2),
        "bleu_per_seed": bleu,
        "seeds": [r["seed"] for r in runs],
        "spread": round(max(bleu) - min(bleu), 2),
    }


def _versus(results: dict, a: str, b: str) -> tuple[float, float]:
    """(BLEU of a - b, the larger seed spread of the two)."""
    ra, rb = results["settings"][a], results["settings"][b]
    return ra["bleu"] - rb["bleu"], max(ra["spread"], rb["spread"])


def _compare(results: dict, a: str, b: str) -> str:
    diff, spread = _versus(results, a, b)
    name = f"{SETTINGS[a][0]} vs {SETTINGS[b][0]}: {diff:+.2f} BLEU"
    if abs(diff) < max(1.0, spread):
        return f"{name}, within 1 BLEU / the seed spread ({spread:.2f}): no difference shown"
    return f"{name} ({'better' if diff > 0 else 'worse'}; seed spread {spread:.2f})"


def conclusion(results: dict) -> list[str]:
    s = results["settings"]
    lines = [f"- {_compare(results, k, 'a_only')}" for k in list(SETTINGS)[1:]]
    lines += [
        f"- {_compare(results, 'bt_sample', 'bt_beam')}. Edunov et al. (2018) found sampled "
        "or noised back-translation better than beam at scale (WMT'14 en-de, 5M real pairs), "
        "but in their low-resource simulation (80k real pairs, so a weak back-translation "
        "model) beam and greedy came out ahead of sampling; A here is "
        f"{results['split']['a']:,} pairs, the low-resource side.",
        f"- {_compare(results, 'bt_tagged', 'bt_beam')}. Caswell et al. (2019) found that "
        "tagging the synthetic sources recovers what noise and sampling give, and more.",
    ]
    gap = s["a_plus_b"]["bleu"] - max(s[k]["bleu"] for k in ("bt_beam", "bt_sample", "bt_tagged"))
    lines.append(
        f"- The real pairs lead the best back-translation by {gap:+.2f} BLEU: what a perfect "
        f"back-translation model would add here (the de->en model scores "
        f"{results['de_en']['bleu']:.2f} BLEU on the test set)."
    )
    ceiling, spread = _versus(results, "a_plus_b", "a_only")
    if abs(ceiling) < max(1.0, spread):
        lines.append(
            f"- B's real pairs themselves add only {ceiling:+.2f} BLEU to A at this size, within "
            "the noise: the model and its updates, not the data, limit it, so no source side "
            "for B (real or back-translated) can show an effect here. Edunov et al.'s and "
            "Caswell et al.'s gains are for big models trained to convergence on millions of "
            "pairs."
        )
    if results["size"]["name"] == "debug":
        lines.append(
            "- Debug size: a 1-layer model after a few updates; these numbers test the "
            "pipeline and say nothing about back-translation."
        )
    return lines


def _times(results: dict) -> str:
    """Each run's training time and CPU (a record's runs may come from several machines)."""
    runs = [("de_en", results["de_en"])] + [
        (f"{k}/seed{r['seed']}", r) for k, v in results["runs"].items() for r in v
    ]
    cpus = sorted({r.get("cpu", "?") for _, r in runs})
    return (
        "Training time per run: "
        + ", ".join(f"{name} {_duration(r['train_s'])}" for name, r in runs)
        + f" (on {'; '.join(cpus)})."
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 60:.0f} min"


def _bt_note(results: dict) -> list[str]:
    """A line for runs that trained on a back-translation other than the recorded one (the
    de->en model trained again, on another CPU, after ROOT was lost)."""
    odd = [
        f"{k}/seed{r['seed']}"
        for k, v in results["runs"].items()
        for r in v
        if SETTINGS[k][1]
        and SETTINGS[k][1][0] in results["bt"]
        and r.get("synthetic_sha256") not in (None, results["bt"][SETTINGS[k][1][0]]["sha256"])
    ]
    if not odd:
        return []
    return ["", f"Trained on a regenerated back-translation (not the recorded one): {odd}."]


def write_report(root: pathlib.Path, size: Size, results: dict) -> pathlib.Path:
    s, d = results["settings"], results["de_en"]
    a_only = s["a_only"]["bleu"]
    split = results["split"]
    lines = [
        "# Back-translation on Multi30k en->de",
        "",
        f"Size `{size.name}`: configs/multi30k.py{':variant=debug' if size.debug_variant else ''}"
        f" with model {json.dumps(size.model)}, overrides {json.dumps(results['overrides'])}, "
        f"vocabulary {size.vocab_size} (one, shared), {size.steps} updates of "
        f"{size.tokens_per_batch} tokens (warmup {size.warmup}, cooldown {size.cooldown}, peak "
        f"lr {size.peak_lr}). Train pairs split (seed {split['seed']}) into A = {split['a']} "
        f"parallel and B = {split['b']} (German only, but for the ceiling); synthetic corpora "
        f"at ratio 1.0 (half of each batch from B). {TEST_SPLIT}: last checkpoint, beam 4, "
        "length penalty 0.6. Produced by `python experiments/backtranslation.py"
        f"{' --debug' if size.debug_variant else ''}`. " + _times(results),
        *_bt_note(results),
        "",
        "| setting | test BLEU | per seed | test chrF | seeds | vs A alone |",
        "|---|---|---|---|---|---|",
        f"| de->en on A (the back-translation model) | {d['bleu']:.2f} | {d['bleu']:.2f} "
        f"| {d['chrf']:.2f} | 0 | |",
    ]
    for k, (label, _) in SETTINGS.items():
        r = s[k]
        per = " / ".join(f"{b:.2f}" for b in r["bleu_per_seed"])
        seeds = ",".join(map(str, r["seeds"]))
        vs = "" if k == "a_only" else f"{r['bleu'] - a_only:+.2f}"
        lines.append(f"| {label} | {r['bleu']:.2f} | {per} | {r['chrf']:.2f} | {seeds} | {vs} |")
    steps = [p["step"] for p in results["curves"]["a_only"]]
    lines += [
        "",
        "B's English, mean words per line (empty lines): "
        + ", ".join(
            f"{k} {v['mean_words']:.1f} ({v['empty']} of {v['lines']})"
            for k, v in results["bt"].items()
        )
        + ".",
        "",
        "## Training curves (seed 0)",
        "",
        "![curves](curves.png)",
        "",
        "Greedy validation BLEU (first "
        f"{size.bleu_examples} sentences) / validation loss by update:",
        "",
        "| setting | " + " | ".join(str(x) for x in steps) + " |",
        "|---|" + "---|" * len(steps),
    ]
    for k, (label, _) in SETTINGS.items():
        cells = [f"{p['bleu']:.1f} / {p['loss']:.2f}" for p in results["curves"][k]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## Conclusion", "", *conclusion(results), ""]
    lines += [f"BLEU: `{d['signature']}`; chrF: `{d['chrf_signature']}`", ""]
    path = root / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


# ---------------------------------------------------------------------- the study


def _finished(workdir: pathlib.Path, record: pathlib.Path) -> bool:
    return (workdir / RESULT).exists() or record.with_suffix(".json").exists()


def run_study(root: pathlib.Path, size: Size, manual_dir: pathlib.Path, args, log=print):
    overrides = parse_assignments(args.override, "--override")
    record = pathlib.Path(args.record)
    split = split_corpus(manual_dir, root, size)
    shared_tokenizer(root, size)
    de_en_config = make_config(size, root, "de-en", 0, [], overrides)
    de_en = train_and_score(
        de_en_config, root / "de_en", "de_en", log, root=root, record=record / "de_en"
    )

    def corpus(method: str) -> pathlib.Path:
        path = back_translate(
            root,
            method,
            lambda: train_model(de_en_config, root / "de_en", "de_en", log),
            log,
        )
        stats, kept = bt_stats(path), record / "bt" / f"{method}.json"
        if not kept.exists():
            kept.parent.mkdir(parents=True, exist_ok=True)
            _write(kept, [json.dumps(stats, indent=1)])
        elif json.loads(kept.read_text())["sha256"] != stats["sha256"]:
            log(
                f"[bt/{method}] {path} differs from the recorded one ({kept}): the de->en model "
                "was trained again on another CPU; the runs record which one they used"
            )
        return path

    runs: dict[str, list[dict]] = {k: [] for k in SETTINGS}

    def en_de(setting: str, seed: int) -> None:
        name = f"{setting}/seed{seed}"
        workdir, kept = root / "en_de" / name, record / "en_de" / setting / f"seed{seed}"
        how, extra = SETTINGS[setting][1], {}
        if how is not None and not _finished(workdir, kept):
            source = root / "data" / "B.en" if how[0] == "real" else corpus(how[0])
            extra["synthetic_sha256"] = _sha256(source)
        c = make_config(size, root, "en-de", seed, synthetic_corpora(root, setting), overrides)
        runs[setting].append(
            train_and_score(c, workdir, name, log, root=root, record=kept, extra=extra)
        )

    for setting in RUN_ORDER:  # back-translated runs early, while the corpora are here
        en_de(setting, 0)
    runs = {k: runs[k] for k in SETTINGS}
    again = second_seed_settings({k: v[0]["bleu"] for k, v in runs.items()}, args.second_seed)
    for setting in second_seed_order(again):
        en_de(setting, 1)
    bt = {m: json.loads((record / "bt" / f"{m}.json").read_text()) for m in BT_METHODS}
    bt["real"] = bt_stats(root / "data" / "B.en")
    metrics = {k: record / "en_de" / k / "seed0.metrics.jsonl" for k in SETTINGS}
    curves = {k: validation_curve(m) for k, m in metrics.items()}
    visualize.plot_curves(
        list(metrics.values()), root / "curves.png", keys=("loss", "bleu"), labels=list(SETTINGS)
    )
    strip = lambda r: {k: v for k, v in r.items() if k != "fingerprint"}  # noqa: E731
    return {
        "size": dataclasses.asdict(size),
        "overrides": overrides,
        "split": split,
        "second_seed": {"policy": args.second_seed, "settings": again},
        "de_en": strip(de_en),
        "bt": bt,
        "settings": {k: summarise(v) for k, v in runs.items()},
        "runs": {k: [strip(r) for r in v] for k, v in runs.items()},
        "curves": curves,
    }


def status_table(record: pathlib.Path) -> list[str]:
    """The study's table from its record alone, finished runs only (--status)."""

    def cell(path: pathlib.Path) -> tuple[str, str]:
        if not path.exists():
            return "not run", ""
        r = json.loads(path.read_text())
        return f"{r['bleu']:.2f}", f"{r['chrf']:.2f}"

    rows = [("de->en on A (back-translates B)", [record / "de_en.json"])]
    rows += [
        (label, sorted((record / "en_de" / k).glob("seed*.json")) or [record / "en_de" / k])
        for k, (label, _) in SETTINGS.items()
    ]
    lines = ["| trained on | test BLEU | test chrF |", "|---|---|---|"]
    for label, paths in rows:
        cells = [cell(p) for p in paths]
        bleu = " / ".join(c[0] for c in cells)
        chrf = " / ".join(c[1] for c in cells if c[1])
        lines.append(f"| {label} | {bleu} | {chrf} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=str(REPO / "runs" / "backtranslation"))
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--debug", action="store_true", help="--size=debug (the test)")
    parser.add_argument(
        "--record",
        default="",
        help="where each finished run's score and curve are kept (default: "
        "experiments/results/backtranslation/SIZE, in the repository; debug: ROOT/record)",
    )
    parser.add_argument("--manual_dir", default=str(DEFAULT_MANUAL_DIR), help="raw Multi30k")
    parser.add_argument("--second_seed", choices=("close", "all", "none"), default="close")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--status", action="store_true", help="print the finished runs' table and stop"
    )
    args = parser.parse_args(argv)
    size = SIZES["debug" if args.debug else args.size]
    root = pathlib.Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if not args.record:
        default = root / "record" if size.name == "debug" else RECORDS / size.name
        args.record = str(default)
    if args.status:
        print("\n".join(status_table(pathlib.Path(args.record))))
        return 0
    results = run_study(root, size, pathlib.Path(args.manual_dir).resolve(), args)
    (root / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    report = write_report(root, size, results)
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
