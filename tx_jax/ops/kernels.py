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
    'hash'       32 bits per element hashed from (64 bits of the key, the element's index) by
                 elementwise integer ops, with a custom VJP that hashes them again in the
                 backward pass: the bits and the mask are never stored, XLA computes them inside
                 the fusions that read and write the activation.
    'auto'       'packed' where the kernels resolve to 'cpu' (timed fastest on XLA:CPU), else
                 'bernoulli' (the generator the GPU's timed steps ran with; 'hash' moves the
                 least memory in the compiled GPU and TPU plans and is a candidate until a
                 timed run says so: docs/design.md, "Implementation choices: one rule").
Every choice is a function of the key alone, so resume stays exact; 'packed' rounds the rate
to a multiple of 2^-16, 'hash' to a multiple of 2^-32.

Sharded dropout. 'hash' masks take two words from the key and element i's bits from (words,
i) through iotas: under a sharded jit each device hashes its own shard, with no collective, and
the values do not depend on the mesh (tests/test_kernels.py, 8 CPU devices). 'bernoulli' masks
(jax.random's module docstring has the table) are drawn with the implementation of the key the
model is given (the train state's, made under `jax_default_prng_impl`). With Threefry (the
default) their values do not depend on the sharding either, given
`jax_threefry_partitionable=True` (jax's default from 0.5; this module does not set it, and
jax 0.4.x users should): element i then depends only on (key, i); without it XLA gathers and
communicates to draw the same values. jax's 'rbg' / 'unsafe_rbg' key implementations (XLA's
RngBitGenerator) shard efficiently only with XLA_FLAGS=--xla_tpu_spmd_rng_bit_generator_unsafe=1,
and then the masks do change with the sharding.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tx_jax.ops import backend
from tx_jax.ops import dropout as cpu_dropout
from tx_jax.ops import matmul as cpu_matmul

Array = jax.Array
KERNELS = ("auto", "cpu", "generic")
DROPOUT_BITS = ("auto", "bernoulli", "packed", "hash")


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
    """One of DROPOUT_BITS -> the generator dropout masks are drawn with ('auto' resolved)."""
    if bits not in DROPOUT_BITS:
        raise ValueError(f"model.dropout_bits={bits!r}; expected one of {DROPOUT_BITS}")
    if bits == "auto":
        return "packed" if resolve(kernels) == "cpu" else "bernoulli"
    return bits


def effective_rate(rate: float, kernels: str = "auto", bits: str = "auto") -> float:
    """The dropout probability `keep_mask` actually uses (16-bit draws round to 2^-16, 'hash'
    to 2^-32)."""
    chosen = resolve_bits(bits, kernels)
    if chosen == "bernoulli":
        return float(rate)
    if chosen == "hash":
        return _hash_threshold(rate) / 2**32
    return cpu_dropout.effective_rate(rate)


# lowbias32 (C. Wellons, "Hash function prospector", 2018): a 32-bit integer mixer whose
# output bits each flip with probability ~1/2 when any input bit does.
_MIX = (np.uint32(0x7FEB352D), np.uint32(0x846CA68B))


def _mix32(h: Array) -> Array:
    h = h ^ (h >> 16)
    h = h * _MIX[0]
    h = h ^ (h >> 15)
    h = h * _MIX[1]
    return h ^ (h >> 16)


def _hash_threshold(rate: float) -> int:
    return min(round(rate * 2**32), 2**32 - 1)


def _hash_words(rng: Array) -> Array:
    """uint32[2] from the key (the only thing the masks depend on besides the shape)."""
    return jax.random.bits(rng, (2,), jnp.uint32)


def _hash_keep(words: Array, threshold: int, shape: tuple[int, ...]) -> Array:
    size = math.prod(shape)
    if size >= 2**32:
        raise ValueError(f"dropout_bits='hash' numbers elements in 32 bits; {shape} has {size}")
    # the row-major index from per-axis iotas: elementwise, so it fuses and shards like x
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    bits = _mix32(_mix32(index ^ words[0]) + words[1])
    return bits >= np.uint32(threshold)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _hash_dropout(x: Array, words: Array, threshold: int, scale: float) -> Array:
    keep = _hash_keep(words, threshold, x.shape)
    return jnp.where(keep, x * jnp.asarray(scale, x.dtype), jnp.zeros((), x.dtype))


def _hash_dropout_fwd(x, words, threshold, scale):
    return _hash_dropout(x, words, threshold, scale), words  # the key alone is kept


def _hash_dropout_bwd(threshold, scale, words, dy):
    keep = _hash_keep(words, threshold, dy.shape)
    dx = jnp.where(keep, dy * jnp.asarray(scale, dy.dtype), jnp.zeros((), dy.dtype))
    return dx, np.zeros(words.shape, jax.dtypes.float0)


_hash_dropout.defvjp(_hash_dropout_fwd, _hash_dropout_bwd)


def keep_mask(
    rng: Array, rate: float, shape: tuple[int, ...], kernels: str = "auto", bits: str = "auto"
) -> Array:
    """bool `shape`, True with probability 1 - effective_rate(rate, kernels, bits)."""
    chosen = resolve_bits(bits, kernels)
    if chosen == "packed":
        return cpu_dropout.keep_mask(rng, rate, shape)
    if chosen == "hash":
        return _hash_keep(_hash_words(rng), _hash_threshold(rate), shape)
    return jax.random.bernoulli(rng, 1.0 - rate, shape)


def dropout(x: Array, rate: float, rng: Array, kernels: str = "auto", bits: str = "auto") -> Array:
    """x * keep / (1 - rate), keep ~ Bernoulli(1 - rate); rate in [0, 1)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate} must be in [0, 1)")
    rate_used = effective_rate(rate, kernels, bits)
    if rate_used == 0.0:
        return x
    if resolve_bits(bits, kernels) == "hash":
        return _hash_dropout(x, _hash_words(rng), _hash_threshold(rate), 1.0 / (1.0 - rate_used))
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
        return dropout(x, self.rate, self.key(), self.kernels, self.bits)

    def key(self) -> Array:
        """The key this module's masks are drawn from (a fused kernel that does the dropout
        itself asks for it, so the masks are the ones this module would draw)."""
        return self.make_rng(self.rng_collection)
