"""Which parameters train: all of them (the default), or a part, the rest frozen.

    train.lora.rank > 0    the adapters (model/lora.py) train; the base weights are frozen
    train.trainable = P    the parameters whose path P (a regular expression) is found in,
                           e.g. '^decoder/' or 'layer_(4|5)/' (with LoRA: these besides the
                           adapters); paths look like 'decoder/layer_5/ffn/wi_kernel'

Gradients and optimizer moments exist for the trainable part alone; frozen parameters pass
through the step unchanged (in train.frozen_dtype when set). A checkpoint holds the trainable
part only (`saved`); the frozen part is the base's (train.init_from), read again on resume.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from tx_jax.model.lora import ADAPTER

SEP = "/"


@dataclasses.dataclass(frozen=True)
class Trainable:
    """The trainable part of a model's parameters, by path."""

    adapters: bool = False  # LoRA: the adapters train
    pattern: str = ""  # train.trainable: these train too
    frozen_dtype: str = ""  # '' keeps the parameters' dtype

    @classmethod
    def of(cls, train: Any) -> Trainable:
        """From a run config's train section (keys it lacks: everything trains)."""
        lora = train.get("lora") or {}
        trainable = cls(
            adapters=int(lora.get("rank", 0)) > 0,
            pattern=train.get("trainable", "") or "",
            frozen_dtype=train.get("frozen_dtype", "") or "",
        )
        trainable.validate()
        return trainable

    def validate(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"train.trainable={self.pattern!r} is not a pattern: {e}") from None
        if self.frozen_dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"train.frozen_dtype={self.frozen_dtype!r}; expected '', 'float32', 'bfloat16' "
                "or 'float16'"
            )

    @property
    def everything(self) -> bool:
        return not (self.adapters or self.pattern)

    def trains(self, path: str) -> bool:
        if self.everything:
            return True
        return bool(
            (self.adapters and ADAPTER.search(path))
            or (self.pattern and re.search(self.pattern, path))
        )

    def split(self, params: Any) -> tuple[Any, Any]:
        """(trainable, frozen): two nested dicts holding `params`' leaves between them."""
        if self.everything:
            return params, {}
        flat = traverse_util.flatten_dict(params, sep=SEP)
        parts: tuple[dict, dict] = ({}, {})
        for path, leaf in flat.items():
            parts[0 if self.trains(path) else 1][path] = leaf
        if not parts[0]:
            raise ValueError(self._nothing_trains(flat))
        return tuple(traverse_util.unflatten_dict(p, sep=SEP) for p in parts)

    def merge(self, trainable: Any, frozen: Any) -> Any:
        """`split`'s inverse."""
        if self.everything:
            return trainable
        flat = traverse_util.flatten_dict(trainable, sep=SEP)
        flat.update(traverse_util.flatten_dict(frozen, sep=SEP))
        return traverse_util.unflatten_dict(flat, sep=SEP)

    def cast_frozen(self, params: Any) -> Any:
        """`params` with the frozen leaves in frozen_dtype (boxed leaves keep their boxes)."""
        if self.everything or not self.frozen_dtype:
            return params
        trainable, frozen = self.split(params)
        return self.merge(trainable, self.in_frozen_dtype(frozen))

    def in_frozen_dtype(self, frozen: Any) -> Any:
        """The frozen part (arrays, or ShapeDtypeStructs to restore into) in frozen_dtype."""
        if not self.frozen_dtype:
            return frozen
        dtype = jnp.dtype(self.frozen_dtype)

        def cast(x):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
            return x.astype(dtype)

        return jax.tree_util.tree_map(cast, frozen)

    def saved(self, state: Any) -> Any:
        """What a checkpoint holds of a train state (or of its abstract shapes): its params
        cut to the trainable part."""
        if self.everything:
            return state
        return state.replace(params=self.split(state.params)[0])

    def from_base(self, params: Any) -> tuple[Any, Any]:
        """(what a base checkpoint holds, the adapters): `params` without and with only the
        adapters, which a base has none of."""
        flat = traverse_util.flatten_dict(params, sep=SEP)
        parts: tuple[dict, dict] = ({}, {})
        for path, leaf in flat.items():
            parts[1 if ADAPTER.search(path) else 0][path] = leaf
        return tuple(traverse_util.unflatten_dict(p, sep=SEP) for p in parts)

    def count(self, params: Any) -> tuple[int, int]:
        """(trainable, all) numbers of parameters."""
        trainable, _ = self.split(params)
        size = lambda tree: sum(int(x.size) for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
        return size(trainable), size(params)

    def _nothing_trains(self, flat: dict) -> str:
        example = next(iter(flat), "")
        if self.adapters and not any(ADAPTER.search(p) for p in flat):
            return (
                "train.lora.targets matches no projection of this model: no adapter was made "
                f"(paths look like {example!r})"
            )
        return (
            f"train.trainable={self.pattern!r} matches no parameter (paths look like {example!r})"
        )


EVERYTHING = Trainable()
