"""Translate stdin to stdout with a checkpoint: output line i translates input line i.

    python -m tx_jax.translate --workdir=runs/default < source.txt > hypotheses.txt
    python -m tx_jax.translate --workdir=runs/default --average_last=5 --beam_size=4 \
        --alpha=0.6 --batch_size=64 < source.txt
    python -m tx_jax.translate --checkpoint=runs/default/averaged/last5/600 < source.txt
    python -m tx_jax.translate --workdir=runs/multi --target_lang=fr [--pivot=en] < de.txt

Parameters, tokenizer and model config come from the checkpoint (restore.py); no dataset
is read or prepared. Lines are split on '\\n' (a trailing '\\r' is dropped), decoded as UTF-8
with invalid bytes replaced (U+FFFD), and translated in batches of --batch_size sources,
each padded to the checkpoint's data.max_eval_len tokens as evaluate.py pads them (so the
same line gets the same translation). An empty or whitespace-only line gives an empty line;
a line longer than that (EOS included) is truncated, with a warning on stderr. Progress and
warnings go to stderr, translations alone to stdout.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import BinaryIO

from absl import app, flags

from tx_jax import evaluate, evaluation, restore
from tx_jax.data import eval_pipeline

CHUNK_BATCHES = 8  # batches encoded and decoded between progress reports


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


def max_source_len(loaded: restore.Loaded) -> int:
    """Source tokens per line (EOS included): the eval length, capped by a learned
    position table."""
    n = loaded.config.data.max_eval_len
    if loaded.model_config.positional == "learned":
        n = min(n, loaded.model_config.max_len)
    return n


def _warn_truncated(loaded, lines, indices, max_len, warn, extra: int = 0) -> None:
    cap = max_len * loaded.tokenizer.max_piece_chars * 4  # the pipeline's character bound
    n = lambda i: len(loaded.tokenizer.encode(lines[i][:cap])) + 1 + extra  # EOS, prefix
    long = [i for i in indices if n(i) > max_len]
    for i in long[:5]:
        warn(f"warning: line {i + 1} is longer than {max_len} tokens; truncated")
    if len(long) > 5:
        warn(f"warning: {len(long)} lines in all were truncated to {max_len} tokens")


def translate_lines(
    loaded: restore.Loaded,
    lines: Sequence[str | bytes],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    batch_size: int = 64,
    max_len: int | None = None,
    sort_by_length: bool = True,
    warn: Callable[[str], None] = _stderr,
    progress: Callable[[int, int], None] | None = None,
    source_prefix: Sequence[int] = (),
) -> list[str]:
    """Translations of `lines`, aligned: one output per input, '' for blank inputs.

    Sources are truncated to `max_len` tokens (default `max_source_len`); `progress(done,
    total)` is called after every chunk of CHUNK_BATCHES batches. `source_prefix`: ids before
    every source, e.g. a multilingual model's target-language tag (multilingual.py)."""
    max_len = max_len or max_source_len(loaded)
    texts = [x.decode("utf-8", errors="replace") if isinstance(x, bytes) else x for x in lines]
    todo = [i for i, t in enumerate(texts) if t.strip()]
    _warn_truncated(loaded, texts, todo, max_len, warn, len(source_prefix))
    out = [""] * len(texts)
    chunk = batch_size * CHUNK_BATCHES
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        batches = eval_pipeline.encode_sources(
            [texts[i] for i in part], loaded.tokenizer, max_len=max_len, batch_size=batch_size,
            bucket_boundaries=[max_len], sort_by_length=sort_by_length,
            source_prefix=source_prefix,
        )  # fmt: skip
        hyps = evaluation.translate_batches(
            loaded.model_config, loaded.params, batches, loaded.tokenizer, len(part),
            beam_size=beam_size, alpha=alpha,
        )  # fmt: skip
        for i, hyp in zip(part, hyps):
            out[i] = " ".join(hyp.splitlines())
        if progress is not None:
            progress(min(start + chunk, len(todo)), len(todo))
    return out


def translate(
    lines: Sequence[str | bytes],
    workdir: str | None = None,
    *,
    checkpoint: str | None = None,
    step: int | None = None,
    average_last: int | None = None,
    overrides: dict | None = None,
    **kwargs,
) -> list[str]:
    """Load a checkpoint (restore.load's arguments) and translate `lines` (translate_lines'
    keyword arguments)."""
    loaded = restore.load(workdir, checkpoint=checkpoint, step=step, average_last=average_last,
                          overrides=overrides)  # fmt: skip
    return translate_lines(loaded, lines, **kwargs)


def _main(argv: list[str], overrides: dict[str, str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]} (sources come on stdin)")
    f = flags.FLAGS
    if f.workdir is None and f.checkpoint is None:
        raise app.UsageError("give --workdir (or --checkpoint)")
    start = time.time()
    loaded = restore.load(f.workdir, checkpoint=f.checkpoint, step=f.step,
                          average_last=f.average_last, overrides=overrides)  # fmt: skip
    _stderr(f"translate: {loaded.path} (step {loaded.step}), beam {f.beam_size}")
    lines = read_lines(sys.stdin.buffer)

    def progress(done: int, total: int) -> None:
        _stderr(f"translate: {done}/{total} lines, {time.time() - start:.1f} s")

    kwargs = dict(beam_size=f.beam_size, alpha=f.alpha, batch_size=f.batch_size,
                  max_len=f.max_len, progress=progress)  # fmt: skip
    if f.target_lang:  # a multilingual model: tag the sources (through a pivot if asked)
        from tx_jax import multilingual

        out = multilingual.translate_to(loaded, lines, f.target_lang, pivot=f.pivot, **kwargs)
    elif f.pivot:
        raise app.UsageError("--pivot needs --target_lang (a multilingual checkpoint)")
    elif loaded.config.data.get("directions"):
        raise app.UsageError(f"{loaded.path} is multilingual: give --target_lang (e.g. "
                             f"{loaded.config.data.target_lang})")  # fmt: skip
    else:
        out = translate_lines(loaded, lines, **kwargs)
    sys.stdout.buffer.write("".join(line + "\n" for line in out).encode("utf-8"))
    sys.stdout.flush()


def main() -> None:
    evaluate.define_checkpoint_flags()
    flags.DEFINE_integer("beam_size", 4, "Beam size; 1 is greedy (paper: 4).")
    flags.DEFINE_float("alpha", 0.6, "GNMT length penalty alpha (paper: 0.6).")
    flags.DEFINE_integer("batch_size", 64, "Source lines per decoding batch.")
    flags.DEFINE_integer("max_len", None, "Truncate sources to this many tokens "
                         "(default: the checkpoint's data.max_eval_len).")  # fmt: skip
    flags.DEFINE_string("target_lang", None, "Multilingual checkpoints: translate into this "
                        "language (its <2xx> tag goes before each source).")  # fmt: skip
    flags.DEFINE_string("pivot", None, "With --target_lang: translate into this language "
                        "first, then from it (e.g. en).")  # fmt: skip
    evaluate.run_cli(_main)


if __name__ == "__main__":
    main()
