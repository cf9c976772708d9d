"""A run's tokenizer: WORKDIR/tokenizer.model, given or trained once, then loaded from there.

Trained once on a uniform seeded sample of `data.tokenizer_pairs` train pairs with
`data.tokenizer`'s options; resuming and evaluation load the file by its bytes whatever the
config says. `data.tokenizer_path` (or `train.init_from`'s checkpoint) gives one to share
instead: any object with the Tokenizer interface, kept as its `to_bytes()`. With several
processes, process 0 writes the file and the others wait.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from etils import epath

from tx_jax import paths
from tx_jax.data.preparation import barrier
from tx_jax.data.tokenizer import Tokenizer, train_tokenizer

TOKENIZER_FILE = "tokenizer.model"
# SentencePiece's options under data.tokenizer, with the values of a config that has none (one
# stored before they existed): what every tokenizer trained here before them was.
TOKENIZER_DEFAULTS = {"model_type": "unigram", "character_coverage": 1.0, "byte_fallback": False}
MODEL_TYPES = ("unigram", "bpe")


def tokenizer_options(data: Any) -> dict[str, Any]:
    """`data.tokenizer`'s SentencePiece options (TOKENIZER_DEFAULTS where unset), checked:
    a ValueError naming the key for a model_type not in MODEL_TYPES, a character_coverage
    outside (0, 1], or a byte_fallback that is not a bool."""
    given = data.get("tokenizer") or {}
    options = {
        k: default if given.get(k) is None else given.get(k)
        for k, default in TOKENIZER_DEFAULTS.items()
    }
    if options["model_type"] not in MODEL_TYPES:
        raise ValueError(
            f"data.tokenizer.model_type={options['model_type']!r}; expected one of "
            f"{', '.join(MODEL_TYPES)}"
        )
    coverage = options["character_coverage"]
    number = isinstance(coverage, (int, float)) and not isinstance(coverage, bool)
    if not (number and 0 < coverage <= 1):
        raise ValueError(
            f"data.tokenizer.character_coverage={coverage!r}; expected a fraction in (0, 1] "
            "(1.0: every character of the sample; 0.9995 for a large character set)"
        )
    if not isinstance(options["byte_fallback"], bool):
        raise ValueError(
            f"data.tokenizer.byte_fallback={options['byte_fallback']!r}; expected True or False"
        )
    return options


def given_tokenizer(data: Any) -> Tokenizer | None:
    """The tokenizer `data.tokenizer_path` names (a .model file or a run directory), or None."""
    path = data.get("tokenizer_path")
    if not path:
        return None
    path = epath.Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.exists():
        raise FileNotFoundError(f"data.tokenizer_path={data.tokenizer_path!r}: no {path}")
    return Tokenizer.from_bytes(path.read_bytes())


def load_or_train_tokenizer(
    data: Any,
    workdir: epath.Path,
    texts: Callable[[], Iterable[str]],
    *,
    given: Tokenizer | None = None,
    given_by: str = "data.tokenizer_path",
    symbols: Sequence[str] = (),
) -> Tokenizer:
    """WORKDIR/tokenizer.model if present (never trained again), else `given` (or
    `data.tokenizer_path`'s) saved there, else a `data.vocab_size` model trained with
    `data.tokenizer`'s options on `texts()` with `symbols` (and `data.user_defined_symbols`) as
    single pieces. A WORKDIR/tokenizer.model unlike the given one is an error naming
    `given_by`: the vocabularies would not match."""
    options = tokenizer_options(data)
    path = workdir / TOKENIZER_FILE
    if given is None:
        given = given_tokenizer(data)
    elif data.get("tokenizer_path") and given_tokenizer(data).to_bytes() != given.to_bytes():
        raise ValueError(
            f"data.tokenizer_path={data.tokenizer_path!r} and {given_by} name different "
            "tokenizers; set only one"
        )
    if jax.process_count() == 1 and path.exists():
        existing = Tokenizer.from_bytes(path.read_bytes())
        if given is not None and existing.to_bytes() != given.to_bytes():
            raise ValueError(
                f"{path} differs from the tokenizer of {given_by}: a workdir keeps the "
                "vocabulary it started with; use a new workdir"
            )
        return existing
    # Only process 0 looks at the file: another process could see it appear (half written)
    # and skip the barrier that process 0 then waits at.
    if jax.process_index() == 0 and not path.exists():
        if given is not None:
            paths.write_atomic(path, given.to_bytes())
        else:
            logging.info(
                "training a %d-piece SentencePiece model (%s)",
                data.vocab_size,
                ", ".join(f"{k}={v}" for k, v in options.items()),
            )
            symbols = (*symbols, *(data.get("user_defined_symbols") or ()))
            _train_tokenizer_to(path, texts(), data.vocab_size, symbols, **options)
    barrier("tokenizer")
    tokenizer = Tokenizer.from_bytes(path.read_bytes())
    if given is not None and tokenizer.to_bytes() != given.to_bytes():
        raise ValueError(f"{path} differs from the tokenizer of {given_by}; use a new workdir")
    return tokenizer


def _train_tokenizer_to(
    path: epath.Path,
    texts: Iterable[str],
    vocab_size: int,
    symbols: Sequence[str],
    **options: Any,
) -> None:
    """Trains a tokenizer on `texts` into `path` (gs:// through a local temporary directory)."""
    if not paths.is_remote(path):
        train_tokenizer(texts, vocab_size, str(path), user_defined_symbols=symbols, **options)
        return
    with tempfile.TemporaryDirectory(prefix="tx_jax_tokenizer_") as local:
        model = os.path.join(local, TOKENIZER_FILE)
        trained = train_tokenizer(texts, vocab_size, model, user_defined_symbols=symbols, **options)
    path.write_bytes(trained.to_bytes())
