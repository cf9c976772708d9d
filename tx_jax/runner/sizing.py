"""Defaults sized by the corpus: the keys a config leaves unset (None) are chosen from the
data before the run is built (runner/setup.py's size_from_data), said in one line and
recorded in config.json.

    unset = unset_keys(config)                 the keys left to the data (configs/text.py's)
    size_class(pairs).vocab_size               before the tokenizer is trained
    choices = size_run(config, unset, ...)     after: lengths, model, steps, dtype

The rule by train pairs (CLASSES), the lengths, steps and dtype chosen, and their evidence:
docs/data.md "Your own corpus". A resumed run takes the values of its config.json, so a later
change of the rule never changes a run under way. Every value the user sets wins.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections
import numpy as np
from etils import epath

from tx_jax.config import upgrade_stored
from tx_jax.data import lengths as lengths_lib
from tx_jax.model.config import VARIANTS
from tx_jax.training import logs

# The keys a config may leave to the data (None); the rule fills each of them.
MODEL_KEYS = (
    "d_model",
    "num_heads",
    "d_ff",
    "num_encoder_layers",
    "num_decoder_layers",
    "dropout_rate",
    "attention_dropout_rate",
)
SIZED_KEYS = (
    *(f"model.{k}" for k in MODEL_KEYS),
    "model.dtype",
    "data.vocab_size",
    "data.max_train_len",
    "data.max_eval_len",
    "data.tokens_per_batch",
    "data.bucket_boundaries",
    "train.num_steps",
    "train.warmup_steps",
    "train.cooldown_steps",
    "eval.every",
    "checkpoint.every",
)
# Their types, so that a flag can set one that is None (--config.model.d_model=512).
SIZED_TYPES = {
    **dict.fromkeys(SIZED_KEYS, int),
    "model.dropout_rate": float,
    "model.attention_dropout_rate": float,
    "model.dtype": str,
    "data.bucket_boundaries": list,
}
MAX_LEN_RANGE = (16, 256)
# Packed rows shorter than this hold too few pairs and waste their ends (docs/data.md).
MIN_PACKED_LEN = 64
MAX_EVAL_LEN_RANGE = (16, 1024)
STEPS_RANGE = (1_000, 300_000)
PERCENTILE = 99
COOLDOWN_SHARE = 0.2


@dataclasses.dataclass(frozen=True)
class SizeClass:
    """One row of the rule: corpora of fewer than `below` train pairs (None: any size)."""

    name: str
    below: int | None
    model: dict[str, Any]
    vocab_size: int
    tokens_per_batch: int
    epochs: float
    warmup_steps: int
    evidence: str


def _model(variant: str, **changes: Any) -> dict[str, Any]:
    fields = {k: VARIANTS[variant][k] for k in MODEL_KEYS if k in VARIANTS[variant]}
    return {**fields, "attention_dropout_rate": 0.0, **changes}


CLASSES = (
    SizeClass(
        "small",
        100_000,
        _model("small", dropout_rate=0.3, attention_dropout_rate=0.1),
        8_000,
        4_096,
        75,
        1_000,
        "measured here: configs/multi30k.py, 29,000 pairs",
    ),
    SizeClass(
        "medium",
        1_000_000,
        _model("base", d_ff=1024, num_heads=4, dropout_rate=0.3, attention_dropout_rate=0.1),
        10_000,
        4_096,
        50,
        4_000,
        "fairseq's IWSLT'14 recipe (transformer_iwslt_de_en), ~160,000 pairs",
    ),
    SizeClass(
        "base",
        10_000_000,
        _model("base"),
        32_000,
        25_000,
        20,
        4_000,
        "the paper's base, WMT14 en-de, 4.5M pairs",
    ),
    SizeClass(
        "big",
        None,
        _model("big", dropout_rate=0.1),
        32_000,
        25_000,
        7,
        4_000,
        "the paper's big, WMT14 en-fr, 36M pairs",
    ),
)


def size_class(pairs: int) -> SizeClass:
    """The rule's row for a train split of `pairs` pairs."""
    return next(c for c in CLASSES if c.below is None or pairs < c.below)


def get(config: ml_collections.ConfigDict, key: str) -> Any:
    section, name = key.split(".")
    return config[section].get(name) if section in config else None


def _set(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
    section, name = key.split(".")
    config[section][name] = value


def unset_keys(config: ml_collections.ConfigDict) -> list[str]:
    """The keys of SIZED_KEYS that `config` leaves to the data (None)."""
    return [
        k
        for k in SIZED_KEYS
        if k.split(".")[1] in config[k.split(".")[0]] and get(config, k) is None
    ]


def _stored_values(workdir: epath.Path, keys: Iterable[str]) -> dict[str, Any]:
    """The values a run under way (one with checkpoints) stored for `keys`; {} for a new run."""
    ckpts = workdir / "checkpoints"
    path = workdir / "config.json"
    if not (ckpts.exists() and any(p.name.isdigit() for p in ckpts.iterdir()) and path.exists()):
        return {}
    stored = upgrade_stored(json.loads(path.read_text()))
    out = {}
    for key in keys:
        section, name = key.split(".")
        value = stored.get(section, {}).get(name)
        if value is not None:
            out[key] = value
    return out


def fill(config: ml_collections.ConfigDict, values: dict[str, Any]) -> None:
    """Sets each unset key of `values` in `config` (a set one keeps the user's value)."""
    for key, value in values.items():
        if get(config, key) is None:
            _set(config, key, value)


def round_up(n: float, multiple: int) -> int:
    return int(multiple * math.ceil(n / multiple))


def clamp(n: int, bounds: tuple[int, int]) -> int:
    return max(bounds[0], min(bounds[1], n))


def packed_pairs_per_batch(
    source: np.ndarray, target: np.ndarray, max_len: int, rows: int
) -> float:
    """Pairs per batch when batches.py's first-fit packer fills `rows` rows of `max_len` with
    pairs of these lengths (longer ones dropped, as there)."""
    keep = (source <= max_len) & (target <= max_len)
    free: list[list[int]] = []
    batches, held = 0, 0
    for s, t in zip(source[keep].tolist(), target[keep].tolist()):
        row = next((r for r, (fs, ft) in enumerate(free) if s <= fs and t <= ft), None)
        if row is None and len(free) == rows:
            batches, free, row = batches + 1, [], None
        if row is None:
            free.append([max_len, max_len])
            row = len(free) - 1
        free[row][0] -= s
        free[row][1] -= t
        held += 1
    used = batches + (len(free) / rows if free else 0)
    return held / used if used else 1.0


def _bfloat16_compute(platform: str) -> tuple[bool, str]:
    """Whether bfloat16 compute pays on `platform` (TPUs, GPUs, CPUs with bf16 units), and why."""
    if platform in ("tpu", "gpu", "cuda", "rocm"):
        return True, platform
    feats = logs.cpu().rsplit(", ", 1)[-1]
    return feats != "no bfloat16 units", f"CPU with {feats}"


def eval_every(steps: int) -> int:
    """eval.every for a run of `steps` updates: ~10 evaluations (budget.py's fitted steps too)."""
    return max(100, round_up(steps / 10, 100))


def checkpoint_every(eval_every: int) -> int:
    """A checkpoint between two evaluations (each evaluation saves one too)."""
    return max(50, eval_every // 2)


@dataclasses.dataclass
class Choices:
    """What the rule chose (and what the user set) for one run, and the one line saying so."""

    values: dict[str, Any]
    line: str


def size_run(
    config: ml_collections.ConfigDict,
    unset: Sequence[str],
    train: lengths_lib.Lengths,
    evals: dict[str, lengths_lib.Lengths],
    *,
    platform: str,
    batch_multiple: int = 1,
) -> Choices:
    """Fills the keys of `unset` still None in `config` from the train lengths (a uniform
    sample) and the evaluation splits' lengths -> what it chose."""
    cls = size_class(train.total)
    chosen: dict[str, Any] = {}

    def choose(key: str, value: Any) -> Any:
        if key in unset and get(config, key) is None:
            _set(config, key, value)
            chosen[key] = value
        return get(config, key)

    for k in MODEL_KEYS:
        choose(f"model.{k}", cls.model[k])
    if "model.dtype" in unset and get(config, "model.dtype") is None:
        bf16, why = _bfloat16_compute(platform)
        choose("model.dtype", "bfloat16" if bf16 else "float32")
        chosen["model.dtype"] = (chosen["model.dtype"], why)
    p = train.percentile(PERCENTILE)
    floor = MIN_PACKED_LEN if config.data.get("packing", True) else MAX_LEN_RANGE[0]
    max_len = choose("data.max_train_len", clamp(max(round_up(p, 8), floor), MAX_LEN_RANGE))
    longest = max(
        (int(max(e.source.max(), e.target.max())) for e in evals.values() if e.sampled), default=0
    )
    choose("data.max_eval_len", clamp(round_up(max(longest, 1), 8), MAX_EVAL_LEN_RANGE))
    tokens = choose("data.tokens_per_batch", max(cls.tokens_per_batch, max_len * batch_multiple))
    if config.data.get("packing", True):
        choose("data.bucket_boundaries", [max_len])
    else:
        from tx_jax.data.batches import default_bucket_boundaries

        choose("data.bucket_boundaries", default_bucket_boundaries(max_len))
    rows = max(1, tokens // max_len // batch_multiple * batch_multiple)
    per_batch = packed_pairs_per_batch(train.source, train.target, max_len, rows)
    per_epoch = train.total / per_batch
    steps = choose("train.num_steps", clamp(round_up(cls.epochs * per_epoch, 100), STEPS_RANGE))
    choose("train.warmup_steps", max(1, min(cls.warmup_steps, steps // 4)))
    choose("train.cooldown_steps", round(COOLDOWN_SHARE * steps))
    every = choose("eval.every", eval_every(steps))
    choose("checkpoint.every", checkpoint_every(every))
    line = describe(config, cls, train, p, per_epoch, chosen, unset)
    chosen = {k: (v[0] if isinstance(v, tuple) else v) for k, v in chosen.items()}
    return Choices(chosen, line)


def describe(config, cls: SizeClass, train, p: int, per_epoch: float, chosen, unset) -> str:
    """'sized from the data: 29,000 train pairs, 99th percentile 41 ids -> small model ...'"""
    m, d, t = config.model, config.data, config.train
    parts = [
        f"{cls.name} model (d_model {m.d_model}, {m.num_encoder_layers}+{m.num_decoder_layers} "
        f"layers, {m.num_heads} heads, d_ff {m.d_ff}, dropout {m.dropout_rate:g}; "
        f"{cls.evidence})",
        f"vocabulary {d.vocab_size:,}",
        f"max_train_len {d.max_train_len}",
        f"max_eval_len {d.max_eval_len}",
        f"{d.tokens_per_batch:,} tokens a batch",
        f"{t.num_steps:,} steps (~{t.num_steps / per_epoch:.0f} epochs; warmup "
        f"{t.warmup_steps:,}, cooldown {t.cooldown_steps:,})",
    ]
    if "model.dtype" in chosen:
        value, why = chosen["model.dtype"]
        parts.append(f"{value} ({why})")
    line = (
        f"sized from the data: {train.total:,} train pairs, {PERCENTILE}th percentile {p} ids "
        f"-> " + ", ".join(parts)
    )
    kept = [k for k in SIZED_KEYS if k not in unset and get(config, k) is not None]
    return line + (f"; set in the config, kept: {', '.join(kept)}" if kept else "")


def with_placeholders(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `config` whose unset keys hold the smallest class's values, for the checks
    that run before the data is read (validate_config)."""
    out = copy.deepcopy(config)
    small = CLASSES[0]
    values = {f"model.{k}": v for k, v in small.model.items()}
    values.update(
        {
            "model.dtype": "float32",
            "data.vocab_size": small.vocab_size,
            "data.max_train_len": MAX_LEN_RANGE[0],
            "data.max_eval_len": MAX_EVAL_LEN_RANGE[0],
            "data.tokens_per_batch": small.tokens_per_batch,
            "data.bucket_boundaries": [MAX_LEN_RANGE[0]],
            "train.num_steps": STEPS_RANGE[0],
            "train.warmup_steps": small.warmup_steps // 4,
            "train.cooldown_steps": 0,
            "eval.every": STEPS_RANGE[0],
            "checkpoint.every": STEPS_RANGE[0],
        }
    )
    fill(out, {k: v for k, v in values.items() if k in unset_keys(out)})
    return out


def unset_message(unset: Sequence[str]) -> str:
    """Why a config with keys left to the data cannot be planned or checked without it."""
    return (
        f"{', '.join(unset)} are left to the data (None): a run chooses them when it reads the "
        "corpus; to plan or check the config without data, run `tx_jax prepare` with "
        "the same --config flags and add the --config flags it prints"
    )


def as_flags(values: dict[str, Any]) -> str:
    """The chosen values as command-line flags (`tx_jax prepare` prints them)."""
    return " ".join(
        f"--config.{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in values.items()
    )


def begin(config: ml_collections.ConfigDict, workdir: epath.Path) -> ml_collections.ConfigDict:
    """`config` if it leaves nothing to the data, else a copy holding a resumed run's stored
    choices for its unset keys."""
    unset = unset_keys(config)
    if not unset:
        return config
    config = copy.deepcopy(config)
    fill(config, _stored_values(workdir, unset))
    return config
