r"""Figures as PNG files (matplotlib's Agg canvas of `Figure`: no pyplot, no display, no global
backend): attention maps, training curves, and similarity.py's language-similarity matrices.
Command line: `tx_jax visualize attention | curves` (tx_jax/cli/visualize.py's USAGE).

Attention is [N, H, Q, K] (layers, heads, queries, keys): encoder [N_enc, H, S, S], decoder
[N_dec, H, L, L], cross [N_dec, H, L, S]; S counts the source pieces and EOS, L the decoder
inputs (BOS, then the target pieces: row t predicts target piece t).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from tx_jax import paths as paths_lib
from tx_jax.analysis.similarity import correlation, off_diagonal, pair_labels
from tx_jax.data.tokenizer import Tokenizer
from tx_jax.inference import decoding, search
from tx_jax.model.config import ModelConfig
from tx_jax.model.transformer import EncoderDecoder

Array = jax.Array
PathLike = str | pathlib.Path
KINDS = ("cross", "encoder", "decoder")
# kind -> (stack, attention module) in the 'intermediates' tree of EncoderDecoder
_SOWN = {
    "encoder": ("encoder", "self_attention"),
    "decoder": ("decoder", "self_attention"),
    "cross": ("decoder", "cross_attention"),
}
_TITLES = {
    "cross": "cross-attention",
    "encoder": "encoder self-attention",
    "decoder": "decoder self-attention",
}
_AXES = {  # kind -> (y label: queries, x label: keys)
    "cross": ("target (decoder input)", "source"),
    "encoder": ("source (query)", "source (key)"),
    "decoder": ("target (query)", "target (key)"),
}


# ---------------------------------------------------------------- attention weights


@functools.partial(jax.jit, static_argnames=("model_config",))
def attention_weights(
    model_config: ModelConfig, params: Any, inputs: Array, targets: Array
) -> dict[str, Array]:
    """Teacher-forced EncoderDecoder pass over inputs [B, S] and targets [B, L] (0-padded)
    -> {'encoder': [N, B, H, S, S], 'decoder': [N, B, H, L, L], 'cross': [N, B, H, L, S]}:
    softmax rows (summing to 1), exactly 0 at padded keys, future positions and padded rows."""
    cfg = model_config.replace(
        sow_attention_weights=True, attention_impl="xla", decode=False, remat="none"
    )
    _, state = EncoderDecoder(cfg).apply(
        {"params": nn.meta.unbox(params)}, inputs, targets, mutable=["intermediates"]
    )
    sown = state["intermediates"]
    out = {}
    for kind, (stack, module) in _SOWN.items():
        n = cfg.num_encoder_layers if stack == "encoder" else cfg.num_decoder_layers
        layers = [sown[stack][f"layer_{i}"][module]["attention_weights"][0] for i in range(n)]
        out[kind] = jnp.stack(layers)
    return out


def attention_maps(
    model_config: ModelConfig,
    params: Any,
    tokenizer: Tokenizer,
    source: str,
    target: str | None = None,
    *,
    max_decode_len: int | None = None,
) -> dict[str, Any]:
    """The attention of one sentence pair (target=None: `source` translated greedily first)
    -> a dict:
      'source', 'target': the texts.
      'source_pieces': S pieces, the source's and '</s>' (key axis of encoder and cross).
      'target_pieces': L pieces, the decoder inputs '<s>', t_1 .. t_{L-1} (query axis of
        decoder and cross; key axis of decoder).
      'output_pieces': L pieces, t_1 .. t_L: what each decoder position predicts.
      'encoder' [N_enc, H, S, S], 'decoder' [N_dec, H, L, L], 'cross' [N_dec, H, L, S]:
        float32 NumPy weights (rows sum to 1).
    """
    eos, bos = tokenizer.eos_id, model_config.bos_id  # BOS: what shift_right feeds
    source_ids = tokenizer.encode(source) + [eos]
    if target is None:
        target_ids = _greedy_ids(model_config, params, source_ids, eos, max_decode_len)
        target = tokenizer.decode(target_ids)
    else:
        target_ids = tokenizer.encode(target) + [eos]
    weights = attention_weights(
        model_config, params, jnp.asarray([source_ids]), jnp.asarray([target_ids])
    )
    weights = {k: np.asarray(jax.device_get(v))[:, 0] for k, v in weights.items()}
    piece = tokenizer.id_to_piece
    return {
        "source": source,
        "target": target,
        "source_pieces": [piece(i) for i in source_ids],
        "target_pieces": [piece(i) for i in [bos, *target_ids[:-1]]],
        "output_pieces": [piece(i) for i in target_ids],
        **weights,
    }


def _greedy_ids(cfg, params, source_ids: list[int], eos: int, max_len: int | None) -> list[int]:
    """Greedy translation of one source -> its ids up to and including EOS (all of them
    when the length limit came first); never empty."""
    tokens = decoding.translate_greedy(
        cfg, params, jnp.asarray([source_ids]), max_decode_len=max_len, eos_id=eos
    )
    ids = [int(t) for t in np.asarray(tokens)[0] if t != search.PAD_ID]
    if eos in ids:
        ids = ids[: ids.index(eos) + 1]
    return ids or [eos]


# ----------------------------------------------------------------- attention figures


def plot_attention(
    maps: dict[str, Any],
    out_dir: PathLike,
    *,
    kinds: Sequence[str] = KINDS,
    average_heads: bool = True,
    dpi: int = 110,
) -> list[pathlib.Path]:
    """`attention_maps`' maps -> the paths written: OUT_DIR/{kind}_layer{i}.png, a panel per
    head, and with average_heads OUT_DIR/{kind}_mean.png, a panel per layer."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown attention kind(s) {unknown}; expected some of {KINDS}")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in kinds:
        weights = np.asarray(maps[kind])  # [N, H, Q, K]
        rows = maps["source_pieces"] if kind == "encoder" else maps["target_pieces"]
        cols = maps["target_pieces"] if kind == "decoder" else maps["source_pieces"]
        N, H = weights.shape[:2]
        figures = [  # (panels [G, Q, K], panel titles, title, file name)
            (heads, [f"layer {i}, head {h}" for h in range(H)], f"layer {i}", f"layer{i}")
            for i, heads in enumerate(weights)
        ]
        if average_heads:
            titles = [f"layer {i}, mean of {H} heads" for i in range(N)]
            figures.append((weights.mean(axis=1), titles, "mean over heads", "mean"))
        for panels, titles, title, name in figures:
            fig = heatmap_grid(
                panels,
                rows,
                cols,
                titles,
                title=f"{_TITLES[kind]}, {title}",
                axis_labels=_AXES[kind],
            )
            paths.append(_save(fig, out_dir / f"{kind}_{name}.png", dpi))
    return paths


def heatmap_grid(
    weights: np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    panel_titles: Sequence[str],
    *,
    title: str,
    axis_labels: tuple[str, str] = ("query", "key"),
    max_cols: int = 4,
) -> Figure:
    """Panels of weights [G, Q, K] (G panels, at most `max_cols` a row) on one colour scale
    [0, max], labelled with Q row and K column pieces (columns rotated), one colorbar."""
    G, Q, K = weights.shape
    if len(row_labels) != Q or len(col_labels) != K:
        raise ValueError(f"{len(row_labels)} x {len(col_labels)} labels for [{Q}, {K}] maps")
    ncols = min(G, max_cols if K <= 30 else 2)
    nrows = math.ceil(G / ncols)
    # Inches per token and label size: 7-point labels on 0.24-inch cells, smaller when long.
    (x_cell, x_font), (y_cell, y_font) = (_cell(K), _cell(Q))
    x_label = 0.3 + x_font / 72 * 0.6 * max(map(len, col_labels), default=1)  # rotated text
    y_label = 0.3 + y_font / 72 * 0.6 * max(map(len, row_labels), default=1)
    width = ncols * (max(2.0, x_cell * K) + 0.3) + y_label + 1.2
    height = nrows * (max(2.0, y_cell * Q) + x_label + 0.4) + 0.5
    # Shared rows: y labels on the first column only; every panel keeps its x labels.
    fig, axes, used = _panels((width, height), G, ncols, sharey=True)
    vmax = max(float(weights.max()), 1e-6)
    for g, ax in enumerate(used):
        image = ax.imshow(weights[g], cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
        ax.set_title(panel_titles[g], fontsize=9)
        ax.set_xticks(range(K), col_labels, rotation=90, fontsize=x_font)
        ax.set_yticks(range(Q), row_labels, fontsize=y_font)
        ax.tick_params(length=0)
        ax.set_xlabel(axis_labels[1], fontsize=8)
        if g % ncols == 0:
            ax.set_ylabel(axis_labels[0], fontsize=8)
    # Colorbar space and gap in inches, whatever the figure's width (fraction, pad: relative).
    fig.colorbar(
        image,
        ax=axes,
        shrink=0.9 if height < 7 else 0.5,
        fraction=min(0.15, 0.6 / width),
        pad=min(0.05, 0.15 / width),
        aspect=25,
        label="attention weight",
    )
    fig.suptitle(title, fontsize=11)
    return fig


def _panels(size: tuple[float, float], g: int, ncols: int, **kw: Any) -> tuple[Figure, Any, list]:
    """A figure of `size` inches with g panels, ncols a row -> (figure, axes grid, the g
    axes in use); the grid's unused axes are turned off."""
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(math.ceil(g / ncols), ncols, squeeze=False, **kw)
    for ax in axes.flat[g:]:
        ax.set_axis_off()
    return fig, axes, list(axes.flat[:g])


def _cell(tokens: int) -> tuple[float, int]:
    """(inches per token, label font size) for an axis of `tokens` labels."""
    return (0.24, 7) if tokens <= 40 else (0.16, 5)


def _save(fig: Figure, path: PathLike, dpi: int) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, format="png")  # Figure() draws with the Agg canvas
    return path


# ------------------------------------------------------------------ training curves


def read_metrics(path: PathLike) -> list[dict[str, Any]]:
    """The records of one metrics.jsonl, sorted by (step, file order); for each (split,
    step) the last record wins (a resumed run logs steps again), and 'elapsed', which restarts
    at 0 with every process, is made cumulative over restarts."""
    records: dict[tuple[str, int], dict] = {}
    offset, last = 0.0, 0.0
    for i, line in enumerate(paths_lib.Path(path).read_text().splitlines()):  # or gs://
        if not line.strip():
            continue
        record = json.loads(line)
        if "elapsed" in record:
            if record["elapsed"] < last:
                offset += last
            last = record["elapsed"]
            record["elapsed"] = record["elapsed"] + offset
        records[(record.get("split", "train"), int(record["step"]))] = {**record, "_order": i}
    ordered = sorted(records.values(), key=lambda r: (r["step"], r["_order"]))
    return [{k: v for k, v in r.items() if k != "_order"} for r in ordered]


def _series(records: list[dict], split: str, key: str, x: str) -> tuple[np.ndarray, np.ndarray]:
    """(x values, key values) of one split, finite numbers only."""
    pairs = [
        (r[x], r[key])
        for r in records
        if r.get("split", "train") == split
        and isinstance(r.get(key), (int, float))
        and math.isfinite(r[key])
    ]
    return np.asarray([p[0] for p in pairs], float), np.asarray([p[1] for p in pairs], float)


def _split_style(split: str) -> dict[str, Any]:
    if split == "train":
        return dict(linestyle="-", linewidth=1.2, alpha=0.85)
    if split == "validation":
        return dict(linestyle="--", marker="o", markersize=3.5, linewidth=1.2)
    return dict(linestyle="none", marker="*", markersize=9)  # test splits: final points


# x axes: the step, wall-clock time since the run's first start (cumulative over restarts),
# or training time (train_seconds: the segments' sum without the pauses between them).
X_AXES = {"step": "step", "elapsed": "elapsed", "train_seconds": "training time"}


def curves_figure(
    runs: dict[str, list[dict]], *, keys: Sequence[str] = ("loss", "bleu"), x: str = "step"
) -> Figure:
    """One panel per key; in each, every run (a colour) and split (train: line, validation:
    dashed with dots, test: stars). runs: label -> records (`read_metrics`)."""
    if x not in X_AXES:
        raise ValueError(f"x={x!r}; expected one of {', '.join(map(repr, X_AXES))}")
    scale, unit = 1.0, ""
    if x != "step":
        longest = max((r.get(x, 0.0) for rs in runs.values() for r in rs), default=0.0)
        scale, unit = (1.0, "s") if longest < 600 else (60.0, "min")
        scale, unit = (3600.0, "h") if longest >= 36_000 else (scale, unit)
    fig = Figure(figsize=(4.8 * len(keys), 3.8), layout="constrained")
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, key in zip(axes, keys, strict=True):
        drawn = 0
        for color, (label, records) in enumerate(runs.items()):
            splits = sorted({r.get("split", "train") for r in records}, key=_split_rank)
            for split in splits:
                xs, ys = _series(records, split, key, x)
                if len(xs):
                    name = split if len(runs) == 1 else f"{label} ({split})"
                    ax.plot(
                        xs / scale, ys, color=f"C{color % 10}", label=name, **_split_style(split)
                    )
                    drawn += 1
        ax.set_title(key)
        ax.set_xlabel(X_AXES[x] + (f" ({unit})" if unit else ""))
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(
                0.5, 0.5, f"no {key!r} records", ha="center", va="center", transform=ax.transAxes
            )
    return fig


def _split_rank(split: str) -> tuple[int, str]:
    return ({"train": 0, "validation": 1}.get(split, 2), split)


def plot_curves(
    metrics: PathLike | Sequence[PathLike],
    out_png: PathLike,
    *,
    keys: Sequence[str] = ("loss", "bleu"),
    labels: Sequence[str] | None = None,
    x: str = "step",
    dpi: int = 110,
) -> pathlib.Path:
    """Training curves of one or more runs (their metrics.jsonl files) -> out_png; labels
    default to each file's directory name (its path if names repeat); x: one of X_AXES."""
    paths = [metrics] if isinstance(metrics, (str, pathlib.Path)) else list(metrics)
    paths = [paths_lib.Path(p) for p in paths]  # local or gs://
    if labels is None:
        labels = [p.parent.name or str(p) for p in paths]
        if len(set(labels)) < len(labels):
            labels = [str(p.parent) for p in paths]
    if len(labels) != len(paths) or len(set(labels)) < len(labels):
        raise ValueError(f"need one distinct label per metrics file: {labels} for {paths}")
    runs = {label: read_metrics(p) for label, p in zip(labels, paths, strict=True)}
    return _save(curves_figure(runs, keys=keys, x=x), out_png, dpi)


# ------------------------------------------------------------- similarity matrices


def _layer_titles(g: int) -> list[str]:
    return ["layer 0 (embeddings)"] + [f"layer {i}" for i in range(1, g)]


def _as_stack(matrices: Any) -> np.ndarray:
    m = np.asarray(matrices, np.float64)
    m = m[None] if m.ndim == 2 else m
    if m.ndim != 3 or m.shape[1] != m.shape[2]:
        raise ValueError(f"expected [K, K] or [G, K, K] matrices, got shape {m.shape}")
    return m


def plot_similarity_heatmaps(
    matrices: Any,
    languages: Sequence[str],
    path: PathLike,
    *,
    metric: str = "linear CKA",
    panel_titles: Sequence[str] | None = None,
    title: str | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    max_cols: int = 4,
    dpi: int = 110,
) -> pathlib.Path:
    """One PNG -> its path: a language x language heatmap per layer of matrices [G, K, K] (or
    one [K, K]), cells annotated, one colour scale (default: the data's range)."""
    m = _as_stack(matrices)
    g, k = m.shape[0], m.shape[1]
    if len(languages) != k:
        raise ValueError(f"{len(languages)} language names for {k} x {k} matrices")
    titles = list(panel_titles) if panel_titles is not None else _layer_titles(g)
    finite = m[np.isfinite(m)]
    lo = vmin if vmin is not None else (float(finite.min()) if finite.size else 0.0)
    hi = vmax if vmax is not None else (float(finite.max()) if finite.size else 1.0)
    hi = hi if hi > lo else lo + 1e-6
    ncols = min(g, max_cols)
    side = max(2.4, 0.5 * k + 1.0)
    size = (ncols * side + 1.2, math.ceil(g / ncols) * side + 0.6)
    fig, axes, used = _panels(size, g, ncols)
    font = 8 if k <= 8 else 6
    for p, ax in enumerate(used):
        image = ax.imshow(m[p], cmap="viridis", vmin=lo, vmax=hi)
        for i, j in itertools.product(range(k), range(k)):
            shade = (m[p, i, j] - lo) / (hi - lo) if np.isfinite(m[p, i, j]) else 0.0
            ax.text(
                j,
                i,
                f"{m[p, i, j]:.2f}",
                ha="center",
                va="center",
                fontsize=font,
                color="black" if shade > 0.6 else "white",
            )
        ax.set_xticks(range(k), languages, fontsize=8)
        ax.set_yticks(range(k), languages, fontsize=8)
        ax.tick_params(length=0)
        ax.set_title(titles[p], fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.8, label=metric)
    fig.suptitle(title or f"{metric} between languages, by encoder layer", fontsize=11)
    return _save(fig, path, dpi)


def _format_correlation(c: Mapping[str, float]) -> str:
    return f"Pearson r={c['pearson']:.2f}, Spearman ρ={c['spearman']:.2f} (n={c['n']})"


def plot_similarity_vs_surface(
    representation: Any,
    surface: Any,
    languages: Sequence[str],
    path: PathLike,
    *,
    representation_label: str = "linear CKA",
    surface_label: str = "chrF",
    panel_titles: Sequence[str] | None = None,
    title: str | None = None,
    max_cols: int = 4,
    dpi: int = 110,
) -> pathlib.Path:
    """One PNG -> its path: per layer of representation [G, K, K] (or one [K, K]), a scatter
    of its language pairs, surface similarity [K, K] on x, with `correlation` in the title."""
    rep, surf = _as_stack(representation), np.asarray(surface, np.float64)
    g, k = rep.shape[0], rep.shape[1]
    if surf.shape != (k, k) or len(languages) != k:
        raise ValueError(f"surface {surf.shape}, {len(languages)} languages for [{g}, {k}, {k}]")
    xs, labels = off_diagonal(surf), pair_labels(languages)
    titles = list(panel_titles) if panel_titles is not None else _layer_titles(g)
    ncols = min(g, max_cols)
    fig, _, used = _panels((ncols * 3.6 + 0.4, math.ceil(g / ncols) * 3.4 + 0.6), g, ncols)
    for p, ax in enumerate(used):
        ys = off_diagonal(rep[p])
        stats = correlation(xs, ys)
        ax.scatter(xs, ys, s=24, color="tab:blue")
        for x, y, label in zip(xs, ys, labels):
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.set_title(f"{titles[p]}\n{_format_correlation(stats)}", fontsize=8)
        ax.set_xlabel(surface_label, fontsize=8)
        ax.set_ylabel(representation_label, fontsize=8)
        ax.grid(alpha=0.3)
    if title is None:
        title = f"{representation_label} against {surface_label}, per language pair"
        if g == 1:
            title += f": {_format_correlation(correlation(xs, off_diagonal(rep[0])))}"
    fig.suptitle(title, fontsize=10)
    return _save(fig, path, dpi)
