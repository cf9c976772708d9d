"""Representation similarity (CKA, cosine, pooling), surface similarity, correlation, the
per-layer encoder representations of a tiny model, and the PNG figures."""

import functools
import math

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest

from tx_jax.analysis import similarity, visualize
from tx_jax.data import synthetic
from tx_jax.data.tokenizer import train_tokenizer
from tx_jax.model.config import variant
from tx_jax.model.positional import sinusoid
from tx_jax.model.transformer import EncoderDecoder

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- linear CKA


def test_cka_of_identical_matrices_is_one(rng):
    x = rng.normal(size=(20, 5))
    assert similarity.linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    wide = rng.normal(size=(6, 40))  # D > N: the Gram form
    assert similarity.linear_cka(wide, wide) == pytest.approx(1.0, abs=1e-12)


def test_cka_of_orthogonal_representations_is_zero():
    # Centred columns [1, -1, 0, 0] and [0, 0, 1, -1]: Y^T X = 0.
    x = np.array([[1.0], [-1.0], [0.0], [0.0]])
    y = np.array([[0.0, 0.0], [0.0, 0.0], [1.0, 2.0], [-1.0, -2.0]])
    assert similarity.linear_cka(x, y) == pytest.approx(0.0, abs=1e-12)
    # Adding a constant per column (centring removes it) changes nothing.
    assert similarity.linear_cka(x + 5.0, y - 3.0) == pytest.approx(0.0, abs=1e-12)


def test_cka_hand_computed_values():
    # 1-D: linear CKA is the squared Pearson correlation. x - mean = [-1, 0, 1], y - mean =
    # [0, -1, 1]: ||y^T x||^2 = 1, ||x^T x|| = ||y^T y|| = 2 -> 1 / 4.
    assert similarity.linear_cka([[1.0], [2.0], [3.0]], [[1.0], [0.0], [2.0]]) == pytest.approx(
        0.25, abs=1e-12
    )
    # X (centred) = the four unit vectors +-e1, +-e2: X^T X = 2 I, ||.||_F = 2 sqrt(2);
    # Y = [1, 0, -1, 0]^T: Y^T Y = 2, Y^T X = [2, 0] -> 4 / (2 sqrt(2) * 2) = 1 / sqrt(2).
    x = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    y = np.array([[1.0], [0.0], [-1.0], [0.0]])
    assert similarity.linear_cka(x, y) == pytest.approx(1 / math.sqrt(2), abs=1e-12)
    assert similarity.linear_cka(y, x) == pytest.approx(1 / math.sqrt(2), abs=1e-12)


def test_cka_invariant_to_rotation_and_isotropic_scaling(rng):
    x, y = rng.normal(size=(30, 6)), rng.normal(size=(30, 4))
    y = y + x[:, :4]  # some shared structure, so CKA is neither 0 nor 1
    base = similarity.linear_cka(x, y)
    assert 0.1 < base < 0.95
    q, _ = np.linalg.qr(rng.normal(size=(6, 6)))  # orthogonal
    assert similarity.linear_cka(x @ q, y) == pytest.approx(base, abs=1e-10)
    assert similarity.linear_cka(3.7 * x, 0.01 * y) == pytest.approx(base, abs=1e-10)
    # ... but not to an anisotropic scaling.
    assert abs(similarity.linear_cka(x * np.arange(1, 7), y) - base) > 1e-3
    # Both computation forms agree (N < D forces the Gram form).
    wide_x, wide_y = rng.normal(size=(5, 30)), rng.normal(size=(5, 20))
    xc, yc = wide_x - wide_x.mean(0), wide_y - wide_y.mean(0)
    feature_form = np.linalg.norm(yc.T @ xc) ** 2 / (
        np.linalg.norm(xc.T @ xc) * np.linalg.norm(yc.T @ yc)
    )
    assert similarity.linear_cka(wide_x, wide_y) == pytest.approx(feature_form, abs=1e-12)


def test_cka_without_variance_is_nan():
    assert math.isnan(similarity.linear_cka(np.ones((4, 2)), np.eye(4)))


# ---------------------------------------------------------------- cosine and pooling


def test_cosines_identical_orthogonal_negated():
    x = np.array([[1.0, 2.0, 0.0], [0.0, 1.0, 1.0]])
    assert similarity.mean_pooled_cosine(x, x) == pytest.approx(1.0)
    assert similarity.mean_pooled_cosine(x, -x) == pytest.approx(-1.0)
    orthogonal = np.array([[-2.0, 1.0, 5.0], [3.0, 1.0, -1.0]])
    np.testing.assert_allclose(similarity.sentence_cosines(x, orthogonal), [0.0, 0.0], atol=1e-12)
    # Per pair: [1, 0] vs [1, 1] -> 1/sqrt(2); [0, 1] vs [0, -1] -> -1; mean (0.7071 - 1) / 2.
    a, b = np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([[1.0, 1.0], [0.0, -1.0]])
    np.testing.assert_allclose(similarity.sentence_cosines(a, b), [1 / math.sqrt(2), -1.0])
    assert similarity.mean_pooled_cosine(a, b) == pytest.approx((1 / math.sqrt(2) - 1) / 2)
    assert similarity.sentence_cosines(np.zeros((1, 2)), a[:1])[0] == 0.0


def test_mean_pool_ignores_padding():
    hidden = np.array(
        [[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]], [[5.0, 6.0], [-7.0, 7.0], [9.0, 9.0]]]
    )
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(similarity.mean_pool(hidden, mask), [[2.0, 3.0], [5.0, 6.0]])
    np.testing.assert_array_equal(similarity.mean_pool(hidden, np.zeros((2, 3))), np.zeros((2, 2)))
    pooled = similarity.mean_pool(jnp.asarray(hidden), jnp.asarray(mask))  # JAX arrays too
    np.testing.assert_allclose(pooled, [[2.0, 3.0], [5.0, 6.0]])


def test_similarity_matrices_shapes_and_values(rng):
    base = [rng.normal(size=(10, 4)) for _ in range(3)]
    reps = {"en": base, "de": [b @ np.diag([2.0, 2, 2, 2]) for b in base], "fr": [-b for b in base]}
    out = similarity.similarity_matrices(reps)
    assert out["languages"] == ["en", "de", "fr"]
    assert out["cka"].shape == out["cosine"].shape == (3, 3, 3)
    np.testing.assert_allclose(out["cka"], np.ones((3, 3, 3)), atol=1e-12)  # scale, sign
    np.testing.assert_allclose(out["cosine"][:, 0, 2], -1.0, atol=1e-12)
    np.testing.assert_allclose(out["cosine"][:, 0, 1], 1.0, atol=1e-12)
    with pytest.raises(ValueError, match="same number"):
        similarity.similarity_matrices({"en": base, "de": base[:2]})


# ---------------------------------------------------------------- surface similarity


def test_char_ngram_overlap():
    assert similarity.char_ngram_overlap("the house", "the house") == 1.0
    assert similarity.char_ngram_overlap("abc", "xyz") == 0.0
    assert similarity.char_ngram_overlap("ab cd", "abcd") == 1.0  # whitespace is removed
    # "ab" vs "ac": 1-grams {a,b} / {a,c}: Jaccard 1/3, Dice 1/2; 2-grams {ab} / {ac}: 0.
    assert similarity.char_ngram_overlap("ab", "ac") == pytest.approx(1 / 6)
    assert similarity.char_ngram_overlap("ab", "ac", metric="dice") == pytest.approx(1 / 4)
    assert similarity.char_ngram_similarity(["ab", "x"], ["ab", "y"]) == pytest.approx(0.5)
    assert similarity.char_ngram_overlap("Ab", "ab", lowercase=True) == 1.0


def test_chrf_and_surface_matrix():
    en = ["the house is small .", "the dog sees two cats ."]
    de = ["das Haus ist klein .", "der Hund sieht zwei Katzen ."]
    assert similarity.chrf_similarity(en, en) == pytest.approx(100.0)
    assert 0.0 <= similarity.chrf_similarity(en, de) < 50.0
    m = similarity.surface_similarity_matrix({"en": en, "de": de, "en2": en})
    assert m.shape == (3, 3) and np.allclose(m, m.T)
    assert m[0, 2] == pytest.approx(100.0) and m[0, 1] < m[0, 2]
    n = similarity.surface_similarity_matrix({"en": en, "de": de}, metric="char_ngram")
    assert n[0, 0] == 1.0 and 0.0 < n[0, 1] < 1.0 and n[0, 1] == n[1, 0]


# ---------------------------------------------------------------- correlation


def test_correlation_known_vectors():
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    c = similarity.correlation(x, [2.0, 4.0, 6.0, 8.0, 10.0])
    assert c["pearson"] == pytest.approx(1.0) and c["spearman"] == pytest.approx(1.0)
    # y = x^2: monotone (Spearman 1); Pearson = 60 / sqrt(10 * 374) by hand.
    c = similarity.correlation(x, [1.0, 4.0, 9.0, 16.0, 25.0])
    assert c["spearman"] == pytest.approx(1.0)
    assert c["pearson"] == pytest.approx(60 / math.sqrt(3740), abs=1e-12)
    assert c["n"] == 5 and 0.0 <= c["pearson_p"] < 0.01
    c = similarity.correlation(x, [5.0, 4.0, 3.0, 1.0, 2.0])  # ranks 5 4 3 1 2
    assert c["spearman"] == pytest.approx(1 - 6 * (16 + 4 + 0 + 9 + 9) / (5 * 24))  # -0.9
    assert math.isnan(similarity.correlation([1.0, 2.0], [3.0, 4.0])["pearson"])
    assert math.isnan(similarity.correlation(x, [1.0] * 5)["spearman"])


def test_off_diagonal_and_pair_labels():
    m = np.arange(9.0).reshape(3, 3)
    np.testing.assert_array_equal(similarity.off_diagonal(m), [1.0, 2.0, 5.0])
    assert similarity.pair_labels(["en", "de", "fr"]) == ["en-de", "en-fr", "de-fr"]


# ---------------------------------------------------------------- encoder representations


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [t for pair in synthetic.generate_corpus(300, seed=0) for t in pair]
    return train_tokenizer(
        texts, 160, tmp_path_factory.mktemp("tok") / "spm.model", user_defined_symbols=["<2de>"]
    )


def _init_encoder(model, key):
    init = jax.jit(functools.partial(model.init, method=model.encode))  # one compilation
    return init(key, jnp.ones((1, 8), jnp.int32))["params"]


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = variant("tiny", vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id)
    model = EncoderDecoder(cfg)
    # Only the encoder's parameters (and the embedding): all that encoding needs.
    return model, _init_encoder(model, jax.random.key(0))


SENTENCES = [pair[0] for pair in synthetic.generate_corpus(6, seed=3, split="validation")]


def test_source_ids_prefix_and_eos(tokenizer):
    tag_id = tokenizer.piece_to_id("<2de>")
    assert tag_id >= 4
    ids, prefix_len = similarity.source_ids(tokenizer, ["the dog"], tag="<2de>")
    assert prefix_len == 1 and ids[0][0] == tag_id and ids[0][-1] == tokenizer.eos_id
    assert ids[0][1:-1] == tokenizer.encode("the dog")
    assert similarity.source_ids(tokenizer, ["the dog"], tag=[tag_id])[0] == ids
    cut, _ = similarity.source_ids(tokenizer, ["the dog sees two cats"], tag="<2de>", max_len=3)
    assert len(cut[0]) == 3 and cut[0][0] == tag_id and cut[0][-1] == tokenizer.eos_id
    with pytest.raises(ValueError, match="not a piece"):
        similarity.source_ids(tokenizer, ["the dog"], tag="<2xx>")


def test_encoder_layer_representations_shapes_and_padding_invariance(model, tokenizer):
    net, params = model
    cfg = net.config
    reps = similarity.encoder_layer_representations(
        net, params, tokenizer, SENTENCES, batch_size=len(SENTENCES), pad_to_multiple=1
    )
    assert len(reps) == cfg.num_encoder_layers + 1
    assert all(r.shape == (len(SENTENCES), cfg.d_model) for r in reps)
    assert all(np.isfinite(r).all() for r in reps)
    assert not np.allclose(reps[0], reps[-1])
    # The shortest sentence alone (no padding) and in a batch padded to a longer length.
    shortest = min(range(len(SENTENCES)), key=lambda i: len(tokenizer.encode(SENTENCES[i])))
    alone = similarity.encoder_layer_representations(
        net, params, tokenizer, [SENTENCES[shortest]], batch_size=1, pad_to_multiple=1
    )
    padded = similarity.encoder_layer_representations(
        net, params, tokenizer, SENTENCES, batch_size=len(SENTENCES), pad_to_multiple=64
    )
    for a, b, c in zip(alone, padded, reps):
        np.testing.assert_allclose(a[0], b[shortest], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-5)
    # Layer 0 with pool='text' is the mean of the pieces' embeddings plus positions.
    ids = tokenizer.encode(SENTENCES[0])
    table = np.asarray(params["source_embed"]["embedding"].unbox())[ids] * math.sqrt(cfg.d_model)
    positions = np.asarray(sinusoid(jnp.arange(len(ids))[None], cfg.d_model))[0]
    np.testing.assert_allclose(reps[0][0], (table + positions).mean(0), rtol=1e-5, atol=1e-5)
    # A prefix tag changes the deeper layers; pool='all' differs from 'text'.
    tagged = similarity.encoder_layer_representations(
        net, params, tokenizer, SENTENCES, tag="<2de>", batch_size=len(SENTENCES)
    )
    assert not np.allclose(tagged[1], reps[1])
    pooled_all = similarity.encoder_layer_representations(
        net, params, tokenizer, SENTENCES, pool="all", batch_size=len(SENTENCES)
    )
    assert not np.allclose(pooled_all[0], reps[0])


def test_encoder_layer_representations_pre_ln_final_norm(tokenizer):
    cfg = variant(
        "tiny", vocab_size=tokenizer.vocab_size, num_encoder_layers=1, norm_position="pre"
    )
    net = EncoderDecoder(cfg)
    params = _init_encoder(net, jax.random.key(1))
    raw = similarity.encoder_layer_representations(net, params, tokenizer, SENTENCES[:2])
    normed = similarity.encoder_layer_representations(
        net, params, tokenizer, SENTENCES[:2], final_norm=True
    )
    np.testing.assert_array_equal(raw[0], normed[0])
    assert not np.allclose(raw[1], normed[1])
    ids = similarity.source_ids(tokenizer, SENTENCES[:1])[0]
    encode = jax.jit(functools.partial(net.apply, method=net.encode))
    encoded = encode({"params": params}, jnp.asarray(ids))[0]
    np.testing.assert_allclose(normed[1][0], np.asarray(encoded)[:-1].mean(0), atol=1e-5)


# ---------------------------------------------------------------- plots


def _check_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and min(image.shape[:2]) >= 150
    assert image[..., :3].std() > 0.05


def test_plots_write_pngs(tmp_path, rng):
    languages = ["en", "de", "fr", "cs"]
    m = rng.uniform(size=(3, 4, 4))
    m = (m + m.transpose(0, 2, 1)) / 2
    surface = m[0] * 50 + rng.uniform(size=(4, 4))
    heat = visualize.plot_similarity_heatmaps(m, languages, tmp_path / "cka.png")
    _check_png(heat)
    scatter = visualize.plot_similarity_vs_surface(m, surface, languages, tmp_path / "vs.png")
    _check_png(scatter)
    one = visualize.plot_similarity_vs_surface(m[1], surface, languages, tmp_path / "one.png")
    _check_png(one)
    with pytest.raises(ValueError, match="language names"):
        visualize.plot_similarity_heatmaps(m, languages[:3], tmp_path / "bad.png")
