"""Dropout's masks (Srivastava et al. 2014; the paper's section 5.4) from cheap random bits.

    keep_mask(rng, rate, shape): True with probability 1 - rate, the rate rounded to a multiple
    of 2^-16 (effective_rate); kernels.dropout(x, rate, rng, 'packed') applies it.

Two things make jax.random.bernoulli slow on a CPU, where the dropout masks of a small
Transformer cost more than its attention: (1) JAX lowers Threefry-2x32 on CPU as a rolled
5-iteration loop, each iteration a separate pass over memory; (2) each 32-bit draw costs a
whole Threefry block (64 bits) with JAX's partitionable Threefry. Here `threefry_bits` is the
same Threefry-2x32 written out as 20 unrolled rounds of elementwise ops (one fused loop; its
bits equal jax.random.bits(key, shape, uint32) exactly, tests/test_dropout.py). The masks
keep both 32-bit words of each block and split each word into two 16-bit draws, so one
block serves four elements and the rate is exact to 1.5e-5 (0.1 becomes 6554 / 65536 =
0.10001). benchmarks/HISTORY.md ('Optimisations...') has the effect. Leading axes keep their shapes
(blocks are drawn as [..., ceil(N/4)] from per-element counters), so the draw is partitioned
like `x` under a sharded jit. The module (`Dropout`) and the choice between these masks and
jax.random's are in kernels.py.
"""

from __future__ import annotations

import math

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


def _threefry_words(rng: Array, shape: tuple[int, ...]) -> tuple[Array, Array] | None:
    """Both uint32 output words of Threefry-2x32 on the counters (0, i), i the row-major index
    into `shape` (JAX's partitionable scheme), or None where that scheme does not apply (a
    non-Threefry key, jax_threefry_partitionable off, 2^32 or more elements)."""
    typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
    impl = str(jax.random.key_impl(rng)) if typed else "threefry2x32"
    if math.prod(shape) >= 2**32 or "threefry" not in impl:
        return None
    if not jax.config.jax_threefry_partitionable:
        return None
    data = jax.random.key_data(rng) if typed else rng
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):  # the row-major flat index, axis by axis
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    return threefry2x32(data[0], data[1], jnp.zeros(shape, jnp.uint32), index)


def threefry_bits(rng: Array, shape: tuple[int, ...]) -> Array:
    """uint32 `shape`, equal to jax.random.bits(rng, shape, jnp.uint32) for a Threefry key
    (JAX's partitionable scheme: element i hashes the counter (0, i) and xors the halves)."""
    words = _threefry_words(rng, shape)
    if words is None:
        return jax.random.bits(rng, shape, jnp.uint32)
    return words[0] ^ words[1]


def keep_mask(rng: Array, rate: float, shape: tuple[int, ...]) -> Array:
    """bool `shape`, True with probability 1 - round(rate * 2^16) / 2^16.

    Four elements per Threefry block: both 32-bit output words of the block for counter
    (0, j) are kept (not xored together as jax.random.bits does), and each word gives two
    16-bit draws, so elements 4j .. 4j+3 of a row come from block j.
    """
    threshold = round(rate * _LEVELS)
    if not shape:
        return (threefry_bits(rng, ()) >> np.uint32(16)) >= threshold
    *lead, n = shape
    blocks = (*lead, (n + 3) // 4)
    words = _threefry_words(rng, blocks)
    if words is None:
        bits = jax.random.bits(rng, (*blocks, 2), jnp.uint32)
        words = bits[..., 0], bits[..., 1]
    # Draw d = 2w + h of block j is half h (low 16 bits first) of word w. Picked with an iota
    # and shifts, one fused elementwise loop; stacking the words and bitcasting them to uint16
    # (the same bits) is slower and needs more step temporaries (benchmarks/HISTORY.md).
    full = (*blocks, 4)
    d = lax.broadcasted_iota(jnp.uint32, full, len(full) - 1)
    word = jnp.where(d < 2, words[0][..., None], words[1][..., None])
    half = (word >> ((d & np.uint32(1)) * np.uint32(16))) & np.uint32(0xFFFF)
    return (half >= np.uint32(threshold)).reshape(*lead, 4 * blocks[-1])[..., :n]


def effective_rate(rate: float) -> float:
    """The dropout probability actually used for `rate` (a multiple of 2^-16)."""
    return round(rate * _LEVELS) / _LEVELS
