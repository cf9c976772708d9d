"""Score given translations: one line per pair, ln p(target | source) and its token count.

    tx_jax score --workdir=runs/default --source=src.txt --target=hyp.txt > scores.tsv
    tx_jax score --workdir=runs/opus-mt-en-de --source=en.txt --target=de.txt \
        [--target_lang=de] [--source_lang=en] [--batch_size=32] [--step=N | --average_last=K]

Output line i is `LOGPROB<TAB>TOKENS` for pair i (input order): the natural-log probability
of target line i's tokens and EOS given source line i, and how many tokens that is (EOS
included; a forced target-language token of M2M100/NLLB neither counted nor scored).
LOGPROB / TOKENS is the per-token score corpus filters use. Works on any translation workdir,
trained here or imported (tx_jax import). Lines are UTF-8 (invalid bytes replaced) and
scored whole, never truncated. Local or gs:// files.
"""

from __future__ import annotations

import io
import sys
import time

from absl import app, flags
from etils import epath

from tx_jax.cli import common
from tx_jax.cli.translate import read_lines
from tx_jax.inference import likelihood, restore


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _lines(path: str, flag: str) -> list[str]:
    p = epath.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--{flag}={path}: no such file")
    return read_lines(io.BytesIO(p.read_bytes()))


def _main(argv: list[str], overrides: dict[str, str]) -> None:
    where = common.checkpoint_args(argv)
    f = flags.FLAGS
    if not f.source or not f.target:
        raise app.UsageError("give --source and --target (files of the same number of lines)")
    sources, targets = _lines(f.source, "source"), _lines(f.target, "target")
    if len(sources) != len(targets):
        raise ValueError(
            f"--source={f.source} has {len(sources)} lines but --target={f.target} has "
            f"{len(targets)}: line i of each is one pair"
        )
    start = time.time()
    loaded = restore.load(f.workdir, **where, overrides=overrides, task="translation")
    _stderr(f"score: {loaded.path} (step {loaded.step}), {len(sources)} pairs")

    def progress(done: int, total: int) -> None:
        _stderr(f"score: {done}/{total} pairs, {time.time() - start:.1f} s")

    scores = likelihood.score_pairs(
        loaded,
        sources,
        targets,
        source_lang=f.source_lang,
        target_lang=f.target_lang,
        batch_size=f.batch_size,
        progress=progress,
    )
    out = "".join(f"{s.logprob:.6f}\t{s.tokens}\n" for s in scores)
    sys.stdout.buffer.write(out.encode("utf-8"))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    common.define_checkpoint_flags()
    flags.DEFINE_string("source", None, "Source sentences, one per line (local or gs://).")
    flags.DEFINE_string("target", None, "Their translations, line i pairs with source line i.")
    flags.DEFINE_string(
        "target_lang",
        None,
        "The target's language: an imported M2M100/NLLB or multi-target Marian model's "
        "language token, a multilingual run's <2xx> tag (default: the checkpoint's).",
    )
    flags.DEFINE_string(
        "source_lang", None, "The source's language (M2M100/NLLB; default: the checkpoint's)."
    )
    flags.DEFINE_integer("batch_size", 32, "Pairs per forward pass.")
    common.run_cli(_main, argv)
