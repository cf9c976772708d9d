"""Position information (paper section 3.5): sinusoidal, learned, and rotary (RoPE).

Shape letters: B batch, L length, M model dim, H heads, D head dim.

Pure functions first; the modules only hold parameters or pick the positions. Every
function takes explicit positions, which packing (positions restart in each segment) and
one-token-at-a-time decoding (the position is the cache index) both need.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def sinusoid(
    positions: Array, d_model: int, max_timescale: float = 10_000.0, style: str = "paper"
) -> Array:
    """Fixed sinusoidal encodings of `positions`: [...] integer or float -> [..., M] float32.

    style 'paper': PE(pos, 2i) = sin(pos / 10000^(2i/M)), PE(pos, 2i+1) = cos(...), sin and
    cos interleaved exactly as in the paper's equation (even feature = sin, odd = cos).
    style 'marian': the same frequencies, features [0, M/2) the sines and [M/2, M) the
    cosines (Transformers' MarianSinusoidalPositionalEmbedding).
    style 'fairseq': sines then cosines at frequencies exp(-i ln(10000) / (M/2 - 1)), i < M/2
    (tensor2tensor's; fairseq's and Transformers' M2M100SinusoidalPositionalEmbedding, whose
    position offset is ModelConfig.position_offset).
    """
    if d_model % 2:
        raise ValueError(f"sinusoidal encoding needs an even d_model, got {d_model}")
    if style == "paper":
        two_i = jnp.arange(0, d_model, 2, dtype=jnp.float32)  # 2i = 0, 2, 4, ...
        inv_freq = max_timescale ** (-two_i / d_model)  # [M/2]
        angle = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # [..., M/2]
        pe = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1)  # [..., M/2, 2]
        return pe.reshape(*angle.shape[:-1], d_model)
    angle = jnp.asarray(positions, jnp.float32)[..., None] * _frequencies(
        d_model, max_timescale, style
    )  # [..., M/2]
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


def _frequencies(d_model: int, max_timescale: float, style: str) -> np.ndarray:
    """[M/2] float32 frequencies of the sines-then-cosines styles, rounded once from float64
    ('marian', as Transformers builds its table) or in float32 as torch computes them
    ('fairseq')."""
    half = d_model // 2
    if style == "marian":
        return (max_timescale ** (-2.0 * np.arange(half) / d_model)).astype(np.float32)
    if style == "fairseq":
        step = np.float32(-math.log(max_timescale) / (half - 1))
        return np.exp(np.arange(half, dtype=np.float32) * step).astype(np.float32)
    raise ValueError(f"sinusoid style={style!r}; expected paper, marian or fairseq")


def sinusoidal_table(
    length: int, d_model: int, max_timescale: float = 10_000.0, style: str = "paper"
) -> np.ndarray:
    """The [L, M] table of positions 0..L-1 (NumPy, float32): a constant, not a parameter."""
    return np.asarray(sinusoid(jnp.arange(length), d_model, max_timescale, style))


def rope_frequencies(head_dim: int, base: float = 10_000.0) -> Array:
    """[D/2] rotation frequencies theta_i = base^(-2i/D) (Su et al. 2021, eq. 15)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def apply_rope(x: Array, positions: Array, base: float = 10_000.0) -> Array:
    """Rotate feature pairs (x[2i], x[2i+1]) of x [B, L, H, D] by angle position * theta_i.

    positions: [B, L]. After rotation q_m . k_n depends on m - n only, which is what makes
    RoPE a relative encoding.
    """
    D = x.shape[-1]
    angle = positions[..., None].astype(jnp.float32) * rope_frequencies(D, base)  # [B, L, D/2]
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]  # [B, L, 1, D/2]
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], D // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def default_positions(tokens: Array) -> Array:
    """[B, L] -> [B, L] positions 0..L-1 for unpacked inputs."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1])[None, :], tokens.shape)


class SinusoidalPositionalEncoding(nn.Module):
    """Adds no parameters: positions [B, L] -> [B, L, M] encodings in `dtype`."""

    d_model: int
    max_timescale: float = 10_000.0
    dtype: Any = jnp.float32
    style: str = "paper"

    def __call__(self, positions: Array) -> Array:
        return sinusoid(positions, self.d_model, self.max_timescale, self.style).astype(self.dtype)


class LearnedPositionalEmbedding(nn.Module):
    """A [max_len, M] table (the paper's Table 3 row E); positions [B, L] -> [B, L, M]."""

    max_len: int
    d_model: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, positions: Array) -> Array:
        table = self.param(
            "pos_embedding",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed")),
            (self.max_len, self.d_model),
            self.param_dtype,
        )
        return jnp.take(table, positions, axis=0, mode="clip").astype(self.dtype)
