"""The model's projections and dropout, implemented per backend: ModelConfig.kernels and
ModelConfig.dropout_bits, concrete values (ModelConfig.resolved picks them per platform).

Projections (`kernels`):
    'cpu'      matmul.py's custom VJPs (transposes materialised behind optimisation barriers):
               tuned for XLA:CPU.
    'generic'  plain einsums differentiated by autodiff: what XLA:GPU and XLA:TPU fuse best (the
               CPU kernels' barriers block fusions there and copy activations for nothing).
Both give the same loss and gradients up to float rounding (tests/test_kernels.py).

Dropout's random bits (`dropout_bits`):
    'bernoulli'  jax.random.bernoulli: one Threefry block and one float per element.
    'packed'     dropout.py's unrolled Threefry, four 16-bit draws per block (XLA:CPU's fastest;
                 the rate rounds to a multiple of 2^-16).
Each is a function of the key alone, so resume stays exact. 'bernoulli' masks are drawn with
the implementation of the key the model is given (the train state's, made under
`jax_default_prng_impl`); with Threefry (the default) their values do not depend on the
sharding, given `jax_threefry_partitionable=True` (jax's default from 0.5): element i depends
only on (key, i); without it XLA gathers and communicates to draw the same values.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tx_jax.ops import dropout as cpu_dropout
from tx_jax.ops import matmul as cpu_matmul

Array = jax.Array
KERNELS = ("cpu", "generic")
DROPOUT_BITS = ("bernoulli", "packed")


def dense(x: Array, w: Array, precision: Any = None, kernels: str = "generic") -> Array:
    """x [..., K] @ w [K, N] -> [..., N] (x's dtype; cast w beforehand)."""
    if kernels == "cpu":
        return cpu_matmul.dense(x, w, precision)
    return jnp.einsum("...k,kn->...n", x, w, precision=precision)


def bias_add(y: Array, b: Array, kernels: str = "generic") -> Array:
    """y [..., N] + b [N], in y's dtype."""
    if kernels == "cpu":
        return cpu_matmul.bias_add(y, b)
    return y + b.astype(y.dtype)


def tied_logits(x: Array, table: Array, kernels: str = "generic") -> Array:
    """x [B, L, M], table E [V, M] -> x E^T [B, L, V]."""
    if kernels == "cpu":
        return cpu_matmul.tied_logits(x, table)
    return jnp.einsum("blm,vm->blv", x, table)


def effective_rate(rate: float, bits: str = "bernoulli") -> float:
    """The dropout probability `keep_mask` actually uses (16-bit draws round to 2^-16)."""
    return cpu_dropout.effective_rate(rate) if bits == "packed" else float(rate)


def keep_mask(rng: Array, rate: float, shape: tuple[int, ...], bits: str = "bernoulli") -> Array:
    """bool `shape`, True with probability 1 - effective_rate(rate, bits)."""
    if bits == "packed":
        return cpu_dropout.keep_mask(rng, rate, shape)
    return jax.random.bernoulli(rng, 1.0 - rate, shape)


def dropout(x: Array, rate: float, rng: Array, bits: str = "bernoulli") -> Array:
    """x * keep / (1 - rate), keep ~ Bernoulli(1 - rate); rate in [0, 1)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate} must be in [0, 1)")
    rate_used = effective_rate(rate, bits)
    if rate_used == 0.0:
        return x
    scale = jnp.asarray(1.0 / (1.0 - rate_used), x.dtype)
    return jnp.where(keep_mask(rng, rate, x.shape, bits), x * scale, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """`dropout` as a module: a drop-in for flax's nn.Dropout (rng collection 'dropout')."""

    rate: float
    bits: str = "bernoulli"  # ModelConfig.dropout_bits
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(self, x: Array, deterministic: bool = True) -> Array:
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng(self.rng_collection), self.bits)
