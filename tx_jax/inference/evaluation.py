"""Evaluate a checkpoint: decode a split, score it with sacreBLEU, log the result (the
commands: cli/evaluate.py).

    record = evaluation.evaluate("runs/default", split="validation", beam_size=4)
    swept = evaluation.sweep("runs/default", beams=(1, 4), length_penalties=(0.6, 1.0))

The model, tokenizer and config come from the checkpoint (restore.py); `--config.key=value`
overrides the stored config. Beam 1 is greedy. Outputs, WORKDIR being the run directory:

    WORKDIR/eval/<split>[_<src>-<tgt>[_via-<pivot>]]_step<N>[_avg<K>]_beam<b>[_penalty<p>][_first<n>].txt
        detokenized hypotheses, one line per example, in corpus order (no length penalty for greedy)
    WORKDIR/eval_results.jsonl
        one JSON record appended per evaluation (BLEU, chrF, teacher-forced loss, times, ...;
        docs/evaluation.md lists its fields)
    stdout: one result line per evaluation (and the grid for --sweep)

A multilingual checkpoint needs --direction: any SRC-TGT whose target language has a tag,
trained or zero-shot, or 'all' (the trained directions, then their mean BLEU); --pivot=en
translates through English (multilingual.py). An imported M2M100/NLLB model's language
tokens are data.source_lang/target_lang's or --source_lang/--target_lang's
(inference/languages.py); the dataset's sides stay data.source_lang/target_lang.
`--sweep` decodes over --beams x --length_penalties and prints the grid and the best pair.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from etils import epath

from tx_jax import paths
from tx_jax.data import directions, tasks
from tx_jax.inference import compilation, languages, multilingual, quality, restore
from tx_jax.training.step import eval_sums, model_inputs
from tx_jax.training.step import loss_metrics as reduce_loss_metrics

RESULTS_FILE = "eval_results.jsonl"
EVAL_DIR = "eval"
SWEEP_BEAMS = (1, 2, 4, 6)
SWEEP_LENGTH_PENALTIES = (0.0, 0.6, 1.0)


# ---------------------------------------------------------------------- pieces


# The teacher-forced pass runs one program (rows restacked into batches of this many times
# data.eval_batch_size, padded to the longest bucket): a program per bucket compiles for
# longer than the padding runs.
LOSS_BATCH_FACTOR = 4


def loss_batches(batches: Sequence[dict], rows: int) -> list[dict[str, np.ndarray]]:
    """Eval batches of any lengths -> the same rows (model inputs only, in order) in batches
    of `rows`, padded to the longest length and filled with all-padding rows."""
    if not batches:
        return []
    keys = list(model_inputs(batches[0]))
    length = max(b[k].shape[1] for b in batches for k in keys)
    stacked = {
        k: np.concatenate([np.pad(b[k], ((0, 0), (0, length - b[k].shape[1]))) for b in batches])
        for k in keys
    }
    total = len(stacked[keys[0]])
    filled = -(-total // rows) * rows
    stacked = {k: np.pad(v, ((0, filled - total), (0, 0))) for k, v in stacked.items()}
    return [{k: v[i : i + rows] for k, v in stacked.items()} for i in range(0, filled, rows)]


def loss_metrics(
    loaded: restore.Loaded, batches: Sequence[dict], rows: int | None = None
) -> dict[str, float]:
    """Teacher-forced NLL per target token, accuracy and perplexity over eval batches (run
    as `loss_batches` of `rows`, default LOSS_BATCH_FACTOR x data.eval_batch_size)."""
    params = nn.meta.unbox(loaded.params)
    static = {"model": loaded.model}
    rows = rows or LOSS_BATCH_FACTOR * loaded.config.data.eval_batch_size
    inputs = loss_batches(batches, rows)
    sums = compilation.dispatch(  # all dispatched, then fetched
        [functools.partial(compilation.cached_call, _eval_sums, static, params, x) for x in inputs],
        [tuple(sorted((k, v.shape) for k, v in x.items())) for x in inputs],
        workers=None if compilation.on_one_device(params) else 1,  # collectives: one order
    )
    return reduce_loss_metrics(jax.device_get(s) for s in sums)


def _eval_sums(params: Any, batch: dict, *, model: Any) -> dict:
    return eval_sums(params, batch, model=model)


def load(
    workdir: str | epath.Path | None,
    checkpoint: str | epath.Path | None,
    step: int | None,
    average_last: int | None,
    overrides: Mapping[str, Any] | None,
) -> restore.Loaded:
    """restore.load for evaluation: with `average_last` None, a workdir's run is scored as
    its config says (the average of its last `eval.average_last` checkpoints, when set);
    `average_last=0` scores the checkpoint itself."""
    configured = average_last is None and checkpoint is None and workdir is not None
    if configured:
        average_last = restore.stored_config(workdir).get("eval", {}).get("average_last")
    try:
        return restore.load(
            workdir,
            checkpoint=checkpoint,
            step=step,
            average_last=average_last or None,
            overrides=overrides,
        )
    except restore.CheckpointError as e:
        if not (configured and average_last):
            raise
        raise restore.CheckpointError(
            f"{e} (the run's config sets eval.average_last={average_last}; give "
            "average_last=0 to score a single checkpoint)"
        ) from None


def hypotheses_path(
    workdir: epath.Path,
    split: str,
    step: int,
    beam_size: int,
    length_penalty: float,
    *,
    averaged: int | None = None,
    limit: int | None = None,
    direction: str | None = None,
    pivot: str | None = None,
) -> epath.Path:
    """WORKDIR/eval/<split>[_<dir>[_via-<pivot>]]_step<N>[_avg<K>]_beam<b>[_penalty<p>][_first<n>].txt"""
    name = split + (f"_{direction}" if direction else "") + (f"_via-{pivot}" if pivot else "")
    name += f"_step{step}"
    name += f"_avg{averaged}" if averaged else ""
    name += f"_beam{beam_size}" + (f"_penalty{length_penalty:g}" if beam_size > 1 else "")
    name += f"_first{limit}" if limit is not None else ""
    return workdir / EVAL_DIR / (re.sub(r"[^\w.+-]", "_", name) + ".txt")  # 'train[:8]'...


def write_lines(path: epath.Path, lines: Sequence[str]) -> None:
    """One line per item; newlines inside an item become spaces (line i = example i)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(" ".join(line.splitlines()) + "\n" for line in lines))


def append_record(workdir: epath.Path, record: Mapping[str, Any]) -> None:
    paths.append_text(workdir / RESULTS_FILE, json.dumps(record) + "\n")


class _Split(quality.Split):
    """One split of a loaded checkpoint's dataset (or direction's) and its teacher-forced
    loss metrics."""

    def __init__(
        self,
        loaded: restore.Loaded,
        split: str,
        limit: int | None,
        direction: str | None = None,
        *,
        source_lang: str | None = None,
        target_lang: str | None = None,
    ):
        data, seed = loaded.config.data, loaded.config.seed
        if directions.is_multilingual(data) and not direction:
            trained = ", ".join(map(directions.direction_name, directions.train_directions(data)))
            raise restore.CheckpointError(
                f"{loaded.path} is multilingual ({trained}): give a direction (--direction="
                "SRC-TGT, trained or zero-shot, or all)"
            )
        if direction:
            if source_lang or target_lang:
                raise ValueError(
                    "--source_lang/--target_lang: a multilingual checkpoint's languages are "
                    f"its --direction ({direction})"
                )
            task = tasks.direction_task(data, loaded.tokenizer, seed, direction)
            self.direction = directions.direction_name(
                (task.data.source_lang, task.data.target_lang)
            )
        else:
            # The language tokens translate would use (an imported M2M100/NLLB model's, by
            # default for the data's languages); a plain run refuses other languages there.
            prefixes = languages.prefixes(
                loaded, source_lang or data.source_lang, target_lang or data.target_lang
            )
            task = tasks.Task(data, loaded.tokenizer, seed, prefixes=prefixes)
            self.direction = None
        given = source_lang or target_lang  # named in the record and the hypotheses' file
        pair = f"{source_lang or data.source_lang}-{target_lang or data.target_lang}"
        self.languages = pair if given else None
        super().__init__(task, split, limit)
        self.dataset_split = task.split_name(split)
        # Computed beside the decoding that follows (a thread of its own): sums, in any order.
        pool = concurrent.futures.ThreadPoolExecutor(1, "tx_jax-loss")
        self._metrics = pool.submit(loss_metrics, loaded, self.batches)
        pool.shutdown(wait=False)

    @property
    def metrics(self) -> dict[str, float]:
        """The teacher-forced loss metrics (waits for them)."""
        return self._metrics.result()


def _decode(
    loaded: restore.Loaded,
    data: _Split,
    beam_size: int,
    length_penalty: float,
    *,
    write: bool,
    pivot: str | None = None,
    profile_dir: str | epath.Path | None = None,
) -> dict[str, Any]:
    """Translate and score one split; write the hypotheses -> the record (no totals yet).
    With `profile_dir`, the split is decoded again under jax.profiler, compiled by then, so
    that the trace shows decoding alone."""
    via = None
    if pivot:
        if not data.direction:
            raise restore.CheckpointError("a pivot needs a direction of a multilingual model")
        target = data.direction.split("-")[1]
        via = multilingual.through(
            loaded, target, pivot, beam_size=beam_size, length_penalty=length_penalty
        )
    model = (loaded.model_config, loaded.params, loaded.tokenizer, data)
    kw = dict(beam_size=beam_size, length_penalty=length_penalty, translate=via)
    result = quality.measure_split(*model, **kw)
    seconds = result.decode_seconds
    if profile_dir is not None:
        with jax.profiler.trace(str(profile_dir)):
            start = time.time()
            quality.translate_split(*model, **kw)
            seconds = time.time() - start  # the traced (compiled) pass's
    averaged = len(loaded.averaged_steps) if loaded.averaged_steps else None
    path = hypotheses_path(
        loaded.workdir,
        data.name,
        loaded.step,
        beam_size,
        length_penalty,
        averaged=averaged,
        limit=data.limit,
        direction=data.direction or data.languages,
        pivot=pivot,
    )
    if write:
        write_lines(path, result.hypotheses)
    return {
        "step": loaded.step,
        "split": data.name,
        "dataset_split": data.dataset_split,
        "beam": beam_size,
        "length_penalty": length_penalty if beam_size > 1 else None,
        "bleu": result.bleu,
        "signature": result.signature,
        "chrf": result.chrf,
        "chrf_signature": result.chrf_signature,
        **data.metrics,
        "examples": len(result.hypotheses),
        "averaged": averaged,
        "averaged_steps": loaded.averaged_steps,
        "decode_seconds": round(seconds, 3),
        "hypotheses": str(path) if write else None,
        "checkpoint": str(loaded.path),
        "limit": data.limit,
        "direction": data.direction,
        "languages": data.languages,
        "pivot": pivot,
    }


def _finish(record: dict, start: float, *, write: bool, sweep: bool, workdir) -> dict:
    record.update(
        seconds=round(time.time() - start, 3), sweep=sweep, time=time.strftime("%Y-%m-%dT%H:%M:%S")
    )
    if write and jax.process_index() == 0:
        append_record(workdir, record)
    return record


def _compiled(r: Mapping[str, Any]) -> str:
    if r.get("compile_seconds") is None:
        return ""
    cached = f", {r['compile_cache_hits']} from cache" if r.get("compile_cache_hits") else ""
    return f", of which compiling {r['compile_seconds']:.1f} s ({r['compiled_programs']}{cached})"


def result_line(r: Mapping[str, Any]) -> str:
    search = f"beam {r['beam']}" + (
        f" length penalty {r['length_penalty']:g}" if r["length_penalty"] is not None else ""
    )
    avg = f" (average of {r['averaged']})" if r["averaged"] else ""
    way = f" {r['direction']}" if r.get("direction") else ""
    way += f" via {r['pivot']}" if r.get("pivot") else ""
    return (
        f"{r['split']}{way} step {r['step']}{avg} {search}: BLEU {r['bleu']:.2f} chrF "
        f"{r['chrf']:.2f} loss {r['loss']:.4f} ppl {r['perplexity']:.2f} "
        f"[{r['examples']} examples, {r['seconds']:.1f} s{_compiled(r)}]  {r['signature']}"
    )


# ---------------------------------------------------------------------- library API


def evaluate(
    workdir: str | epath.Path | None = None,
    *,
    checkpoint: str | epath.Path | None = None,
    step: int | None = None,
    average_last: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Load a checkpoint (restore.load's arguments) and `evaluate_loaded` it (its keyword
    arguments) -> the record."""
    start = time.time()
    loaded = load(workdir, checkpoint, step, average_last, overrides)
    return evaluate_loaded(loaded, start=start, **kwargs)


def evaluate_loaded(
    loaded: restore.Loaded,
    *,
    split: str = "test",
    beam_size: int = 4,
    length_penalty: float = 0.6,
    limit: int | None = None,
    write: bool = True,
    direction: str | None = None,
    pivot: str | None = None,
    start: float | None = None,
    profile: bool = False,
    source_lang: str | None = None,
    target_lang: str | None = None,
) -> dict[str, Any]:
    """Decode `split` of a loaded checkpoint and score it -> the record appended to
    WORKDIR/eval_results.jsonl (module docstring); `write=False` writes nothing. `split` is
    'validation', 'test' or any split name; `limit` keeps the first N examples. A
    multilingual checkpoint needs `direction` ('de-fr'); `pivot` ('en') translates through
    that language. `source_lang`/`target_lang`: an imported M2M100/NLLB model's languages.
    `profile`: decode once more under jax.profiler, into WORKDIR/tensorboard."""
    start = time.time() if start is None else start
    trace = loaded.workdir / "tensorboard" if profile else None
    with compilation.CompileTimer() as compiled:
        langs = dict(source_lang=source_lang, target_lang=target_lang)
        data = _Split(loaded, split, limit, direction, **langs)
        record = _decode(
            loaded, data, beam_size, length_penalty, write=write, pivot=pivot, profile_dir=trace
        )
    record.update(_compile_fields(compiled), profile=str(trace) if trace else None)
    return _finish(record, start, write=write, sweep=False, workdir=loaded.workdir)


def _compile_fields(compiled: compilation.CompileTimer) -> dict[str, Any]:
    return {
        "compile_seconds": round(compiled.seconds, 3),
        "compiled_programs": compiled.programs,
        "compile_cache_hits": compiled.cache_hits,
    }


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
    loaded = load(workdir, checkpoint, step, average_last, overrides)
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
    length_penalties: Sequence[float] = SWEEP_LENGTH_PENALTIES,
    limit: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    write: bool = True,
    direction: str | None = None,
    source_lang: str | None = None,
    target_lang: str | None = None,
) -> dict[str, Any]:
    """Decode `split` for every beam size x length penalty (greedy once) -> {'best': record,
    'points': [record, ...]}; the best is the highest BLEU, ties going to the smaller beam,
    then the smaller length penalty. Other arguments as `evaluate`'s."""
    start = time.time()
    loaded = load(workdir, checkpoint, step, average_last, overrides)
    langs = dict(source_lang=source_lang, target_lang=target_lang)
    data = _Split(loaded, split, limit, direction, **langs)
    points = []
    for beam in sorted(set(beams)):
        for length_penalty in sorted(set(length_penalties)) if beam > 1 else [None]:
            with compilation.CompileTimer() as compiled:
                record = _decode(loaded, data, beam, length_penalty or 0.0, write=write)
            record.update(_compile_fields(compiled))
            points.append(_finish(record, start, write=write, sweep=True, workdir=loaded.workdir))
    best = points[int(np.argmax([p["bleu"] for p in points]))]
    return {"best": best, "points": points}


def sweep_table(points: Sequence[Mapping[str, Any]]) -> str:
    """BLEU as a grid: a row per beam size, a column per length penalty (greedy: every one)."""
    penalties = sorted({p["length_penalty"] for p in points} - {None}) or [None]
    lines = [
        "beam \\ penalty " + "".join(f"{a:>8g}" if a is not None else "       -" for a in penalties)
    ]
    for beam in sorted({p["beam"] for p in points}):
        row = {p["length_penalty"]: p["bleu"] for p in points if p["beam"] == beam}
        cells = [row.get(a, row.get(None, float("nan"))) for a in penalties]
        lines.append(f"{beam:>14} " + "".join(f"{c:>8.2f}" for c in cells))
    return "\n".join(lines)
