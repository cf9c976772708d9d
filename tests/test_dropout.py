"""tx_jax.ops.dropout: unrolled Threefry bits equal JAX's, and the packed masks' statistics
(through kernels.dropout, the one dropout function)."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.ops import dropout as D
from tx_jax.ops import kernels as K


def test_threefry_known_answers():
    """Random123's known-answer vectors for Threefry-2x32 with 20 rounds."""
    cases = [
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ]
    for key, count, expected in cases:
        u = lambda v: jnp.asarray(v, jnp.uint32)  # noqa: E731
        out = D.threefry2x32(u(key[0]), u(key[1]), u(count[0]), u(count[1]))
        assert tuple(int(x) for x in out) == expected


@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 7), (2, 3, 5)])
def test_bits_equal_jax_random_bits(shape):
    keys = [jax.random.key(3), jax.random.PRNGKey(7), jax.random.fold_in(jax.random.key(1), 9)]
    for key in keys:
        ours = jax.jit(lambda k: D.threefry_bits(k, shape))(key)
        np.testing.assert_array_equal(ours, jax.random.bits(key, shape, jnp.uint32))


def test_dropout_rate_and_scale():
    x = jnp.ones((64, 33, 65))  # odd trailing size: the 16-bit halves are trimmed
    out = np.asarray(K.dropout(x, 0.1, jax.random.key(0), "packed"))
    kept = out != 0
    assert abs(1 - kept.mean() - 0.1) < 0.003  # 137k draws: 3 sigma is ~0.0024
    np.testing.assert_allclose(out[kept], 1 / (1 - D.effective_rate(0.1)), rtol=1e-6)
    assert abs(out.mean() - 1.0) < 0.01  # unbiased
    assert D.effective_rate(0.1) == 6554 / 65536


def test_dropout_is_a_function_of_the_key():
    x = jnp.ones((8, 16))
    a, b = (K.dropout(x, 0.5, jax.random.key(k), "packed") for k in (1, 1))
    c = K.dropout(x, 0.5, jax.random.key(2), "packed")
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()
    # the four elements one Threefry block serves are not tied together
    kept = np.asarray(K.dropout(jnp.ones((4096, 4)), 0.5, jax.random.key(3), "packed")) != 0
    for i in range(4):
        for j in range(i + 1, 4):
            assert abs((kept[:, i] == kept[:, j]).mean() - 0.5) < 0.05, (i, j)


def test_keep_mask_layout_four_draws_per_threefry_block():
    """Element 4j + 2w + h of a row is 16-bit half h (little end first) of output word w of
    the Threefry block for counter (0, row * blocks + j), compared with the known-answer-
    tested threefry2x32; a trailing size that is not a multiple of 4 is trimmed."""
    key = jax.random.key(7)
    shape, rate = (3, 10), 0.5
    mask = np.asarray(D.keep_mask(key, rate, shape))
    k1, k2 = (np.uint32(v) for v in np.asarray(jax.random.key_data(key)))
    blocks = (shape[1] + 3) // 4
    threshold = round(rate * 65536)
    for r in range(shape[0]):
        for c in range(shape[1]):
            j, w, h = c // 4, (c % 4) // 2, c % 2
            counter = np.uint32(r * blocks + j)
            words = D.threefry2x32(k1, k2, np.uint32(0), counter)
            half = (int(words[w]) >> (16 * h)) & 0xFFFF
            assert mask[r, c] == (half >= threshold), (r, c)


def _reference_mask(words: tuple[np.ndarray, np.ndarray], n: int, rate: float) -> np.ndarray:
    """NumPy: draws 4j .. 4j+3 of a row are (w0 lo, w0 hi, w1 lo, w1 hi) of block j."""
    w0, w1 = (np.asarray(w, np.uint32) for w in words)
    halves = np.stack([w0 & 0xFFFF, w0 >> 16, w1 & 0xFFFF, w1 >> 16], axis=-1)
    halves = halves.reshape(*w0.shape[:-1], 4 * w0.shape[-1])[..., :n]
    return halves >= round(rate * 65536)


@pytest.mark.parametrize("shape", [(64, 33, 65), (2, 3, 7, 9), (5,), (4, 1), (8, 4, 32, 32)])
def test_keep_mask_matches_the_layout_at_any_shape(shape):
    """The vectorised form of the layout test above, over shapes with every trailing size
    modulo 4 (the stream is fixed: a change would change every run's dropout)."""
    key, rate = jax.random.fold_in(jax.random.key(11), 5), 0.3
    *lead, n = shape
    blocks = (*lead, (n + 3) // 4)
    k1, k2 = (np.uint32(v) for v in np.asarray(jax.random.key_data(key)))
    counters = np.arange(np.prod(blocks), dtype=np.uint32).reshape(blocks)
    words = D.threefry2x32(k1, k2, np.zeros_like(counters), counters)
    expected = _reference_mask(words, n, rate)
    np.testing.assert_array_equal(jax.jit(lambda k: D.keep_mask(k, rate, shape))(key), expected)


def test_keep_mask_fallback_for_other_key_types():
    """A non-Threefry key draws its words with jax.random.bits([..., blocks, 2]); the layout
    is the same."""
    key, rate, shape = jax.random.key(4, impl="unsafe_rbg"), 0.25, (6, 13)
    bits = np.asarray(jax.random.bits(key, (6, 4, 2), jnp.uint32))
    expected = _reference_mask((bits[..., 0], bits[..., 1]), 13, rate)
    np.testing.assert_array_equal(D.keep_mask(key, rate, shape), expected)
    assert 0.15 < 1 - expected.mean() < 0.35


def test_zero_rate_and_bad_rate():
    x = jnp.arange(6.0)
    assert K.dropout(x, 0.0, jax.random.key(0), "packed") is x
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        K.dropout(x, 1.0, jax.random.key(0), "packed")


def test_module_is_inactive_when_deterministic():
    x = jnp.ones((4, 8))
    module = K.Dropout(0.5, bits="packed")
    np.testing.assert_array_equal(module.apply({}, x, deterministic=True), x)
    out = module.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(0)})
    assert set(np.unique(np.asarray(out))) <= {0.0, 2.0}
    with pytest.raises(flax.errors.InvalidRngError):  # no dropout key: an error, as in flax
        module.apply({}, x, deterministic=False)
    assert isinstance(module, nn.Module)
