"""Multilingual inference: translate into a language by its tag, directly or through a pivot.

    loaded = restore.load("runs/multi")                 a model trained with data.directions
    multilingual.translate_to(loaded, german, "fr")                zero-shot de -> fr (direct)
    multilingual.translate_to(loaded, german, "fr", pivot="en")    de -> en -> fr, same model
    multilingual.measure_direction(loaded, "de-fr", split="test", pivot="en")   sacreBLEU

A multilingual model reads [id of '<2xx>'] + source pieces + [EOS] and answers in language xx
(data/directions.py; Johnson et al., 2017). Any direction whose target language has a tag can
be asked for, trained or not: a model trained on en<->de and en<->fr translates de -> fr
"zero-shot" from the tag alone, or through English with two supervised passes ("pivot").
`tx_jax evaluate --workdir=runs/multi --direction=de-fr [--pivot=en]` and
`tx_jax translate --workdir=runs/multi --target_lang=fr [--pivot=en]` use these.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from tx_jax.data import directions, tasks
from tx_jax.data.tokenizer import Tokenizer
from tx_jax.inference import quality, restore, translation


def tag_prefix(tokenizer: Tokenizer, lang: str) -> list[int]:
    """[id of '<2lang>']: what goes before every source asked to be translated into `lang`;
    a ValueError when the tokenizer has no such piece (the model knows no such language)."""
    directions.check_tags(tokenizer, [lang], "this checkpoint")
    return [tokenizer.piece_to_id(directions.lang_tag(lang))]


def translate_to(
    loaded: restore.Loaded,
    sources: Sequence[str | bytes],
    target_lang: str,
    *,
    pivot: str | None = None,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    batch_size: int | None = None,
    **kwargs: Any,
) -> list[str]:
    """Hypotheses in `target_lang`, one per source ('' for a blank one), in order.

    Args:
      loaded: a restored multilingual checkpoint (restore.load): model, parameters, tokenizer.
      sources: sentences in any language the model reads (the tag names only the target).
      target_lang: 'fr' -> the sources are tagged '<2fr>'.
      pivot: translate into this language first ('en'), then that output into target_lang.
      beam_size, length_penalty, batch_size, **kwargs: translation.translate_lines' (beam 1: greedy;
        max_len, sort_by_length, warn, progress).
    """
    kw = dict(beam_size=beam_size, length_penalty=length_penalty, batch_size=batch_size, **kwargs)
    if pivot:
        sources = translate_to(loaded, sources, pivot, **kw)
    prefix = tag_prefix(loaded.tokenizer, target_lang)
    return translation.translate_lines(loaded, sources, source_prefix=prefix, **kw)


@dataclasses.dataclass
class DirectionScore:
    """sacreBLEU of one direction of a split."""

    direction: str  # 'de-fr'
    pivot: str | None  # 'en' when translated through English
    bleu: float
    chrf: float
    signature: str
    chrf_signature: str
    sources: list[str]
    hypotheses: list[str]
    references: list[str]


def through(
    loaded: restore.Loaded, target_lang: str, pivot: str, *, beam_size: int, length_penalty: float
) -> quality.Translator:
    """sources -> `translate_to` target_lang through `pivot`, in batches of the checkpoint's
    data.eval_batch_size, long sources truncated as in evaluation (no warning): how a split
    is decoded through a pivot (quality.measure_split's `translate`)."""
    return functools.partial(
        translate_to,
        loaded,
        target_lang=target_lang,
        pivot=pivot,
        beam_size=beam_size,
        length_penalty=length_penalty,
        batch_size=loaded.config.data.eval_batch_size,
        warn=lambda message: None,
    )


def measure_direction(
    loaded: restore.Loaded,
    direction: str,
    *,
    split: str = "test",
    pivot: str | None = None,
    limit: int | None = None,
    beam_size: int = 4,
    length_penalty: float = 0.6,
) -> DirectionScore:
    """Translate the first `limit` pairs of `split` of `direction` ('de-fr': the dataset of
    the checkpoint's config read in that direction) and score them with sacreBLEU
    (quality.measure_split, as evaluation and training's validation BLEU do).

    Direct: the split's eval batches, tagged. Through `pivot`: `translate_to` twice
    (sources -> pivot -> target)."""
    (src, tgt) = directions.parse_directions(direction, "direction")[0]
    if pivot in (src, tgt):
        raise ValueError(f"pivot={pivot!r} is an end of the direction {direction!r}")
    task = tasks.direction_task(
        loaded.config.data, loaded.tokenizer, loaded.config.seed, (src, tgt)
    )
    data = quality.Split(task, split, limit)
    via = (
        through(loaded, tgt, pivot, beam_size=beam_size, length_penalty=length_penalty)
        if pivot
        else None
    )
    r = quality.measure_split(
        loaded.model_config,
        loaded.params,
        loaded.tokenizer,
        data,
        beam_size=beam_size,
        length_penalty=length_penalty,
        translate=via,
    )
    return DirectionScore(
        f"{src}-{tgt}",
        pivot,
        r.bleu,
        r.chrf,
        r.signature,
        r.chrf_signature,
        data.sources,
        r.hypotheses,
        r.references,
    )
