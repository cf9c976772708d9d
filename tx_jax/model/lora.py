"""Low-rank adapters (LoRA, Hu et al. 2021) on the model's projections.

A targeted projection y = x W (+ b) becomes

    y = x W (+ b) + (alpha / r) Dropout(x) A B,    A [K, r] random, B [r, N] zeros,

so an adapted model starts as its base. A and B sit next to W in the same module, named
`{name}_lora_a` and `{name}_lora_b`. Which projections: `LoRA.targets`, a regular expression
searched in the projection's path, e.g. 'decoder/layer_3/cross_attention/query' or
'encoder/layer_0/ffn/wi' (the attention's query, key, value and out; the FFN's wi, wi_gate and
wo). Whether the base weights train is the train step's business (training/freezing.py);
`merge` folds trained adapters into W (what export writes).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from tx_jax.ops.kernels import dense, dropout

Array = jax.Array

# every projection of the attention and of the FFN: what QLoRA found best (Dettmers et al.
# 2023); restrict it with a narrower pattern, e.g. r'attention/(query|value)$' (the LoRA paper's)
DEFAULT_TARGETS = r"attention/(query|key|value|out)$|ffn/(wi|wi_gate|wo)$"
ADAPTER = re.compile(r"_lora_[ab]$")  # the adapters' parameter names: `{name}_lora_a`, ..._b


@dataclasses.dataclass(frozen=True)
class LoRA:
    """The adapters of a model: rank r (0: none), alpha (the update's scale is alpha / r),
    dropout on the adapters' input, and the projections they adapt."""

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    targets: str = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def applies(self, path: str) -> bool:
        return self.rank > 0 and re.search(self.targets, path) is not None

    def validate(self) -> None:
        if self.rank < 0:
            raise ValueError(f"train.lora.rank={self.rank} must be >= 0 (0: no adapters)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"train.lora.dropout={self.dropout} must be in [0, 1)")
        if self.rank and self.alpha <= 0:
            raise ValueError(f"train.lora.alpha={self.alpha} must be positive")
        try:
            re.compile(self.targets)
        except re.error as e:
            raise ValueError(f"train.lora.targets={self.targets!r} is not a pattern: {e}") from None


def adapt(
    module: nn.Module,
    name: str,
    x: Array,
    y: Array,
    lora: LoRA,
    *,
    deterministic: bool,
    kernels: str,
    dropout_bits: str,
    precision: Any = None,
) -> Array:
    """y [..., N] (projection `name` of `module` applied to x [..., K]) plus its adapter's
    update, when `lora` targets it; y itself otherwise. Called inside `module`'s compact call."""
    if not lora.rank or not lora.applies("/".join((*module.path, name))):
        return y  # the path is built only for a model with adapters: tracing pays nothing
    K, N = x.shape[-1], y.shape[-1]
    a = module.param(
        f"{name}_lora_a",
        nn.with_logical_partitioning(nn.initializers.he_uniform(), (None, None)),
        (K, lora.rank),
        module.param_dtype,
    )
    b = module.param(
        f"{name}_lora_b",
        nn.with_logical_partitioning(nn.initializers.zeros_init(), (None, None)),
        (lora.rank, N),
        module.param_dtype,
    )
    if lora.dropout > 0.0 and not deterministic:
        x = dropout(x, lora.dropout, module.make_rng("dropout"), dropout_bits)
    h = dense(x, a.astype(x.dtype), precision, kernels)  # [..., r]
    delta = dense(h, b.astype(x.dtype), precision, kernels)
    return y + (lora.scale * delta).astype(y.dtype)


def merge(params: Any, lora: LoRA) -> Any:
    """`params` (an unboxed 'params' tree) with every adapter folded into its kernel:
    W + (alpha / r) A B, reshaped as W is (the attention's [M, heads, D] and [H, D, M]), in
    W's dtype; the adapters are gone. What a model without adapters computes the same with."""
    flat = traverse_util.flatten_dict(params, sep="/")
    out = {k: v for k, v in flat.items() if not ADAPTER.search(k)}
    for key in flat:
        if not key.endswith("_lora_a"):
            continue
        stem = key[: -len("_lora_a")]
        kernel = out[f"{stem}_kernel"]
        a = np.asarray(flat[key], np.float32)
        b = np.asarray(flat[f"{stem}_lora_b"], np.float32)
        delta = (lora.scale * (a @ b)).reshape(kernel.shape)
        out[f"{stem}_kernel"] = jnp.asarray(
            np.asarray(kernel, np.float32) + delta, dtype=kernel.dtype
        )
    return traverse_util.unflatten_dict(out, sep="/")


def adapters(params: Any) -> dict[str, Array]:
    """The adapters of an unboxed 'params' tree, by path ('encoder/layer_0/ffn/wi_lora_a')."""
    flat = traverse_util.flatten_dict(params, sep="/")
    return {k: v for k, v in flat.items() if ADAPTER.search(k)}
