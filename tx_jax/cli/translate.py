"""Translate stdin to stdout with a checkpoint: output line i translates input line i.

    python -m tx_jax.translate --workdir=runs/default < source.txt > hypotheses.txt
    python -m tx_jax.translate --workdir=runs/default --average_last=5 --beam_size=4 \
        --alpha=0.6 --batch_size=64 < source.txt
    python -m tx_jax.translate --checkpoint=runs/default/averaged/last5/600 < source.txt
    python -m tx_jax.translate --workdir=runs/multi --target_lang=fr [--pivot=en] < de.txt
    python -m tx_jax.translate --workdir=runs/nllb --source_lang=eng_Latn --target_lang=deu_Latn

Parameters, tokenizer and model config come from the checkpoint (inference/restore.py); no
dataset is read or prepared. Lines are split on '\\n' (a trailing '\\r' is dropped), decoded
as UTF-8 with invalid bytes replaced (U+FFFD), and translated in batches of --batch_size
sources, each padded to the checkpoint's data.max_eval_len tokens as evaluation pads them (so
the same line gets the same translation). An empty or whitespace-only line gives an empty
line; a line longer than that (EOS included) is truncated, with a warning on stderr. Progress
and warnings go to stderr, translations alone to stdout.
"""

from __future__ import annotations

import sys
import time
from typing import BinaryIO

from absl import app, flags

from tx_jax.cli import common
from tx_jax.inference import languages, restore
from tx_jax.inference.translation import translate_lines


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def read_lines(stream: BinaryIO) -> list[str]:
    """Lines of a byte stream as text: split on b'\\n', '\\r' before it dropped, invalid
    UTF-8 replaced; a final newline does not start another line."""
    data = stream.read()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line.removesuffix(b"\r").decode("utf-8", errors="replace") for line in lines]


def _main(argv: list[str], overrides: dict[str, str]) -> None:
    where = common.checkpoint_args(argv, " (sources come on stdin)")
    f = flags.FLAGS
    start = time.time()
    loaded = restore.load(f.workdir, **where, overrides=overrides)
    _stderr(f"translate: {loaded.path} (step {loaded.step}), beam {f.beam_size}")
    lines = read_lines(sys.stdin.buffer)

    def progress(done: int, total: int) -> None:
        _stderr(f"translate: {done}/{total} lines, {time.time() - start:.1f} s")

    kwargs = dict(
        beam_size=f.beam_size,
        alpha=f.alpha,
        batch_size=f.batch_size,
        max_len=f.max_len,
        progress=progress,
        length_buckets=None if f.length_buckets is None else [int(x) for x in f.length_buckets],
    )
    if f.length_penalty != "gnmt":
        kwargs["length_penalty"] = f.length_penalty
    if languages.is_imported(loaded.tokenizer):  # M2M100/NLLB, multi-target OPUS-MT
        if f.pivot:
            raise app.UsageError("--pivot is for tx_jax's multilingual runs")
        source, target = languages.prefixes(loaded, f.source_lang, f.target_lang)
        out = translate_lines(loaded, lines, source_prefix=source, target_prefix=target, **kwargs)
    elif f.target_lang:  # a multilingual model: tag the sources (through a pivot if asked)
        from tx_jax.inference import multilingual

        out = multilingual.translate_to(loaded, lines, f.target_lang, pivot=f.pivot, **kwargs)
    elif f.pivot:
        raise app.UsageError("--pivot needs --target_lang (a multilingual checkpoint)")
    elif loaded.config.data.get("directions"):
        raise app.UsageError(
            f"{loaded.path} is multilingual: give --target_lang (e.g. "
            f"{loaded.config.data.target_lang})"
        )
    else:
        out = translate_lines(loaded, lines, **kwargs)
    sys.stdout.buffer.write("".join(line + "\n" for line in out).encode("utf-8"))
    sys.stdout.flush()


def main() -> None:
    common.define_checkpoint_flags()
    flags.DEFINE_integer("beam_size", 4, "Beam size; 1 is greedy (paper: 4).")
    flags.DEFINE_float("alpha", 0.6, "GNMT length penalty alpha (paper: 0.6).")
    flags.DEFINE_integer(
        "batch_size", None, "Source lines per decoding batch (default: data.eval_batch_size)."
    )
    flags.DEFINE_integer(
        "max_len",
        None,
        "Truncate sources to this many tokens (default: the checkpoint's data.max_eval_len).",
    )
    flags.DEFINE_list(
        "length_buckets",
        None,
        "Pad each batch to the smallest of these lengths that holds it (e.g. 16,32,64; "
        "default: the checkpoint's eval buckets, 16, 24, 40, 64, ... up to "
        "data.max_eval_len). Shapes to compile, not translations: those do not depend on it.",
    )
    flags.DEFINE_string(
        "target_lang",
        None,
        "Multilingual checkpoints: translate into this language (its <2xx> tag goes before "
        "each source); imported M2M100/NLLB (forced first token) and multi-target OPUS-MT "
        "(>>xx<< before the source): the target (default: the tokenizer config's).",
    )
    flags.DEFINE_string(
        "source_lang", None, "Imported M2M100/NLLB: the sources' language (default: its config's)."
    )
    flags.DEFINE_enum(
        "length_penalty",
        "gnmt",
        ["gnmt", "fairseq"],
        "Beam search divides log p by ((5 + length) / 6)^alpha (gnmt) or length^alpha "
        "(fairseq: Transformers' and CTranslate2's).",
    )
    flags.DEFINE_string(
        "pivot",
        None,
        "With --target_lang: translate into this language first, then from it (e.g. en).",
    )
    common.run_cli(_main)


if __name__ == "__main__":
    main()
