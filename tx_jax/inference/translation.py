"""Translating lines of text with a loaded checkpoint, in batches, aligned line for line.

Sources are encoded as the evaluation pipeline encodes them (sorted by length, each batch
padded to the smallest of the checkpoint's eval buckets that holds it), and a translation
depends only on its own source (decoding.output_limits), so the same line gets the same
translation here and in evaluation; a line longer than data.max_eval_len tokens (EOS
included) is truncated, with a warning.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from tx_jax.data import eval_pipeline
from tx_jax.inference import restore, scoring

# Batches encoded and decoded between progress reports: few and large, since each chunk's tail
# runs on fewer threads than there are cores.
CHUNK_BATCHES = 64


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def max_source_len(loaded: restore.Loaded) -> int:
    """Source tokens per line (EOS included): the eval length, capped by a learned
    position table."""
    n = loaded.config.data.max_eval_len
    if loaded.model_config.positional == "learned":
        n = min(n, loaded.model_config.max_len)
    return n


def _source_lengths(loaded, lines, indices, max_len, extra: int = 0) -> dict[int, int]:
    """Each line's source tokens before truncation (EOS and `extra` prefix ids included)."""
    cap = max_len * loaded.tokenizer.max_piece_chars * 4  # the pipeline's character bound
    return {i: len(loaded.tokenizer.encode(lines[i][:cap])) + 1 + extra for i in indices}


def _warn_truncated(lengths: dict[int, int], max_len: int, warn) -> None:
    long = [i for i, n in lengths.items() if n > max_len]
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
    batch_size: int | None = None,
    max_len: int | None = None,
    sort_by_length: bool = True,
    warn: Callable[[str], None] = _stderr,
    progress: Callable[[int, int], None] | None = None,
    source_prefix: Sequence[int] = (),
    target_prefix: Sequence[int] = (),
    length_penalty: str = "gnmt",
    length_buckets: Sequence[int] | None = None,
) -> list[str]:
    """Translations of `lines`, aligned: one output per input, '' for blank inputs.

    `batch_size`: sentences per decoding batch (default the checkpoint's
    data.eval_batch_size). Sources are truncated to `max_len` tokens (default
    `max_source_len`); `progress(done, total)` is called after every chunk of CHUNK_BATCHES
    batches. `source_prefix`: ids before every source, e.g. a multilingual model's
    target-language tag (multilingual.py); `target_prefix`: ids each output is forced to
    start with (an M2M100/NLLB target-language token: inference/languages.py gives both).
    `length_penalty`: beam search's, 'gnmt' or 'fairseq' (Transformers' length^alpha).

    `length_buckets` (e.g. (16, 32, 64)): the lengths batches are padded to (each to the
    smallest that holds its longest source; max_len is always one), one compilation per
    length used; default: evaluation's (data.eval_bucket_boundaries, or 16, 24, 40, 64, ...).
    The translations do not depend on them, nor on `batch_size` or `sort_by_length`."""
    max_len = max_len or max_source_len(loaded)
    batch_size = batch_size or loaded.config.data.eval_batch_size
    if length_buckets is None:
        configured = loaded.config.data.get("eval_bucket_boundaries")
        length_buckets = configured or eval_pipeline.eval_bucket_boundaries(max_len)
    buckets = sorted({int(b) for b in length_buckets if 0 < int(b) < max_len}) + [max_len]
    texts = [x.decode("utf-8", errors="replace") if isinstance(x, bytes) else x for x in lines]
    todo = [i for i, t in enumerate(texts) if t.strip()]
    lengths = _source_lengths(loaded, texts, todo, max_len, len(source_prefix))
    _warn_truncated(lengths, max_len, warn)
    if sort_by_length:  # longest first over all lines, then chunks: batches of like lengths
        todo.sort(key=lambda i: -min(lengths[i], max_len))
    out = [""] * len(texts)
    chunk = batch_size * CHUNK_BATCHES
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        batches = eval_pipeline.encode_sources(
            [texts[i] for i in part],
            loaded.tokenizer,
            max_len=max_len,
            batch_size=batch_size,
            bucket_boundaries=buckets,
            sort_by_length=sort_by_length,
            source_prefix=source_prefix,
        )
        hyps = scoring.translate_batches(
            loaded.model_config,
            loaded.params,
            batches,
            loaded.tokenizer,
            len(part),
            beam_size=beam_size,
            alpha=alpha,
            target_prefix=target_prefix,
            length_penalty=length_penalty,
        )
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
    loaded = restore.load(
        workdir, checkpoint=checkpoint, step=step, average_last=average_last, overrides=overrides
    )
    return translate_lines(loaded, lines, **kwargs)
