"""Dropout (Srivastava et al. 2014; the paper's section 5.4) with cheap random bits.

    dropout(x, rate, rng): each element is zeroed with probability `rate` (rounded to a
    multiple of 2^-16) and the survivors are scaled by 1 / (1 - rate), so E[out] = x.

Two things make jax.random.bernoulli slow on a CPU, where the dropout masks of a small
Transformer cost more than its attention: (1) JAX lowers Threefry-2x32 on CPU as a rolled
5-iteration loop, each iteration a separate pass over memory; (2) each 32-bit draw costs a
whole Threefry block (64 bits) with JAX's partitionable Threefry. Here `threefry_bits` is the
same Threefry-2x32 written out as 20 unrolled rounds of elementwise ops (one fused loop; its
bits equal jax.random.bits(key, shape, uint32) exactly, tests/test_dropout.py), and each
32-bit word feeds two elements through 16-bit thresholds, so the rate is exact to 1.5e-5
(0.1 becomes 6554 / 65536 = 0.10001). BENCHMARKS.md ('Optimisations...') has the effect.
Leading axes keep their shapes (bits are drawn as [..., ceil(N/2)] words from per-element
counters), so the draw is partitioned like `x` under a sharded jit.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array
_LEVELS = 1 << 16
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # Salmon et al. 2011, Threefry-2x32


def _rotl(x: Array, d: int) -> Array:
    return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


def threefry2x32(k1: Array, k2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
    """Threefry-2x32 (20 rounds) of counters (x1, x2) under key (k1, k2), all uint32,
    unrolled into elementwise ops that XLA fuses into one loop."""
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            x1 = x1 + x2
            x2 = _rotl(x2, r) ^ x1
        x1 = x1 + ks[(block + 1) % 3]
        x2 = x2 + ks[(block + 2) % 3] + np.uint32(block + 1)
    return x1, x2


def threefry_bits(rng: Array, shape: tuple[int, ...]) -> Array:
    """uint32 `shape`, equal to jax.random.bits(rng, shape, jnp.uint32) for a Threefry key
    (JAX's partitionable scheme: element i hashes the counter (0, i) and xors the halves)."""
    size = math.prod(shape)
    typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    impl = str(jax.random.key_impl(rng)) if typed else "threefry2x32"
    if size >= 2**32 or "threefry" not in impl or not jax.config.jax_threefry_partitionable:
        return jax.random.bits(rng, shape, jnp.uint32)
    data = jax.random.key_data(rng) if typed else rng
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):  # the row-major flat index, axis by axis
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    b1, b2 = threefry2x32(data[0], data[1], jnp.zeros(shape, jnp.uint32), index)
    return b1 ^ b2


def keep_mask(rng: Array, rate: float, shape: tuple[int, ...]) -> Array:
    """bool `shape`, True with probability 1 - round(rate * 2^16) / 2^16."""
    threshold = round(rate * _LEVELS)
    if not shape:
        return (threefry_bits(rng, ()) >> np.uint32(16)) >= threshold
    *lead, n = shape
    words = threefry_bits(rng, (*lead, (n + 1) // 2))
    halves = jax.lax.bitcast_convert_type(words, jnp.uint16)  # [..., ceil(N/2), 2]
    halves = halves.reshape(*lead, 2 * ((n + 1) // 2))[..., :n]
    return halves >= jnp.uint16(threshold)


def effective_rate(rate: float) -> float:
    """The dropout probability actually used for `rate` (a multiple of 2^-16)."""
    return round(rate * _LEVELS) / _LEVELS


def dropout(x: Array, rate: float, rng: Array) -> Array:
    """x * keep / (1 - rate), keep ~ Bernoulli(1 - rate); rate in [0, 1)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate {rate} must be in [0, 1)")
    if effective_rate(rate) == 0.0:
        return x
    scale = jnp.asarray(1.0 / (1.0 - effective_rate(rate)), x.dtype)
    return jnp.where(keep_mask(rng, rate, x.shape), x * scale, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """`dropout` as a module: a drop-in for flax's nn.Dropout (rng collection 'dropout')."""

    rate: float
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(self, x: Array, deterministic: bool = True) -> Array:
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng(self.rng_collection))
