r"""`tx_jax generate`: sample continuations of prompts from a language-model checkpoint.

    tx_jax generate --workdir=DIR [--step=N] --prompt="the cat" \
        [--num_samples=4 --max_new_tokens=64 --temperature=0.8 --top_k=0 --top_p=0.95 \
         --seed=0] [--json]
    tx_jax generate --workdir=DIR < prompts.txt      (one prompt per line)

Output: one line per sample, `num_samples` lines per prompt in prompt order; with --json,
one JSON object per line (prompt, sample, text, tokens, finished). inference.generation
has the details.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

import jax
from absl import flags

from tx_jax.inference import restore
from tx_jax.inference.generation import Sample, generate


def _flags() -> flags.FlagValues:
    """The CLI's flags, on their own FlagValues: importing this module defines no global
    flag (so it never clashes with cli/train.py, cli/evaluate.py or cli/translate.py)."""
    fv = flags.FlagValues()
    flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/.", flag_values=fv)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).", flag_values=fv)
    flags.DEFINE_string(
        "prompt",
        None,
        "The prompt; without it, prompts are read from stdin, one per line.",
        flag_values=fv,
    )
    flags.DEFINE_integer("num_samples", 4, "Samples per prompt.", flag_values=fv)
    flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated after the prompt.", flag_values=fv)
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 is greedy.", flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "Sample among the k best tokens (0: off).", flag_values=fv)
    flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass (1.0: off).", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Prompt i uses fold_in(key(seed), i).", flag_values=fv)
    flags.DEFINE_bool("json", False, "Print one JSON object per sample.", flag_values=fv)
    flags.mark_flag_as_required("workdir", flag_values=fv)
    return fv


def _format(sample: Sample, as_json: bool) -> str:
    if as_json:
        return json.dumps(dataclasses.asdict(sample), ensure_ascii=False)
    return " ".join(sample.text.split())  # one line per sample, whatever the text holds


def run(fv: flags.FlagValues, prompts: Iterable[str], out: TextIO | None = None) -> int:
    """Load the checkpoint, then generate and print prompt by prompt; returns the number of
    prompts (each prompt is its own batch, so lines stream as stdin arrives)."""
    out = sys.stdout if out is None else out
    loaded = restore.load(fv.workdir, step=fv.step, task="lm")
    base = jax.random.key(fv.seed)
    count = 0
    for i, prompt in enumerate(prompts):
        (samples,) = generate(
            loaded.model_config,
            loaded.params,
            loaded.tokenizer,
            [prompt],
            rng=jax.random.fold_in(base, i),
            num_samples=fv.num_samples,
            max_new_tokens=fv.max_new_tokens,
            temperature=fv.temperature,
            top_k=fv.top_k,
            top_p=fv.top_p,
        )
        for sample in samples:
            print(_format(sample, fv.json), file=out, flush=True)
        count += 1
    return count


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status (2: bad usage)."""
    argv = list(sys.argv if argv is None else argv)
    fv = _flags()
    if {"-h", "--help", "-help"} & set(argv[1:]):
        print(f"{__doc__}\n{fv.get_help()}")
        return 0
    try:
        rest = fv(argv)
        if len(rest) > 1:
            raise ValueError(f"unexpected arguments {rest[1:]}")
        prompts: Iterable[str] = [fv.prompt]
        if fv.prompt is None:
            prompts = (line.rstrip("\r\n") for line in sys.stdin)
        run(fv, prompts)
    except (flags.Error, ValueError, FileNotFoundError) as e:
        print(f"error: {e}\n(--help lists the flags)", file=sys.stderr)
        return 2
    return 0
