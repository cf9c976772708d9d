"""Multilingual translation: one model, several directions, target-language tags.

    data.directions = 'en-de,de-en,en-fr,fr-en'   (or '+' between them, or a list)
    data.mixture = 'temperature'                  'uniform' | 'temperature' (streams.py)
    data.temperature = 5.0                        p_i ~ n_i^(1/T)
    data.extra_eval_directions = 'de-fr'          also decoded for BLEU (e.g. zero-shot)

Tags (Johnson et al., 2017): the id of '<2xx>' (`lang_tag`) goes before every source whose
target language is xx, in training and evaluation: [tag id] + pieces + [EOS]. The tokenizer has
one user-defined piece per language (`tag_languages`), trained on `data.tokenizer_pairs` pairs
of each direction's train split unless one is given (with the tags). A direction is
`data.dataset` with source_lang/target_lang set to it (`direction_data`); data.max_train_pairs
cuts each direction before the mixture sizes n_i are counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_collections

from tx_jax.config import study_value
from tx_jax.data import streams
from tx_jax.data.shards import parse_max_train_pairs
from tx_jax.data.tokenizer import Tokenizer

Direction = tuple[str, str]  # (source language, target language)


def lang_tag(lang: str) -> str:
    """The target-language tag piece: 'de' -> '<2de>'."""
    return f"<2{lang}>"


def direction_name(direction: Direction) -> str:
    """('en', 'de') -> 'en-de' (metric names: bleu/en-de)."""
    return f"{direction[0]}-{direction[1]}"


def parse_directions(spec: str | Sequence[str] | None, key: str = "data.directions") -> list:
    """'en-de,de-en' / 'en-de+de-en' / ['en-de', 'de-en'] -> [('en', 'de'), ('de', 'en')], in
    the given order; '' or None -> []. A ValueError names `key` for anything malformed."""
    if not spec:
        return []
    items = spec.replace("+", ",").split(",") if isinstance(spec, str) else list(spec)
    out: list[Direction] = []
    for item in (str(i).strip() for i in items):
        src, sep, tgt = item.partition("-")
        if not sep or not src or not tgt or "-" in tgt or src == tgt:
            raise ValueError(
                f"{key}={spec!r}: {item!r} is not SRC-TGT with two different languages "
                "(write e.g. 'en-de,de-en,en-fr')"
            )
        if (src, tgt) in out:
            raise ValueError(f"{key}={spec!r}: {item!r} appears twice")
        out.append((src, tgt))
    return out


def is_multilingual(data: Any) -> bool:
    """Whether `data` (config.data) asks for tagged directions (`data.directions` is set)."""
    return bool(study_value(data, "directions"))


def train_directions(data: Any) -> list[Direction]:
    return parse_directions(study_value(data, "directions"))


def extra_directions(data: Any) -> list[Direction]:
    """`data.extra_eval_directions` that are not training directions."""
    key = "data.extra_eval_directions"
    extra = parse_directions(study_value(data, "extra_eval_directions"), key)
    return [d for d in extra if d not in train_directions(data)]


def tag_languages(data: Any) -> list[str]:
    """Every language of the directions (training and extra), sorted: one tag each."""
    pairs = train_directions(data) + extra_directions(data)
    return sorted({lang for d in pairs for lang in d})


def validate_config(data: Any, task: str = "translation") -> None:
    """The multilingual and transfer keys of config.data, before anything is read (absent
    from a config: their neutral values, nothing to check). ValueError names the key."""
    trained = train_directions(data)
    extra = study_value(data, "extra_eval_directions")
    parse_directions(extra, "data.extra_eval_directions")
    if extra and not trained:
        raise ValueError("data.extra_eval_directions needs data.directions (a multilingual run)")
    if trained and task == "lm":
        raise ValueError("data.directions is for translation; task='lm' reads data.lm_side")
    kind, temperature = study_value(data, "mixture"), study_value(data, "temperature")
    if kind not in streams.MIXTURES:
        raise ValueError(f"data.mixture={kind!r}; expected one of {streams.MIXTURES}")
    if temperature <= 0:
        raise ValueError(f"data.temperature={temperature} must be positive")
    spec = study_value(data, "max_train_pairs")
    cut = parse_max_train_pairs(spec)
    names = [direction_name(d) for d in trained] or [f"{data.source_lang}-{data.target_lang}"]
    if isinstance(cut, dict) and set(cut) - set(names):
        raise ValueError(
            f"data.max_train_pairs={spec!r} names {sorted(set(cut) - set(names))}"
            f", not a trained direction ({', '.join(names)})"
        )


def check_tags(tokenizer: Tokenizer, languages: Sequence[str], where: str) -> None:
    """Every `lang_tag` must be one piece of the tokenizer (a user-defined symbol)."""
    tags = [lang_tag(x) for x in languages]
    missing = [t for t in tags if tokenizer.piece_to_id(t) in (tokenizer.unk_id, tokenizer.pad_id)]
    if missing:
        raise ValueError(
            f"the tokenizer of {where} has no piece {', '.join(missing)}: a multilingual model "
            "needs each target-language tag as one piece (trained with them as "
            "user_defined_symbols, as tasks.prepare_task does)"
        )


def direction_data(data: Any, direction: Direction) -> ml_collections.ConfigDict:
    """A copy of config.data reading `direction` (source_lang, target_lang set)."""
    out = ml_collections.ConfigDict(data.to_dict() if hasattr(data, "to_dict") else dict(data))
    out.source_lang, out.target_lang = direction
    return out
