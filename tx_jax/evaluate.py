"""Evaluate a checkpoint: decode a split, score it with sacreBLEU, log the result.

    python -m tx_jax.evaluate --workdir=runs/default                  test split, beam 4, alpha 0.6
    python -m tx_jax.evaluate --workdir=runs/default --step=400 --split=validation --beam_size=1
    python -m tx_jax.evaluate --workdir=runs/default --average_last=3     (saved, then reused)
    python -m tx_jax.evaluate --checkpoint=runs/default/averaged/last3/600
    python -m tx_jax.evaluate --workdir=runs/default --sweep --beams=1,4 --alphas=0.6,1.0
    python -m tx_jax.evaluate --workdir=runs/default --config.data.data_dir=/data/tfds
    python -m tx_jax.evaluate --workdir=runs/multi --direction=de-fr [--pivot=en]   multilingual
    python -m tx_jax.evaluate --workdir=runs/multi --direction=all      every trained direction

The model, tokenizer and config come from the checkpoint (restore.py), restored onto one
local device whatever layout trained it; `--config.key=value` overrides the stored config
(data paths, eval batch size). Beam search defaults to the paper's beam 4, alpha 0.6
(section 6.1); beam 1 is greedy. Outputs, WORKDIR being the run directory:

    WORKDIR/eval/<split>[_<src>-<tgt>[_via-<pivot>]]_step<N>[_avg<K>]_beam<b>[_alpha<a>][_first<n>].txt
        detokenized hypotheses, one line per example, in corpus order (no alpha for greedy)
    WORKDIR/eval_results.jsonl
        one JSON record appended per evaluation: step, split, beam, alpha, bleu, signature
        (sacreBLEU's), chrf, chrf_signature, loss, accuracy, perplexity (teacher-forced on
        the split), examples, averaged (K or null), averaged_steps, seconds (wall, all of
        it), decode_seconds, hypotheses (path), checkpoint, limit, sweep, time, direction
        and pivot (multilingual; else null)
    stdout: one result line per evaluation (and the grid for --sweep)

A multilingual checkpoint (trained with data.directions) needs --direction: any SRC-TGT whose
target language has a tag, trained or not (zero-shot, e.g. de-fr of a model trained on en<->de
and en<->fr), or 'all' (the trained directions, then their mean BLEU). Sources get the target's
'<2xx>' tag id; --pivot=en translates into English first, then into the target (multilingual.py).
The loss, accuracy and perplexity are teacher-forced on the direction itself (tagged).

`--sweep` decodes the validation split (or --split) over --beams x --alphas, appends every
point to eval_results.jsonl, prints the grid and the best pair.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import app, flags, logging
from etils import epath

from tx_jax import evaluation, multilingual, restore, train
from tx_jax.data import directions, tasks

RESULTS_FILE = "eval_results.jsonl"
EVAL_DIR = "eval"
SWEEP_BEAMS = (1, 2, 4, 6)
SWEEP_ALPHAS = (0.0, 0.6, 1.0)


# ---------------------------------------------------------------------- pieces


def loss_metrics(loaded: restore.Loaded, batches: Sequence[dict]) -> dict[str, float]:
    """Teacher-forced NLL per target token, accuracy and perplexity over eval batches."""
    model = loaded.model

    @jax.jit
    def sums(params, batch):
        return train.eval_step(types.SimpleNamespace(params=params), batch, model=model)

    totals = {"nll": 0.0, "correct": 0.0, "weight": 0.0}
    for batch in batches:
        out = jax.device_get(sums(loaded.params, {k: batch[k] for k in ("inputs", "targets")}))
        totals = {k: totals[k] + float(out[k]) for k in totals}
    w = max(totals["weight"], 1.0)
    loss = totals["nll"] / w
    return {"loss": loss, "accuracy": totals["correct"] / w, "perplexity": math.exp(min(loss, 50))}


def hypotheses_path(
    workdir: epath.Path,
    split: str,
    step: int,
    beam_size: int,
    alpha: float,
    *,
    averaged: int | None = None,
    limit: int | None = None,
    direction: str | None = None,
    pivot: str | None = None,
) -> epath.Path:
    """WORKDIR/eval/<split>[_<dir>[_via-<pivot>]]_step<N>[_avg<K>]_beam<b>[_alpha<a>][_first<n>].txt"""
    name = split + (f"_{direction}" if direction else "") + (f"_via-{pivot}" if pivot else "")
    name += f"_step{step}"
    name += f"_avg{averaged}" if averaged else ""
    name += f"_beam{beam_size}" + (f"_alpha{alpha:g}" if beam_size > 1 else "")
    name += f"_first{limit}" if limit is not None else ""
    return workdir / EVAL_DIR / (re.sub(r"[^\w.+-]", "_", name) + ".txt")  # 'train[:8]'...


def write_lines(path: epath.Path, lines: Sequence[str]) -> None:
    """One line per item; newlines inside an item become spaces (line i = example i)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(" ".join(line.splitlines()) + "\n" for line in lines))


def append_record(workdir: epath.Path, record: Mapping[str, Any]) -> None:
    with (workdir / RESULTS_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")


class _Split:
    """One split of a loaded checkpoint's dataset: pairs, eval batches and loss metrics
    (of one direction of a multilingual checkpoint: its sources tagged)."""

    def __init__(
        self, loaded: restore.Loaded, split: str, limit: int | None, direction: str | None = None
    ):
        data, seed = loaded.config.data, loaded.config.seed
        if directions.is_multilingual(data) and not direction:
            trained = ", ".join(map(directions.direction_name, directions.train_directions(data)))
            raise restore.CheckpointError(
                f"{loaded.path} is multilingual ({trained}): give a direction (--direction="
                "SRC-TGT, trained or zero-shot, or all)"
            )
        if direction:
            task = directions.direction_task(data, loaded.tokenizer, seed, direction)
            self.direction = directions.direction_name(
                (task.data.source_lang, task.data.target_lang)
            )
        else:
            task = tasks.TranslationTask(data, loaded.tokenizer, seed)
            self.direction = None
        self.name, self.limit = split, limit
        self.dataset_split = task.split_name(split)
        self.pairs = task.pairs(split, limit)
        self.batches = task.eval_batches(split, 1, limit)
        self.references = [self.pairs[i][1] for i in range(len(self.pairs))]
        self.metrics = loss_metrics(loaded, self.batches)


def _decode(
    loaded: restore.Loaded,
    data: _Split,
    beam_size: int,
    alpha: float,
    *,
    write: bool,
    pivot: str | None = None,
) -> dict[str, Any]:
    """Translate and score one split; write the hypotheses -> the record (no totals yet)."""
    start = time.time()
    if pivot:
        if not data.direction:
            raise restore.CheckpointError("a pivot needs a direction of a multilingual model")
        sources = [data.pairs[i][0] for i in range(len(data.pairs))]
        hyps = multilingual.translate_to(
            loaded, sources, data.direction.split("-")[1], pivot=pivot, beam_size=beam_size,
            alpha=alpha, batch_size=loaded.config.data.eval_batch_size, warn=lambda m: None,
        )  # fmt: skip
    else:
        hyps = evaluation.translate_batches(
            loaded.model_config, loaded.params, data.batches, loaded.tokenizer, len(data.pairs),
            beam_size=beam_size, alpha=alpha,
        )  # fmt: skip
    seconds = time.time() - start
    bleu, chrf, sig, chrf_sig = evaluation.score(hyps, data.references)
    averaged = len(loaded.averaged_steps) if loaded.averaged_steps else None
    path = hypotheses_path(loaded.workdir, data.name, loaded.step, beam_size, alpha,
                           averaged=averaged, limit=data.limit, direction=data.direction,
                           pivot=pivot)  # fmt: skip
    if write:
        write_lines(path, hyps)
    return {
        "step": loaded.step, "split": data.name, "dataset_split": data.dataset_split,
        "beam": beam_size, "alpha": alpha if beam_size > 1 else None,
        "bleu": bleu, "signature": sig, "chrf": chrf, "chrf_signature": chrf_sig,
        **data.metrics, "examples": len(hyps), "averaged": averaged,
        "averaged_steps": loaded.averaged_steps, "decode_seconds": round(seconds, 3),
        "hypotheses": str(path) if write else None, "checkpoint": str(loaded.path),
        "limit": data.limit, "direction": data.direction, "pivot": pivot,
    }  # fmt: skip


def _finish(record: dict, start: float, *, write: bool, sweep: bool, workdir) -> dict:
    record.update(seconds=round(time.time() - start, 3), sweep=sweep,
                  time=time.strftime("%Y-%m-%dT%H:%M:%S"))  # fmt: skip
    if write and jax.process_index() == 0:
        append_record(workdir, record)
    return record


def result_line(r: Mapping[str, Any]) -> str:
    search = f"beam {r['beam']}" + (f" alpha {r['alpha']:g}" if r["alpha"] is not None else "")
    avg = f" (average of {r['averaged']})" if r["averaged"] else ""
    way = f" {r['direction']}" if r.get("direction") else ""
    way += f" via {r['pivot']}" if r.get("pivot") else ""
    return (
        f"{r['split']}{way} step {r['step']}{avg} {search}: BLEU {r['bleu']:.2f} chrF "
        f"{r['chrf']:.2f} loss {r['loss']:.4f} ppl {r['perplexity']:.2f} "
        f"[{r['examples']} examples, {r['seconds']:.1f} s]  {r['signature']}"
    )


# ---------------------------------------------------------------------- library API


def evaluate(
    workdir: str | epath.Path | None = None,
    *,
    checkpoint: str | epath.Path | None = None,
    step: int | None = None,
    average_last: int | None = None,
    split: str = "test",
    beam_size: int = 4,
    alpha: float = 0.6,
    limit: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    write: bool = True,
    direction: str | None = None,
    pivot: str | None = None,
) -> dict[str, Any]:
    """Decode `split` of a checkpoint (restore.load's arguments) and score it -> the record
    appended to WORKDIR/eval_results.jsonl (module docstring); `write=False` writes nothing.
    `split` is 'validation', 'test' (the config's eval/test splits) or any split name;
    `limit` keeps the first N examples. A multilingual checkpoint needs `direction`
    ('de-fr', trained or zero-shot); `pivot` ('en') translates through that language."""
    start = time.time()
    loaded = restore.load(workdir, checkpoint=checkpoint, step=step, average_last=average_last,
                          overrides=overrides)  # fmt: skip
    return evaluate_loaded(loaded, split=split, beam_size=beam_size, alpha=alpha, limit=limit,
                           write=write, direction=direction, pivot=pivot, start=start)  # fmt: skip


def evaluate_loaded(
    loaded: restore.Loaded,
    *,
    split: str = "test",
    beam_size: int = 4,
    alpha: float = 0.6,
    limit: int | None = None,
    write: bool = True,
    direction: str | None = None,
    pivot: str | None = None,
    start: float | None = None,
) -> dict[str, Any]:
    """`evaluate` of an already loaded checkpoint (load once, evaluate many directions)."""
    start = time.time() if start is None else start
    data = _Split(loaded, split, limit, direction)
    record = _decode(loaded, data, beam_size, alpha, write=write, pivot=pivot)
    return _finish(record, start, write=write, sweep=False, workdir=loaded.workdir)


def evaluate_directions(
    workdir: str | epath.Path | None = None,
    *,
    names: Sequence[str] | None = None,
    pivot: str | None = None,
    checkpoint: str | epath.Path | None = None,
    step: int | None = None,
    average_last: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """One `evaluate` record per direction of a multilingual checkpoint (default: its trained
    directions, in config order); `kwargs` are evaluate_loaded's (split, beam_size, ...)."""
    loaded = restore.load(workdir, checkpoint=checkpoint, step=step, average_last=average_last,
                          overrides=overrides)  # fmt: skip
    if not directions.is_multilingual(loaded.config.data):
        raise restore.CheckpointError(f"{loaded.path} is not multilingual (no data.directions)")
    trained = directions.train_directions(loaded.config.data)
    names = names or [directions.direction_name(d) for d in trained]
    return [evaluate_loaded(loaded, direction=n, pivot=pivot, **kwargs) for n in names]


def sweep(
    workdir: str | epath.Path | None = None,
    *,
    checkpoint: str | epath.Path | None = None,
    step: int | None = None,
    average_last: int | None = None,
    split: str = "validation",
    beams: Sequence[int] = SWEEP_BEAMS,
    alphas: Sequence[float] = SWEEP_ALPHAS,
    limit: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    write: bool = True,
    direction: str | None = None,
) -> dict[str, Any]:
    """Decode `split` for every beam size x alpha (greedy once: alpha does not apply) ->
    {'best': record, 'points': [record, ...]}; the best is the highest BLEU, ties going to
    the smaller beam, then the smaller alpha. `direction`: as for `evaluate`."""
    start = time.time()
    loaded = restore.load(workdir, checkpoint=checkpoint, step=step, average_last=average_last,
                          overrides=overrides)  # fmt: skip
    data = _Split(loaded, split, limit, direction)
    points = []
    for beam in sorted(set(beams)):
        for alpha in sorted(set(alphas)) if beam > 1 else [None]:
            record = _decode(loaded, data, beam, alpha or 0.0, write=write)
            points.append(_finish(record, start, write=write, sweep=True,
                                  workdir=loaded.workdir))  # fmt: skip
    best = points[int(np.argmax([p["bleu"] for p in points]))]
    return {"best": best, "points": points}


def sweep_table(points: Sequence[Mapping[str, Any]]) -> str:
    """BLEU as a grid: one row per beam size, one column per alpha (greedy: every column)."""
    alphas = sorted({p["alpha"] for p in points if p["alpha"] is not None}) or [None]
    lines = ["beam \\ alpha " + "".join(f"{a:>8g}" if a is not None else "       -"
                                        for a in alphas)]  # fmt: skip
    for beam in sorted({p["beam"] for p in points}):
        row = {p["alpha"]: p["bleu"] for p in points if p["beam"] == beam}
        cells = [row.get(a, row.get(None, float("nan"))) for a in alphas]
        lines.append(f"{beam:>12} " + "".join(f"{c:>8.2f}" for c in cells))
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line


def define_checkpoint_flags() -> None:
    """--workdir, --checkpoint, --step, --average_last (shared with translate.py)."""
    flags.DEFINE_string(
        "workdir", None, "Training run directory (checkpoints in WORKDIR/checkpoints)."
    )
    flags.DEFINE_string(
        "checkpoint",
        None,
        "A checkpoint directory instead: WORKDIR/averaged/last5, or one step of it.",
    )
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_integer("average_last", None,
                         "Average the last K checkpoints (up to --step); saved under "
                         "WORKDIR/averaged and reused.")  # fmt: skip


def split_config_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Separate '--config.key=value' arguments (stored-config overrides) from absl's."""
    rest = [a for a in argv if not a.startswith("--config.")]
    return rest, restore.parse_override_args([a for a in argv if a.startswith("--config.")])


def run_cli(main, argv: list[str] | None = None) -> None:
    """absl's app.run with '--config.*' overrides taken out first; user errors (no such
    checkpoint, step or split, unfit config) exit with a one-line message."""
    argv = list(sys.argv if argv is None else argv)
    try:
        argv, overrides = split_config_args(argv)
    except restore.CheckpointError as e:
        sys.exit(f"error: {e}")

    def guarded(args):
        logging.set_verbosity(logging.ERROR)  # Orbax's read-only notices are noise here
        try:
            main(args, overrides)
        except (restore.CheckpointError, FileNotFoundError, KeyError, ValueError) as e:
            message = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
            if len(message) > 2000:  # e.g. a pytree printed whole by a library
                message = message[:2000] + " ..."
            sys.exit(f"error: {message}")

    app.run(guarded, argv=argv)


def _main(argv: list[str], overrides: dict[str, str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if f.workdir is None and f.checkpoint is None:
        raise app.UsageError("give --workdir (or --checkpoint)")
    common = dict(checkpoint=f.checkpoint, step=f.step, average_last=f.average_last,
                  limit=f.limit, overrides=overrides)  # fmt: skip
    if f.pivot and not f.direction:
        raise app.UsageError("--pivot needs --direction (a multilingual checkpoint)")
    if f.direction == "all":
        if f.sweep:
            raise app.UsageError("--sweep takes one --direction")
        records = evaluate_directions(f.workdir, pivot=f.pivot, split=f.split,
                                      beam_size=f.beam_size, alpha=f.alpha, **common)  # fmt: skip
        for record in records:
            print(result_line(record))
        print(f"mean BLEU over {len(records)} directions: "
              f"{np.mean([r['bleu'] for r in records]):.2f}")  # fmt: skip
        return
    common["direction"] = f.direction
    if f.sweep:
        if f.pivot:
            raise app.UsageError("--sweep decodes directly: no --pivot")
        split = f.split if f["split"].present else "validation"
        out = sweep(f.workdir, split=split, beams=[int(b) for b in f.beams],
                    alphas=[float(a) for a in f.alphas], **common)  # fmt: skip
        for point in out["points"]:
            print(result_line(point))
        print(sweep_table(out["points"]))
        best = out["best"]
        search = (
            "greedy" if best["alpha"] is None else f"beam {best['beam']} alpha {best['alpha']:g}"
        )
        print(f"best: {search}, BLEU {best['bleu']:.2f}")
        return
    record = evaluate(f.workdir, split=f.split, beam_size=f.beam_size, alpha=f.alpha,
                      pivot=f.pivot, **common)  # fmt: skip
    print(result_line(record))
    print(f"hypotheses: {record['hypotheses']}")


def main() -> None:
    define_checkpoint_flags()
    flags.DEFINE_string("split", "test", "validation | test | any split name of the dataset.")
    flags.DEFINE_integer("beam_size", 4, "Beam size; 1 is greedy (paper: 4).")
    flags.DEFINE_float("alpha", 0.6, "GNMT length penalty alpha (paper: 0.6).")
    flags.DEFINE_integer("limit", None, "Evaluate only the first N examples.")
    flags.DEFINE_bool("sweep", False, "Decode the validation split over --beams x --alphas.")
    flags.DEFINE_list("beams", [str(b) for b in SWEEP_BEAMS], "Sweep: beam sizes.")
    flags.DEFINE_list("alphas", [str(a) for a in SWEEP_ALPHAS], "Sweep: length penalties.")
    flags.DEFINE_string("direction", None, "Multilingual checkpoints: SRC-TGT (trained or "
                        "zero-shot, e.g. de-fr) or 'all' (every trained direction).")  # fmt: skip
    flags.DEFINE_string("pivot", None, "With --direction: translate through this language "
                        "(e.g. en): SRC -> pivot -> TGT with the same model.")  # fmt: skip
    run_cli(_main)


if __name__ == "__main__":
    main()
