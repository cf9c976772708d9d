"""`tx_jax visualize attention | curves`: attention heatmaps and training curves (PNG).

analysis.visualize has the functions and the details.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Sequence

from absl import flags

from tx_jax.analysis.visualize import (
    KINDS,
    X_AXES,
    attention_maps,
    plot_attention,
    plot_curves,
)
from tx_jax.inference import restore

USAGE = """usage:
  tx_jax visualize attention --workdir=DIR [--step=N] --source="..." [--target="..."]
      --out=DIR_PNG [--kinds=cross,encoder,decoder] [--noaverage_heads]
  tx_jax visualize curves --metrics=A/metrics.jsonl[,B/metrics.jsonl] --out=x.png
      [--keys=loss,bleu] [--labels=a,b] [--x=step|elapsed|train_seconds]"""


def _flags() -> flags.FlagValues:
    """The CLI's flags on their own FlagValues (importing this module defines no global flag)."""
    fv = flags.FlagValues()
    define = dict(flag_values=fv)
    flags.DEFINE_string("workdir", None, "attention: run directory holding checkpoints/.", **define)
    flags.DEFINE_integer("step", None, "attention: checkpoint step (default: latest).", **define)
    flags.DEFINE_string("source", None, "attention: the source sentence.", **define)
    flags.DEFINE_string("target", None, "attention: the target (default: greedy).", **define)
    flags.DEFINE_list("kinds", list(KINDS), "attention: kinds to plot.", **define)
    flags.DEFINE_bool("average_heads", True, "attention: also plot the head mean.", **define)
    flags.DEFINE_list("metrics", None, "curves: metrics.jsonl files.", **define)
    flags.DEFINE_list("keys", ["loss", "bleu"], "curves: metrics to plot.", **define)
    flags.DEFINE_list("labels", None, "curves: one label per file.", **define)
    flags.DEFINE_enum("x", "step", list(X_AXES), "curves: x axis.", **define)
    flags.DEFINE_string("out", None, "attention: PNG directory; curves: PNG file.", **define)
    return fv


def _attention_command(fv: flags.FlagValues) -> list[pathlib.Path]:
    if fv.workdir is None or fv.source is None:
        raise ValueError("attention needs --workdir and --source")
    loaded = restore.load(fv.workdir, step=fv.step, task="translation")
    maps = attention_maps(
        loaded.model_config, loaded.params, loaded.tokenizer, fv.source, fv.target
    )
    print(f"checkpoint: {fv.workdir} step {loaded.step}")
    print(f"source: {maps['source']}\ntarget: {maps['target']}")
    return plot_attention(maps, fv.out, kinds=fv.kinds, average_heads=fv.average_heads)


def main(argv: Sequence[str] | None = None) -> int:
    """`attention` or `curves` (see the module docstring); prints the PNG paths written."""
    argv = list(sys.argv if argv is None else argv)
    fv = _flags()
    if {"-h", "--help", "-help"} & set(argv[1:]):
        print(f"{USAGE}\n\n{fv.get_help()}")
        return 0
    try:
        rest = fv(argv)
    except flags.Error as e:
        print(f"error: {e}\n{USAGE}", file=sys.stderr)
        return 2
    command = rest[1] if len(rest) == 2 else None
    if command not in ("attention", "curves") or fv.out is None:
        print(f"error: expected one command and --out, got {rest[1:]}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        if command == "attention":
            paths = _attention_command(fv)
        else:
            if not fv.metrics:
                raise ValueError("curves needs --metrics")
            paths = [plot_curves(fv.metrics, fv.out, keys=fv.keys, labels=fv.labels, x=fv.x)]
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}\n{USAGE}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
