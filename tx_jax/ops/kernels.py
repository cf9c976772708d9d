"""The model's projections and dropout, implemented per backend (`ModelConfig.kernels`).

    'cpu'      matmul.py's custom VJPs (transposes materialised behind optimisation barriers)
               and dropout.py's unrolled-Threefry masks: tuned for XLA:CPU.
    'generic'  plain einsums differentiated by autodiff, and dropout masks from
               jax.random.bernoulli: what XLA:GPU and XLA:TPU fuse best (the barriers of the
               CPU kernels block fusions there and copy activations for nothing).
    'auto'     'cpu' when ops.backend.current() == 'cpu' at trace time, else 'generic'. A step
               traced on a CPU host for another platform names it with
               `ops.backend.target(...)` (tx_jax.planning does) or sets 'generic' explicitly.

Both give the same loss and gradients up to float rounding (tests/test_kernels.py), but not
the same dropout masks: the CPU masks draw four 16-bit numbers per Threefry block, the generic
ones one float per element.

Dropout's random bits (`ModelConfig.dropout_bits`), separately from the projections:
    'bernoulli'  jax.random.bernoulli: one Threefry block and one float per element.
    'packed'     dropout.py's unrolled Threefry, four 16-bit draws per block (the CPU masks).
    'rbg'        XLA's RngBitGenerator (Philox on GPU) keyed by 128 bits hashed from the key,
                 16 bits per element: the fewest operations on an accelerator.
    'auto'       'packed' where the kernels resolve to 'cpu', else 'bernoulli'.
Every choice is a function of the key alone, so resume stays exact; 'packed' and 'rbg' round
the rate to a multiple of 2^-16.

Sharded dropout (jax.random's module docstring has the table). The masks are drawn with the
implementation of the key the model is given (the train state's, made under
`jax_default_prng_impl`). With Threefry (the default) their values do not depend on the
sharding, so a run's masks, and its losses, do not change with its mesh. Keep
`jax_threefry_partitionable=True` (jax's default from 0.5; this module does not set it, and
jax 0.4.x users should): element i of a mask then depends only on (key, i), so under a
sharded jit each device draws only its own shard; without it XLA gathers and communicates
to draw the same values (both checked in tests/test_kernels.py on 8 CPU devices).
The 'rbg' / 'unsafe_rbg' implementations (XLA's RngBitGenerator) are the fastest on TPU but
shard efficiently only with XLA_FLAGS=--xla_tpu_spmd_rng_bit_generator_unsafe=1, and then the
masks do change with the sharding.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tx_jax.ops import backend
from tx_jax.ops import dropout as cpu_dropout
from tx_jax.ops import matmul as cpu_matmul

Array = jax.Array
KERNELS = ("auto", "cpu", "generic")
DROPOUT_BITS = ("auto", "bernoulli", "packed", "rbg")


def resolve(kernels: str) -> str:
    """'auto' | 'cpu' | 'generic' -> 'cpu' | 'generic' (auto: by the default backend, now)."""
    if kernels not in KERNELS:
        raise ValueError(f"model.kernels={kernels!r}; expected one of {KERNELS}")
    if kernels == "auto":
        return "cpu" if backend.current() == "cpu" else "generic"
    return kernels


def dense(x: Array, w: Array, precision: Any = None, kernels: str = "auto") -> Array:
    """x [..., K] @ w [K, N] -> [..., N] (x's dtype; cast w beforehand)."""
    if resolve(kernels) == "cpu":
        return cpu_matmul.dense(x, w, precision)
    return jnp.einsum("...k,kn->...n", x, w, precision=precision)


def bias_add(y: Array, b: Array, kernels: str = "auto") -> Array:
    """y [..., N] + b [N], in y's dtype."""
    if resolve(kernels) == "cpu":
        return cpu_matmul.bias_add(y, b)
    return y + b.astype(y.dtype)


def tied_logits(x: Array, table: Array, kernels: str = "auto") -> Array:
    """x [B, L, M], table E [V, M] -> x E^T [B, L, V]."""
    if resolve(kernels) == "cpu":
        return cpu_matmul.tied_logits(x, table)
    return jnp.einsum("blm,vm->blv", x, table)


def resolve_bits(bits: str, kernels: str = "auto") -> str:
    """'auto' | 'bernoulli' | 'packed' | 'rbg' -> the generator dropout masks are drawn with."""
    if bits not in DROPOUT_BITS:
        raise ValueError(f"model.dropout_bits={bits!r}; expected one of {DROPOUT_BITS}")
    if bits == "auto":
        return "packed" if resolve(kernels) == "cpu" else "bernoulli"
    return bits


def effective_rate(rate: float, kernels: str = "auto", bits: str = "auto") -> float:
    """The dropout probability `keep_mask` actually uses (16-bit draws round to 2^-16)."""
    if resolve_bits(bits, kernels) == "bernoulli":
        return float(rate)
    return cpu_dropout.effective_rate(rate)


def _rbg_keep_mask(rng: Array, rate: float, shape: tuple[int, ...]) -> Array:
    # An RngBitGenerator key from 128 bits of the given key: the masks stay a function of the
    # checkpointed key and step, whatever implementation made that key.
    seed = jax.random.bits(rng, (4,), jnp.uint32)
    key = jax.random.wrap_key_data(seed, impl="rbg")
    draws = jax.random.bits(key, shape, jnp.uint16)
    return draws >= jnp.uint16(round(rate * 2**16))


def keep_mask(
    rng: Array, rate: float, shape: tuple[int, ...], kernels: str = "auto", bits: str = "auto"
) -> Array:
    """bool `shape`, True with probability 1 - effective_rate(rate, kernels, bits)."""
    chosen = resolve_bits(bits, kernels)
    if chosen == "packed":
        return cpu_dropout.keep_mask(rng, rate, shape)
    if chosen == "rbg":
        return _rbg_keep_mask(rng, rate, shape)
    return jax.random.bernoulli(rng, 1.0 - rate, shape)


def dropout(x: Array, rate: float, rng: Array, kernels: str = "auto", bits: str = "auto") -> Array:
    """x * keep / (1 - rate), keep ~ Bernoulli(1 - rate); rate in [0, 1)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate} must be in [0, 1)")
    rate_used = effective_rate(rate, kernels, bits)
    if rate_used == 0.0:
        return x
    scale = jnp.asarray(1.0 / (1.0 - rate_used), x.dtype)
    keep = keep_mask(rng, rate, x.shape, kernels, bits)
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """`dropout` as a module: a drop-in for flax's nn.Dropout (rng collection 'dropout')."""

    rate: float
    kernels: str = "auto"
    bits: str = "auto"  # ModelConfig.dropout_bits
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(self, x: Array, deterministic: bool = True) -> Array:
        if deterministic or self.rate == 0.0:
            return x
        rng = self.make_rng(self.rng_collection)
        return dropout(x, self.rate, rng, self.kernels, self.bits)
