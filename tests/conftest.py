"""Shared test setup: CPU, fast compiles, and a float64 NumPy attention reference."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Compile time dominates these tiny models; XLA's optimisation passes buy nothing here, and
# the persistent cache lets the many tiny training runs share their compilations.
jax.config.update("jax_disable_most_optimizations", True)
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get(
        "TX_JAX_TEST_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")
    ),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def reference_attention(q, k, v, mask=None, bias=None):
    """float64 NumPy softmax(q k^T / sqrt(D) + bias) v; q [B,L,H,D], k/v [B,S,K,D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, L, H, D = q.shape
    K = k.shape[2]
    k = np.repeat(k, H // K, axis=2)
    v = np.repeat(v, H // K, axis=2)
    s = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(D)
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask), s.shape)
        s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    w = np.where(denom > 0, p / np.where(denom > 0, denom, 1.0), 0.0)
    return np.einsum("bhls,bshd->blhd", w, v), w


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """One TFDS data dir per test session: the tiny synthetic corpus is prepared once."""
    return tmp_path_factory.getbasetemp() / "tfds"
