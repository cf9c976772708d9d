"""Multilingual inference: translate into a language by its tag, directly or through a pivot.

    loaded = restore.load("runs/multi")                 a model trained with data.directions
    multilingual.translate_to(loaded, german, "fr")                zero-shot de -> fr (direct)
    multilingual.translate_to(loaded, german, "fr", pivot="en")    de -> en -> fr, same model
    multilingual.measure_direction(loaded, "de-fr", split="test", pivot="en")   sacreBLEU

A multilingual model reads [id of '<2xx>'] + source pieces + [EOS] and answers in language xx
(Johnson et al., 2017), for any direction whose target has a tag: de -> fr "zero-shot" from a
model trained on en<->de and en<->fr, or through English ("pivot"). `tx_jax evaluate
--direction` and `tx_jax translate --target_lang` use these.
"""

from __future__ import annotations

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
    """Hypotheses in `target_lang` ('fr': the sources tagged '<2fr>'), one per source ('' for
    a blank one), in order; with `pivot` ('en') translated into that language first. Other
    arguments: translation.translate_lines'."""
    kw = dict(beam_size=beam_size, length_penalty=length_penalty, batch_size=batch_size, **kwargs)
    if pivot:
        sources = translate_to(loaded, sources, pivot, **kw)
    prefix = tag_prefix(loaded.tokenizer, target_lang)
    return translation.translate_lines(loaded, sources, source_prefix=prefix, **kw)


def through(
    loaded: restore.Loaded, target_lang: str, pivot: str, *, beam_size: int, length_penalty: float
) -> quality.Translator:
    """sources -> `translate_to` target_lang through `pivot`, batched and truncated as in
    evaluation, without warnings (quality.measure_split's `translate`)."""
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
) -> quality.SplitQuality:
    """Translate the first `limit` pairs of `split` of `direction` ('de-fr': the checkpoint's
    dataset read in that direction), directly (its eval batches, tagged) or through `pivot`,
    and score them with sacreBLEU."""
    (src, tgt) = directions.parse_directions(direction, "direction")[0]
    if pivot in (src, tgt):
        raise ValueError(f"pivot={pivot!r} is an end of the direction {direction!r}")
    task = tasks.direction_task(
        loaded.config.data, loaded.tokenizer, loaded.config.seed, (src, tgt)
    )
    kw = dict(beam_size=beam_size, length_penalty=length_penalty)
    via = through(loaded, tgt, pivot, **kw) if pivot else None
    data = quality.Split(task, split, limit)
    return quality.measure_split(
        loaded.model_config, loaded.params, loaded.tokenizer, data, translate=via, **kw
    )
