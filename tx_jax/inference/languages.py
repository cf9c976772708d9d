"""Which ids go before a source and which the decoder is forced to start with, for a
language pair, whatever kind of checkpoint: one place for translate, score and evaluate.

    an imported M2M100/NLLB model   source: [source language token]; decoder: [target's]
    an imported multi-target Marian  source: [>>xx<<]; decoder: nothing forced
    a multilingual run of tx_jax     source: [<2xx>] (the target's tag); nothing forced
    any other run                    nothing (--target_lang is refused: it would be ignored)

Training puts the same ids on its pairs (data/tasks.Task, from the same tokenizer methods).
"""

from __future__ import annotations

from tx_jax.data import directions


def is_imported(tokenizer) -> bool:
    return hasattr(tokenizer, "family")  # data/imported_tokenizer.ImportedTokenizer


def prefixes(
    loaded, source_lang: str | None = None, target_lang: str | None = None
) -> tuple[list[int], list[int]]:
    """(source prefix, forced target prefix) for translating source_lang -> target_lang
    with `loaded` (restore.Loaded); None: the checkpoint's defaults."""
    tok = loaded.tokenizer
    if is_imported(tok):
        return tok.source_prefix(source_lang, target_lang), tok.target_prefix(target_lang)
    if directions.is_multilingual(loaded.config.data):  # a multilingual run: the target's tag
        if not target_lang:
            raise ValueError(
                f"{loaded.path} is multilingual: give --target_lang (e.g. "
                f"{loaded.config.data.target_lang})"
            )
        directions.check_tags(tok, [target_lang], "this checkpoint")
        return [tok.piece_to_id(directions.lang_tag(target_lang))], []
    for flag, value, stored in (
        ("--source_lang", source_lang, loaded.config.data.get("source_lang")),
        ("--target_lang", target_lang, loaded.config.data.get("target_lang")),
    ):
        if value and value != stored:
            raise ValueError(
                f"{flag}={value}: {loaded.path} translates {loaded.config.data.source_lang} -> "
                f"{loaded.config.data.target_lang} only"
            )
    return [], []
