"""`tx_jax evaluate`: flags -> inference.evaluation (its docstring has the details).

tx_jax evaluate --workdir=runs/default                  test split, beam 4, length penalty 0.6
tx_jax evaluate --workdir=runs/default --average_last=3
tx_jax evaluate --workdir=runs/default --sweep --beams=1,4 --length_penalties=0.6,1.0
tx_jax evaluate --workdir=runs/multi --direction=de-fr [--pivot=en]
tx_jax evaluate --workdir=runs/default --profile         where decoding's time goes
tx_jax evaluate --workdir=runs/m2m100 --config.data.dataset=multi30k --target_lang=de
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from tx_jax.cli import common as common_flags
from tx_jax.inference.evaluation import (
    SWEEP_BEAMS,
    SWEEP_LENGTH_PENALTIES,
    evaluate,
    evaluate_directions,
    result_line,
    sweep,
    sweep_table,
)


def _main(argv: list[str], overrides: dict[str, str]) -> None:
    common = common_flags.checkpoint_args(argv)
    f = flags.FLAGS
    common.update(limit=f.limit, overrides=overrides)
    langs = dict(source_lang=f.source_lang, target_lang=f.target_lang)
    if f.direction and (f.source_lang or f.target_lang):
        raise app.UsageError("--direction names a multilingual checkpoint's languages already")
    if f.pivot and not f.direction:
        raise app.UsageError("--pivot needs --direction (a multilingual checkpoint)")
    if f.direction == "all":
        if f.sweep:
            raise app.UsageError("--sweep takes one --direction")
        records = evaluate_directions(
            f.workdir,
            pivot=f.pivot,
            split=f.split,
            beam_size=f.beam_size,
            length_penalty=f.length_penalty,
            **common,
        )
        for record in records:
            print(result_line(record))
        print(
            f"mean BLEU over {len(records)} directions: {np.mean([r['bleu'] for r in records]):.2f}"
        )
        return
    common["direction"] = f.direction
    if f.sweep:
        if f.pivot:
            raise app.UsageError("--sweep decodes directly: no --pivot")
        split = f.split if f["split"].present else "validation"
        out = sweep(
            f.workdir,
            split=split,
            beams=[int(b) for b in f.beams],
            length_penalties=[float(a) for a in f.length_penalties],
            **langs,
            **common,
        )
        for point in out["points"]:
            print(result_line(point))
        print(sweep_table(out["points"]))
        best = out["best"]
        search = (
            "greedy"
            if best["length_penalty"] is None
            else f"beam {best['beam']} length penalty {best['length_penalty']:g}"
        )
        print(f"best: {search}, BLEU {best['bleu']:.2f}")
        return
    record = evaluate(
        f.workdir,
        split=f.split,
        beam_size=f.beam_size,
        length_penalty=f.length_penalty,
        pivot=f.pivot,
        profile=f.profile,
        **langs,
        **common,
    )
    print(result_line(record))
    print(f"hypotheses: {record['hypotheses']}")
    if record["profile"]:
        from tx_jax.analysis import trace_summary

        rows = trace_summary.top_ops(record["profile"])
        print(
            f"profile of the decode after compilation ({record['decode_seconds']:.2f} s, "
            f"time summed over threads): {record['profile']}"
        )
        print(trace_summary.format_rows(rows, wall=record["decode_seconds"]))


def main(argv: list[str] | None = None) -> None:
    common_flags.define_checkpoint_flags(search=True)
    flags.DEFINE_string("split", "test", "validation | test | any split name of the dataset.")
    flags.DEFINE_integer("limit", None, "Evaluate only the first N examples.")
    flags.DEFINE_bool(
        "sweep", False, "Decode the validation split over --beams x --length_penalties."
    )
    flags.DEFINE_bool(
        "profile",
        False,
        "Decode the split a second time under jax.profiler (into WORKDIR/tensorboard) and "
        "print the XLA operations that took the most time.",
    )
    flags.DEFINE_list("beams", [str(b) for b in SWEEP_BEAMS], "Sweep: beam sizes.")
    flags.DEFINE_list(
        "length_penalties", [str(a) for a in SWEEP_LENGTH_PENALTIES], "Sweep: length penalties."
    )
    flags.DEFINE_string(
        "direction",
        None,
        "Multilingual checkpoints: SRC-TGT (trained or "
        "zero-shot, e.g. de-fr) or 'all' (every trained direction).",
    )
    flags.DEFINE_string(
        "pivot",
        None,
        "With --direction: translate through this language "
        "(e.g. en): SRC -> pivot -> TGT with the same model.",
    )
    flags.DEFINE_string(
        "source_lang",
        None,
        "Imported M2M100/NLLB: the language token before each source (default: the "
        "checkpoint's data.source_lang; NLLB also takes two-letter codes, e.g. en).",
    )
    flags.DEFINE_string(
        "target_lang",
        None,
        "Imported M2M100/NLLB: the language token each hypothesis is forced to start with "
        "(default: data.target_lang); multi-target OPUS-MT: its >>xx<< source token. The "
        "references stay data.target_lang's (--config.data.target_lang picks them).",
    )
    common_flags.run_cli(_main, argv)
