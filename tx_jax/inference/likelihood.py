"""The log-probability a translation model gives a target for its source (teacher forcing).

    scores = likelihood.score_pairs(loaded, sources, targets, target_lang="de")
    scores[i].logprob, scores[i].tokens   ln p(target_i + EOS | source_i), its token count

What fairseq's --score-reference and CTranslate2's score_batch give, used to filter corpora.
A forced prefix (an M2M100/NLLB language token) is fed but not scored. Pairs are sorted by
length and padded to a few shapes; the scores come back in input order. No truncation (a
pair longer than a learned position table is an error naming the line).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tx_jax.data.features import clean_text
from tx_jax.inference import languages
from tx_jax.model import ModelConfig, make_model

PAD_TO = 16  # lengths are padded to a multiple of this: few shapes, little padding


@dataclasses.dataclass(frozen=True)
class PairScore:
    logprob: float  # natural log of p(target tokens and EOS | source)
    tokens: int  # how many tokens that counts (EOS included, a forced prefix not)


@functools.partial(jax.jit, static_argnames=("config",))
def _sums(config: ModelConfig, params: Any, inputs, targets, weights):
    """[B, S], [B, L], [B, L] -> (sum of weighted target log-probabilities [B], counts [B])."""
    logits = make_model(config).apply({"params": params}, inputs, targets)  # float32
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return (picked * weights).sum(axis=1), weights.sum(axis=1)


def _padded(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), np.int32)
    for r, ids in enumerate(rows):
        out[r, : len(ids)] = ids
    return out


def _round_up(n: int) -> int:
    return -(-n // PAD_TO) * PAD_TO


def encode_pairs(loaded, sources, targets, source_prefix, target_prefix):
    """(source ids with EOS, target ids with EOS, forced prefix length) per pair."""
    tok = loaded.tokenizer
    out = []
    for i, (s, t) in enumerate(zip(sources, targets, strict=True)):
        src = [*source_prefix, *tok.encode(clean_text(s)[0]), tok.eos_id]
        tgt = [*target_prefix, *tok.encode_target(clean_text(t)[0]), tok.eos_id]
        cfg = loaded.model_config
        if cfg.positional == "learned" and max(len(src), len(tgt)) > cfg.max_len:
            raise ValueError(
                f"line {i + 1}: {max(len(src), len(tgt))} tokens, more than the model's "
                f"learned positions (model.max_len={cfg.max_len})"
            )
        out.append((src, tgt))
    return out


def score_pairs(
    loaded,
    sources: Sequence[str | bytes],
    targets: Sequence[str | bytes],
    *,
    source_lang: str | None = None,
    target_lang: str | None = None,
    batch_size: int = 32,
    progress=None,
) -> list[PairScore]:
    """One PairScore per (source, target), in input order (see the module docstring)."""
    if len(sources) != len(targets):
        raise ValueError(
            f"{len(sources)} sources but {len(targets)} targets: pair them line by line"
        )
    if loaded.task != "translation":
        raise ValueError(f"{loaded.path} holds a {loaded.task!r} model; scoring needs translation")
    src_prefix, tgt_prefix = languages.prefixes(loaded, source_lang, target_lang)
    pairs = encode_pairs(loaded, sources, targets, src_prefix, tgt_prefix)
    return score_ids(loaded, pairs, skip=len(tgt_prefix), batch_size=batch_size, progress=progress)


def score_ids(
    loaded,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    skip: int = 0,
    batch_size: int = 32,
    progress=None,
) -> list[PairScore]:
    """One PairScore per (source ids, target ids) pair, in order: ln p(target | source) of
    the target's ids after its first `skip` (a forced prefix: fed, not scored); ids as the
    model reads them, EOS included."""
    params = nn.meta.unbox(loaded.params)
    config = loaded.model_config.replace(dropout_rate=0.0)
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][1]), len(pairs[i][0])))
    out: list[PairScore | None] = [None] * len(pairs)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        rows = [pairs[i] for i in chunk] + [pairs[chunk[-1]]] * (batch_size - len(chunk))
        inputs = _padded([s for s, _ in rows], _round_up(max(len(s) for s, _ in rows)))
        tgt = _padded([t for _, t in rows], _round_up(max(len(t) for _, t in rows)))
        weights = (tgt != 0).astype(np.float32)
        weights[:, :skip] = 0.0  # the forced prefix: fed, not scored
        sums, counts = jax.device_get(_sums(config, params, inputs, tgt, weights))
        for r, i in enumerate(chunk):
            out[i] = PairScore(float(sums[r]), int(counts[r]))
        if progress is not None:
            progress(min(start + batch_size, len(order)), len(order))
    return out  # type: ignore[return-value]
