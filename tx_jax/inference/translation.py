"""Translating lines of text with a loaded checkpoint, in batches, aligned line for line.

Sources are encoded as the evaluation pipeline encodes them, and a translation depends only
on its own source (decoding.output_limits), so a line gets the same translation here and in
evaluation; a line longer than data.max_eval_len tokens is truncated, with a warning.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

import numpy as np

from tx_jax.data import eval_pipeline
from tx_jax.inference import likelihood, quality, restore

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


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One output for a line: its text (one line), and with scores=True the model's
    ln p(output ids | source ids) and how many ids that counts (likelihood.score_ids)."""

    text: str
    logprob: float | None = None
    tokens: int | None = None


def translate_lines(loaded: restore.Loaded, lines: Sequence[str | bytes], **kwargs) -> list[str]:
    """Translations of `lines`, aligned: one output per input, '' for blank inputs
    (`decode_lines`' best or only hypothesis of each line; its keyword arguments)."""
    return [hyps[0].text if hyps else "" for hyps in decode_lines(loaded, lines, **kwargs)]


def decode_lines(
    loaded: restore.Loaded,
    lines: Sequence[str | bytes],
    *,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    batch_size: int | None = None,
    max_len: int | None = None,
    sort_by_length: bool = True,
    warn: Callable[[str], None] = _stderr,
    progress: Callable[[int, int], None] | None = None,
    source_prefix: Sequence[int] = (),
    target_prefix: Sequence[int] = (),
    length_penalty_kind: str = "gnmt",
    length_buckets: Sequence[int] | None = None,
    nbest: int = 1,
    sampling: quality.Sampling | None = None,
    line_ids: Sequence[int] | None = None,
    scores: bool = False,
    line_name: Callable[[int], str] | None = None,
) -> list[list[Hypothesis]]:
    """Each line's hypotheses, aligned with `lines`: `nbest` of them (best first for beam search,
    sample 0, 1, ... with `sampling`), none for a blank line. `batch_size` defaults to
    data.eval_batch_size, `max_len` (source tokens) to `max_source_len`; `progress(done, total)`
    is called after every chunk of CHUNK_BATCHES batches. `source_prefix`: ids before every
    source (a multilingual model's tag); `target_prefix`: forced first output ids (an
    M2M100/NLLB language token: languages.py). `sampling` samples instead of searching, line i's
    k-th sample from (seed, line_ids[i], k). `scores`: each hypothesis' log-probability.
    `line_name(i)`: how warnings name line i. `length_buckets`: the lengths batches are padded
    to (default evaluation's). The outputs depend on none of `length_buckets`, `batch_size` or
    `sort_by_length`."""
    if nbest < 1:
        raise ValueError(f"nbest={nbest}: expected >= 1")
    max_len = max_len or max_source_len(loaded)
    batch_size = batch_size or loaded.config.data.eval_batch_size
    buckets = _buckets(loaded, length_buckets, max_len)
    texts = [x.decode("utf-8", errors="replace") if isinstance(x, bytes) else x for x in lines]
    line_ids = _line_ids(line_ids, len(texts))
    todo = _decoding_order(loaded, texts, max_len, source_prefix, sort_by_length, warn, line_name)
    # A sampled line is decoded once per sample, each a row of its own; a search's n-best
    # come from one row.
    copies = nbest if sampling is not None else 1
    examples = [(i, k) for i in todo for k in range(copies)]
    out: list[list[Hypothesis]] = [[] for _ in texts]
    chunk = batch_size * CHUNK_BATCHES
    for start in range(0, len(examples), chunk):
        part = examples[start : start + chunk]
        hypotheses = _decode_chunk(
            loaded,
            texts,
            part,
            line_ids,
            max_len=max_len,
            batch_size=batch_size,
            buckets=buckets,
            sort_by_length=sort_by_length,
            source_prefix=source_prefix,
            target_prefix=target_prefix,
            beam_size=beam_size,
            length_penalty=length_penalty,
            length_penalty_kind=length_penalty_kind,
            nbest=nbest,
            sampling=sampling,
            scores=scores,
        )
        for (i, _), hyps in zip(part, hypotheses):
            out[i].extend(hyps)
        if progress is not None:
            progress(min(start + chunk, len(examples)) // copies, len(todo))
    return out


def _buckets(
    loaded: restore.Loaded, length_buckets: Sequence[int] | None, max_len: int
) -> list[int]:
    """The lengths batches are padded to, ascending, max_len last."""
    if length_buckets is None:
        configured = loaded.config.data.get("eval_bucket_boundaries")
        length_buckets = configured or eval_pipeline.eval_bucket_boundaries(max_len)
    return sorted({int(b) for b in length_buckets if 0 < int(b) < max_len}) + [max_len]


def _line_ids(line_ids: Sequence[int] | None, count: int) -> Sequence[int]:
    """`line_ids` (default 0, 1, ...: the lines' positions), checked to be one per line."""
    line_ids = range(count) if line_ids is None else line_ids
    if len(line_ids) != count:
        raise ValueError(f"{len(line_ids)} line ids for {count} lines")
    return line_ids


def _decoding_order(
    loaded: restore.Loaded,
    texts: Sequence[str],
    max_len: int,
    source_prefix: Sequence[int],
    sort_by_length: bool,
    warn: Callable[[str], None],
    line_name: Callable[[int], str] | None,
) -> list[int]:
    """The non-blank lines' indices, in decoding order; warns of each line over max_len."""
    todo = [i for i, t in enumerate(texts) if t.strip()]
    cap = max_len * loaded.tokenizer.max_piece_chars * 4  # the pipeline's character bound
    # Source tokens before truncation, EOS and prefix included.
    extra = 1 + len(source_prefix)
    lengths = {i: len(loaded.tokenizer.encode(texts[i][:cap])) + extra for i in todo}
    long = [i for i in todo if lengths[i] > max_len]
    for i in long[:5]:
        where = line_name(i) if line_name else f"line {i + 1}"
        warn(f"warning: {where} is longer than {max_len} tokens; truncated")
    if len(long) > 5:
        warn(f"warning: {len(long)} lines in all were truncated to {max_len} tokens")
    if sort_by_length:  # longest first over all lines, then chunks: batches of like lengths
        todo.sort(key=lambda i: -min(lengths[i], max_len))
    return todo


def _decode_chunk(
    loaded: restore.Loaded,
    texts: Sequence[str],
    part: Sequence[tuple[int, int]],
    line_ids: Sequence[int],
    *,
    max_len: int,
    batch_size: int,
    buckets: Sequence[int],
    sort_by_length: bool,
    source_prefix: Sequence[int],
    target_prefix: Sequence[int],
    beam_size: int,
    length_penalty: float,
    length_penalty_kind: str,
    nbest: int,
    sampling: quality.Sampling | None,
    scores: bool,
) -> list[list[Hypothesis]]:
    """The hypotheses of each example (line i, sample k) of `part` (`decode_lines`' arguments)."""
    batches = eval_pipeline.encode_sources(
        [texts[i] for i, _ in part],
        loaded.tokenizer,
        max_len=max_len,
        batch_size=batch_size,
        bucket_boundaries=buckets,
        sort_by_length=sort_by_length,
        source_prefix=source_prefix,
    )
    if sampling is not None:
        keys = np.array([(line_ids[i], k) for i, k in part], np.int32).reshape(-1, 2)
        batches = [_with_keys(b, keys) for b in batches]
    decoded = quality.decode_batches(
        loaded.model_config,
        loaded.params,
        batches,
        loaded.tokenizer.eos_id,
        len(part),
        beam_size=1 if sampling is not None else beam_size,
        length_penalty=length_penalty,
        target_prefix=target_prefix,
        length_penalty_kind=length_penalty_kind,
        nbest=1 if sampling is not None else nbest,
        sampling=sampling,
    )
    return _hypotheses(
        loaded, decoded, scores=scores, skip=len(target_prefix), batch_size=batch_size
    )


def _with_keys(batch: dict[str, np.ndarray], keys: np.ndarray) -> dict[str, np.ndarray]:
    """The batch with 'sample_key' [B, 2]: each row's (line id, sample number); padding
    rows get (0, 0), which decode nothing."""
    index = np.where(batch["example_mask"] > 0, batch["example_index"], 0)
    sample_key = np.where(batch["example_mask"][:, None] > 0, keys[index], 0)
    return {**batch, "sample_key": sample_key.astype(np.int32)}


def _hypotheses(
    loaded: restore.Loaded,
    decoded: list[tuple[np.ndarray, list[np.ndarray]]],
    *,
    scores: bool,
    skip: int,
    batch_size: int,
) -> list[list[Hypothesis]]:
    """Each example's Hypothesis list from `quality.decode_batches`' output: each text on one
    line and, with `scores`, its log-probability (likelihood.score_ids, `skip` forced ids
    left out)."""
    found = [(source, ids) for source, hyps in decoded for ids in hyps]
    scored = (
        likelihood.score_ids(loaded, found, skip=skip, batch_size=batch_size)
        if scores
        else [None] * len(found)
    )
    in_order = iter(scored)  # `found`'s order: example by example
    return [[_hypothesis(loaded, ids, next(in_order)) for ids in hyps] for _, hyps in decoded]


def _hypothesis(loaded: restore.Loaded, ids: np.ndarray, score) -> Hypothesis:
    """Output ids [T'] and their likelihood.score_ids score (or None) -> a Hypothesis."""
    text = " ".join(loaded.tokenizer.decode(ids.tolist()).splitlines())
    if score is None:
        return Hypothesis(text)
    return Hypothesis(text, score.logprob, score.tokens)


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
