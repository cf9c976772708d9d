"""Sinusoidal, learned and rotary position encodings."""

import jax
import jax.numpy as jnp
import numpy as np

from tx_jax.model import positional as P


def test_sinusoidal_table_equals_the_formula():
    L, M = 50, 16
    table = P.sinusoidal_table(L, M)
    want = np.zeros((L, M))
    for pos in range(L):
        for i in range(M // 2):
            want[pos, 2 * i] = np.sin(pos / 10000 ** (2 * i / M))
            want[pos, 2 * i + 1] = np.cos(pos / 10000 ** (2 * i / M))
    np.testing.assert_allclose(table, want, atol=2e-5)
    np.testing.assert_array_equal(table[0], np.tile([0.0, 1.0], M // 2))


def test_explicit_positions_index_the_table():
    table = P.sinusoidal_table(20, 8)
    positions = jnp.array([[0, 1, 2, 0, 1], [7, 8, 9, 10, 19]])  # packing restarts at 0
    np.testing.assert_allclose(P.sinusoid(positions, 8), table[np.asarray(positions)], atol=1e-6)
    module = P.SinusoidalPositionalEncoding(8)
    np.testing.assert_allclose(module.apply({}, positions), table[np.asarray(positions)], atol=1e-6)


def test_rope_dot_product_depends_only_on_offset():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

    def score(m, n):
        qm = P.apply_rope(q, jnp.array([[m]]))
        kn = P.apply_rope(k, jnp.array([[n]]))
        return float(jnp.sum(qm * kn))

    for offset in (0, 3, 11):
        scores = [score(m + offset, m) for m in (0, 5, 40, 301)]
        np.testing.assert_allclose(scores, scores[0], rtol=1e-4)
    assert abs(score(3, 0) - score(0, 0)) > 1e-3  # and it does depend on the offset


def test_rope_is_a_rotation():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, 3, 8)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    y = P.apply_rope(x, pos)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=1e-6)  # position 0: identity


def test_learned_embedding_gathers_rows():
    module = P.LearnedPositionalEmbedding(max_len=10, d_model=4)
    pos = jnp.array([[0, 3, 3, 9]])
    params = module.init(jax.random.key(0), pos)
    table = np.asarray(params["params"]["pos_embedding"].value)
    np.testing.assert_array_equal(module.apply(params, pos)[0], table[[0, 3, 3, 9]])


def test_marian_style_is_sines_then_cosines_at_the_paper_frequencies():
    """Transformers' MarianSinusoidalPositionalEmbedding: float64 angles, sin first half."""
    L, M = 300, 16
    j = np.arange(M)
    angle = np.arange(L)[:, None] / np.power(10000, 2 * (j // 2) / M)[None]
    want = np.concatenate([np.sin(angle[:, 0::2]), np.cos(angle[:, 1::2])], 1)
    got = P.sinusoidal_table(L, M, style="marian")
    np.testing.assert_allclose(got, want, atol=3e-5)  # float32 angles up to position 299
    np.testing.assert_allclose(got[:, : M // 2], P.sinusoidal_table(L, M)[:, 0::2], atol=1e-6)


def test_fairseq_style_frequencies_and_offset_row():
    """M2M100's table: exp(-i ln(10000) / (M/2 - 1)), sines then cosines; position p is row p
    (the model adds position_offset = padding_idx + 1 to token indices)."""
    L, M = 40, 10
    half = M // 2
    freq = np.exp(np.arange(half) * -(np.log(10000) / (half - 1)))
    angle = np.arange(L)[:, None] * freq[None]
    want = np.concatenate([np.sin(angle), np.cos(angle)], 1)
    np.testing.assert_allclose(P.sinusoidal_table(L, M, style="fairseq"), want, atol=1e-5)
    try:
        from transformers.models.m2m_100.modeling_m2m_100 import (
            M2M100SinusoidalPositionalEmbedding as HF,
        )
    except ImportError:
        return
    hf = HF.get_embedding(L, M, padding_idx=None).numpy()
    np.testing.assert_allclose(P.sinusoidal_table(L, M, style="fairseq"), hf, atol=2e-6)
