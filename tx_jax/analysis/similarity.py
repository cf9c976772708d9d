r"""Representation and surface similarity between languages on parallel sentences: how alike
two languages look to the encoder, per layer, against how alike they look on the page.

Pure functions (NumPy, float64) for both similarities and their correlation; the model side
is `encoder_layer_representations` ([N, M] mean-pooled sentence vectors per encoder depth);
the plots are visualize.py's.

Letters: N parallel sentences (rows aligned across languages), B batch, L source length,
M d_model, D feature width, K languages, G encoder depths (embedding + layers), P pairs.
"""

from __future__ import annotations

import functools
import itertools
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu
import scipy.stats

from tx_jax.data.tokenizer import PAD_ID, Tokenizer
from tx_jax.model.layers import EncoderLayer
from tx_jax.model.transformer import Encoder, EncoderDecoder

PathLike = str | pathlib.Path
POOLS = ("text", "all")
NGRAM_METRICS = ("jaccard", "dice")
SURFACE_METRICS = ("chrf", "char_ngram")


# ---------------------------------------------------------------- representation similarity


def mean_pool(hidden: Any, mask: Any) -> Any:
    """hidden [B, L, M], mask [B, L] (1 = kept) -> [B, M], the mean over kept positions
    (zeros for a row with none); NumPy or JAX arrays (used inside jit)."""
    mask = mask.astype(hidden.dtype)
    counts = mask.sum(axis=1, keepdims=True)  # [B, 1]
    return (hidden * mask[..., None]).sum(axis=1) / (counts + (counts == 0))


def _centre(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected a [N, D] representation matrix, got shape {x.shape}")
    return x - x.mean(axis=0, keepdims=True)


def linear_cka(x: Any, y: Any) -> float:
    """Linear CKA of x [N, D1] and y [N, D2] (rows: the same N inputs), Kornblith et al.
    (2019): ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F) on column-centred X, Y. In [0, 1]; NaN
    when a side has no variance."""
    x, y = _centre(x), _centre(y)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have the same rows: {x.shape[0]} != {y.shape[0]}")
    n, d1, d2 = x.shape[0], x.shape[1], y.shape[1]
    if n * n * (d1 + d2) < n * (d1 * d2 + d1 * d1 + d2 * d2):  # the N x N Gram form is cheaper
        k, l_ = x @ x.T, y @ y.T  # [N, N]
        cross, norm_x, norm_y = (k * l_).sum(), np.linalg.norm(k), np.linalg.norm(l_)
    else:  # the feature form: D1 x D2, D1 x D1, D2 x D2 products
        cross = np.linalg.norm(y.T @ x) ** 2
        norm_x, norm_y = np.linalg.norm(x.T @ x), np.linalg.norm(y.T @ y)
    denominator = norm_x * norm_y
    return float(cross / denominator) if denominator > 0 else math.nan


def sentence_cosines(x: Any, y: Any, *, center: bool = False) -> np.ndarray:
    """Cosine similarity of each parallel pair: x [N, M], y [N, M] -> [N] (0 for a zero
    vector). center=True first removes each side's mean vector (Libovický et al., 2019)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape or x.ndim != 2:
        raise ValueError(f"expected two [N, M] arrays of one shape, got {x.shape}, {y.shape}")
    if center:
        x, y = _centre(x), _centre(y)
    norms = np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
    dots = (x * y).sum(axis=1)
    return np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), 0.0)


def mean_pooled_cosine(x: Any, y: Any, *, center: bool = False) -> float:
    """Mean of `sentence_cosines` of x [N, M], y [N, M]."""
    return float(sentence_cosines(x, y, center=center).mean())


def similarity_matrices(
    reps_by_lang: Mapping[str, Sequence[Any]], *, center_cosine: bool = False
) -> dict[str, Any]:
    """{language: [G arrays [N, M]], the same G and N for each} -> {'languages': [K names],
    'cka': [G, K, K], 'cosine': [G, K, K]} (float64, symmetric)."""
    languages = list(reps_by_lang)
    if not languages:
        raise ValueError("reps_by_lang is empty")
    layers = {
        lang: [np.asarray(r, np.float64) for r in reps] for lang, reps in reps_by_lang.items()
    }
    depths = {len(v) for v in layers.values()}
    shapes = {r.shape[0] for v in layers.values() for r in v}
    if len(depths) != 1 or len(shapes) != 1:
        raise ValueError(
            "every language needs the same number of layers and sentences; got "
            + ", ".join(f"{k}: {len(v)} x {[r.shape for r in v][:1]}" for k, v in layers.items())
        )
    g, k = depths.pop(), len(languages)
    cka, cosine = np.zeros((g, k, k)), np.zeros((g, k, k))
    for layer in range(g):
        for i, j in itertools.combinations_with_replacement(range(k), 2):
            a, b = layers[languages[i]][layer], layers[languages[j]][layer]
            cka[layer, i, j] = cka[layer, j, i] = linear_cka(a, b)
            cosine[layer, i, j] = cosine[layer, j, i] = mean_pooled_cosine(
                a, b, center=center_cosine
            )
    return {"languages": languages, "cka": cka, "cosine": cosine}


# ---------------------------------------------------------------- surface similarity


def char_ngrams(text: str, n: int, *, lowercase: bool = False) -> set[str]:
    """The set of character n-grams of `text` with whitespace removed (as chrF does)."""
    text = "".join(text.split())
    if lowercase:
        text = text.lower()
    return {text[i : i + n] for i in range(len(text) - n + 1)}


def char_ngram_overlap(
    a: str,
    b: str,
    *,
    n_min: int = 1,
    n_max: int = 4,
    metric: str = "jaccard",
    lowercase: bool = False,
) -> float:
    """Jaccard or Dice overlap of two strings' character n-gram sets, averaged over
    n = n_min .. n_max; orders neither string is long enough for are left out (none: 0)."""
    if metric not in NGRAM_METRICS:
        raise ValueError(f"metric={metric!r}; expected one of {NGRAM_METRICS}")
    scores = []
    for n in range(n_min, n_max + 1):
        ga, gb = char_ngrams(a, n, lowercase=lowercase), char_ngrams(b, n, lowercase=lowercase)
        if not ga and not gb:
            continue
        shared = len(ga & gb)
        scores.append(
            shared / len(ga | gb) if metric == "jaccard" else 2 * shared / (len(ga) + len(gb))
        )
    return float(np.mean(scores)) if scores else 0.0


def _check_parallel(texts_a: Sequence[str], texts_b: Sequence[str]) -> None:
    if len(texts_a) != len(texts_b) or not texts_a:
        raise ValueError(
            f"need parallel, non-empty sentence lists: {len(texts_a)} vs {len(texts_b)} sentences"
        )


def char_ngram_similarity(texts_a: Sequence[str], texts_b: Sequence[str], **kwargs: Any) -> float:
    """Mean of `char_ngram_overlap(a_i, b_i, **kwargs)` over parallel sentences, in [0, 1]."""
    _check_parallel(texts_a, texts_b)
    return float(np.mean([char_ngram_overlap(a, b, **kwargs) for a, b in zip(texts_a, texts_b)]))


def chrf_similarity(
    texts_a: Sequence[str], texts_b: Sequence[str], *, symmetric: bool = True
) -> float:
    """Corpus chrF (sacreBLEU's defaults), 0-100, of A's sentences against B's as references;
    chrF is asymmetric, so symmetric=True returns the mean of A->B and B->A."""
    _check_parallel(texts_a, texts_b)
    metric = sacrebleu.metrics.CHRF()
    forward = metric.corpus_score(list(texts_a), [list(texts_b)]).score
    if not symmetric:
        return float(forward)
    backward = metric.corpus_score(list(texts_b), [list(texts_a)]).score
    return float((forward + backward) / 2)


def surface_similarity_matrix(
    texts_by_lang: Mapping[str, Sequence[str]], *, metric: str = "chrf", **kwargs: Any
) -> np.ndarray:
    """{language: N parallel sentences} -> [K, K]: `chrf_similarity` (metric='chrf') or
    `char_ngram_similarity` ('char_ngram') of every pair."""
    if metric not in SURFACE_METRICS:
        raise ValueError(f"metric={metric!r}; expected one of {SURFACE_METRICS}")
    fn = chrf_similarity if metric == "chrf" else char_ngram_similarity
    languages = list(texts_by_lang)
    out = np.zeros((len(languages), len(languages)))
    for i, a in enumerate(languages):
        for j, b in enumerate(languages):
            if metric == "chrf" or j >= i:  # chrF(A, B) may differ from chrF(B, A)
                out[i, j] = fn(texts_by_lang[a], texts_by_lang[b], **kwargs)
            else:
                out[i, j] = out[j, i]
    return out


# ---------------------------------------------------------------- correlation


def off_diagonal(matrix: Any) -> np.ndarray:
    """[K, K] -> [K(K-1)/2]: the entries above the diagonal in row order (`pair_labels`)."""
    m = np.asarray(matrix, np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {m.shape}")
    return m[np.triu_indices(m.shape[0], k=1)]


def pair_labels(languages: Sequence[str]) -> list[str]:
    """'a-b' for each i < j pair, in the order of `off_diagonal`."""
    return [f"{a}-{b}" for a, b in itertools.combinations(languages, 2)]


def correlation(x: Any, y: Any) -> dict[str, float]:
    """Pearson and Spearman correlation of x [P] and y [P] with two-sided p-values -> {'pearson',
    'pearson_p', 'spearman', 'spearman_p', 'n'}; NaN under 3 points or for a constant side."""
    x, y = np.asarray(x, np.float64).ravel(), np.asarray(y, np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same length: {x.size} != {y.size}")
    out = dict.fromkeys(("pearson", "pearson_p", "spearman", "spearman_p"), math.nan)
    out["n"] = int(x.size)
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return out
    pearson = scipy.stats.pearsonr(x, y)
    spearman = scipy.stats.spearmanr(x, y)
    out.update(
        pearson=float(pearson.statistic),
        pearson_p=float(pearson.pvalue),
        spearman=float(spearman.statistic),
        spearman_p=float(spearman.pvalue),
    )
    return out


# ---------------------------------------------------------------- encoder representations


def source_ids(
    tokenizer: Tokenizer,
    sentences: Sequence[str],
    *,
    tag: str | Sequence[int] | None = None,
    max_len: int | None = None,
) -> tuple[list[list[int]], int]:
    """Sentences -> (id lists `prefix + pieces + [EOS]`, as the input pipeline encodes
    sources; prefix length). `tag`: a piece such as '<2de>' or a list of ids. Longer than
    `max_len`: the pieces are cut, keeping the prefix and EOS."""
    if tag is None:
        prefix: list[int] = []
    elif isinstance(tag, str):
        prefix = [tokenizer.piece_to_id(tag)]
        if prefix[0] == tokenizer.unk_id and tag != tokenizer.id_to_piece(tokenizer.unk_id):
            raise ValueError(
                f"the tag {tag!r} is not a piece of the tokenizer's vocabulary "
                "(train it with user_defined_symbols, or pass ids)"
            )
    else:
        prefix = [int(i) for i in tag]
    if PAD_ID in prefix:
        raise ValueError(f"the source prefix {prefix} contains the padding id {PAD_ID}")
    out = []
    for pieces in tokenizer.encode_batch([str(s) for s in sentences]):
        ids = prefix + list(pieces) + [tokenizer.eos_id]
        if max_len is not None and len(ids) > max_len:
            ids = ids[: max_len - 1] + ids[-1:]
        out.append(ids)
    return out, len(prefix)


def _capture(module: nn.Module, method_name: str) -> bool:
    # The embedding output (tokens * sqrt(M) + positions, after dropout: off here) and each
    # EncoderLayer's output; not the layer's helper methods, which return sub-modules.
    if isinstance(module, EncoderLayer):
        return method_name == "__call__"
    return isinstance(module, Encoder) and method_name == "embed_tokens"


@functools.partial(jax.jit, static_argnames=("model", "final_norm"))
def _pooled_layers(
    model: nn.Module, params: Any, tokens: jax.Array, pool_mask: jax.Array, final_norm: bool
) -> jax.Array:
    """tokens [B, L], pool mask [B, L] -> [G, B, M] mean-pooled encoder states."""
    encoded, state = model.apply(
        {"params": params},
        tokens,
        method=model.encode,
        capture_intermediates=_capture,
        mutable=["intermediates"],
    )
    captured = state["intermediates"]["encoder"]
    hidden = [captured["embed_tokens"][0]]
    hidden += [captured[f"layer_{i}"]["__call__"][0] for i in range(len(captured) - 1)]
    if final_norm:
        hidden[-1] = encoded
    mask = pool_mask.astype(jnp.float32)
    return jnp.stack([mean_pool(h.astype(jnp.float32), mask) for h in hidden])


def encoder_layer_representations(
    model: nn.Module,
    params: Any,
    tokenizer: Tokenizer,
    sentences: Sequence[str],
    *,
    tag: str | Sequence[int] | None = None,
    batch_size: int = 64,
    pool: str = "text",
    final_norm: bool = False,
    max_len: int | None = None,
    pad_to_multiple: int = 16,
) -> list[np.ndarray]:
    """Mean-pooled encoder representations of N sentences by an EncoderDecoder: G =
    num_encoder_layers + 1 arrays [N, M] (float32, row n for sentences[n]), no dropout.

    Depth 0 is the embedding layer's output (with positions); depth i is encoder layer i's
    output, the residual stream (pre-LN: before the encoder's final norm, which
    final_norm=True applies to the last depth). `tag`: a source prefix (`source_ids`).
    pool='text' averages over the sentence's own pieces (not the prefix or EOS, which every
    language shares; an empty sentence gives zeros), 'all' over every non-padding token.
    Sources are cut at `max_len` (default the config's); batches of `batch_size` are padded
    to a multiple of `pad_to_multiple` (fewer compilations)."""
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r}; expected one of {POOLS}")
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"expected an EncoderDecoder model, got {type(model)}")
    cfg = model.config.replace(decode=False, remat="none", sow_attention_weights=False)
    model = type(model)(cfg)
    params = nn.meta.unbox(params)
    ids, prefix_len = source_ids(tokenizer, sentences, tag=tag, max_len=max_len or cfg.max_len)
    n = len(ids)
    pooled = np.zeros((cfg.num_encoder_layers + 1, n, cfg.d_model), np.float32)
    order = sorted(range(n), key=lambda i: len(ids[i]))  # similar lengths share a batch
    for start in range(0, n, batch_size):
        rows = order[start : start + batch_size]
        length = -(-max(len(ids[i]) for i in rows) // pad_to_multiple) * pad_to_multiple
        tokens = np.zeros((batch_size, length), np.int32)
        tokens[:, 0] = tokenizer.eos_id  # filler rows: a lone EOS, never an all-padding row
        mask = np.zeros((batch_size, length), np.int32)
        for r, i in enumerate(rows):
            tokens[r, : len(ids[i])] = ids[i]
            text_end = len(ids[i]) - 1 if pool == "text" else len(ids[i])
            mask[r, prefix_len if pool == "text" else 0 : text_end] = 1
        out = _pooled_layers(model, params, jnp.asarray(tokens), jnp.asarray(mask), final_norm)
        pooled[:, rows] = np.asarray(out)[:, : len(rows)]
    return list(pooled)
