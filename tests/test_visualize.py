"""Attention maps (values, padding, causality), PNG figures, training curves and the CLI."""

import functools
import json
import math
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest
import zygote
from helpers import ROOT, tiny_config

from tx_jax.analysis import visualize
from tx_jax.cli import visualize as visualize_cli
from tx_jax.data import synthetic
from tx_jax.data.tokenizer import train_tokenizer
from tx_jax.inference import decoding
from tx_jax.model.config import variant
from tx_jax.model.positional import sinusoid
from tx_jax.model.transformer import EncoderDecoder
from tx_jax.runner.loop import train_and_evaluate

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SOURCE, TARGET = synthetic.generate_corpus(1, seed=5, split="validation")[0]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [t for pair in synthetic.generate_corpus(300, seed=0) for t in pair]
    return train_tokenizer(texts, 160, tmp_path_factory.mktemp("tok") / "spm.model")


@pytest.fixture(scope="module")
def model(tokenizer):
    """A random-init tiny EncoderDecoder (M=64, H=4 with 2 K/V heads, 2 + 2 layers); its
    params stay boxed (logical axis names), which every visualize function accepts."""
    cfg = variant("tiny", vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id, num_kv_heads=2)
    dummy = jnp.ones((1, 8), jnp.int32)
    params = EncoderDecoder(cfg).init(jax.random.key(0), dummy, dummy)["params"]
    return cfg, params


def _check_png(path, min_side=150):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[2] == 4  # RGBA
    assert min(image.shape[:2]) >= min_side
    assert image[..., :3].std() > 0.05  # not a blank canvas
    return image


# ----------------------------------------------------------------- attention weights


def test_attention_weights_rows_padding_and_causality(model):
    cfg, params = model
    inputs = jnp.array([[5, 6, 7, 8, 3, 0, 0], [9, 10, 3, 0, 0, 0, 0]], jnp.int32)
    targets = jnp.array([[11, 12, 3, 0, 0], [13, 3, 0, 0, 0]], jnp.int32)
    w = jax.device_get(visualize.attention_weights(cfg, params, inputs, targets))
    assert w["encoder"].shape == (2, 2, 4, 7, 7)  # [N, B, H, S, S]
    assert w["decoder"].shape == (2, 2, 4, 5, 5)  # [N, B, H, L, L]
    assert w["cross"].shape == (2, 2, 4, 5, 7)  # [N, B, H, L, S]
    for b, (s, t) in enumerate([(5, 3), (3, 2)]):  # real source / target lengths
        enc, dec, cross = w["encoder"][:, b], w["decoder"][:, b], w["cross"][:, b]
        np.testing.assert_allclose(enc[..., :s, :s].sum(-1), 1.0, atol=1e-5)
        np.testing.assert_allclose(dec[..., :t, :t].sum(-1), 1.0, atol=1e-5)
        np.testing.assert_allclose(cross[..., :t, :s].sum(-1), 1.0, atol=1e-5)
        for x, q in ((enc, s), (cross, t)):
            assert (x[..., s:] == 0).all()  # padded keys get exactly nothing
            assert (x[..., q:, :] == 0).all()  # padded queries attend to nothing
        assert (dec[..., t:] == 0).all() and (dec[..., t:, :] == 0).all()
        assert (np.triu(dec[..., :t, :t], k=1) == 0).all()  # causal: lower-triangular
        assert (np.diagonal(dec[..., :t, :t], axis1=-2, axis2=-1) > 0).all()


def test_first_encoder_layer_matches_a_float64_reference(model):
    """Post-LN: layer 0 attends over x0 = E[tokens] sqrt(M) + PE(positions) as it is."""
    cfg, params = model
    tokens = np.array([[5, 6, 7, 8, 3]])
    w = visualize.attention_weights(cfg, params, jnp.asarray(tokens), jnp.asarray([[9, 3]]))
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), nn.meta.unbox(params))
    x = p["source_embed"]["embedding"][tokens[0]] * math.sqrt(cfg.d_model)
    x = x + np.asarray(sinusoid(jnp.arange(5)[None], cfg.d_model), np.float64)[0]
    attn = p["encoder"]["layer_0"]["self_attention"]
    q = np.einsum("sm,mhd->hsd", x, attn["query_kernel"])  # [H, S, D]
    k = np.einsum("sm,mkd->ksd", x, attn["key_kernel"])  # [K, S, D]
    k = np.repeat(k, cfg.num_heads // 2, axis=0)  # query head h reads K/V head h // G
    scores = np.einsum("hqd,hkd->hqk", q, k) / math.sqrt(cfg.d_model // cfg.num_heads)
    ref = np.exp(scores - scores.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(w["encoder"])[0, 0], ref, atol=2e-5)


def test_attention_maps_pieces_shapes_and_padding_invariance(model, tokenizer):
    cfg, params = model
    maps = visualize.attention_maps(cfg, params, tokenizer, SOURCE, TARGET)
    src = tokenizer.encode(SOURCE) + [tokenizer.eos_id]
    tgt = tokenizer.encode(TARGET) + [tokenizer.eos_id]
    S, L = len(src), len(tgt)
    assert maps["encoder"].shape == (2, 4, S, S)
    assert maps["decoder"].shape == (2, 4, L, L)
    assert maps["cross"].shape == (2, 4, L, S)
    assert maps["source_pieces"] == [tokenizer.id_to_piece(i) for i in src]
    assert maps["source_pieces"][-1] == "</s>" and maps["output_pieces"][-1] == "</s>"
    assert maps["target_pieces"] == ["<s>", *maps["output_pieces"][:-1]]  # BOS-shifted
    assert (maps["source"], maps["target"]) == (SOURCE, TARGET)
    for kind in visualize.KINDS:
        np.testing.assert_allclose(maps[kind].sum(-1), 1.0, atol=1e-5)
    assert (np.triu(maps["decoder"], k=1) == 0).all()
    # The same pair inside a padded batch, next to a longer one: the same weights.
    inputs = np.zeros((2, S + 4), np.int32)
    targets = np.zeros((2, L + 3), np.int32)
    inputs[0, :S], targets[0, :L] = src, tgt
    inputs[1], targets[1] = 7, 8
    batched = visualize.attention_weights(cfg, params, jnp.asarray(inputs), jnp.asarray(targets))
    for kind, (q, k) in {"encoder": (S, S), "decoder": (L, L), "cross": (L, S)}.items():
        crop = np.asarray(batched[kind])[:, 0, :, :q, :k]
        np.testing.assert_allclose(crop, maps[kind], atol=1e-6)


def test_attention_maps_translate_greedily_without_a_target(model, tokenizer):
    cfg, params = model
    maps = visualize.attention_maps(cfg, params, tokenizer, SOURCE, max_decode_len=12)
    src = tokenizer.encode(SOURCE) + [tokenizer.eos_id]
    out = np.asarray(decoding.translate_greedy(cfg, params, jnp.asarray([src]), max_decode_len=12))
    ids = [int(i) for i in out[0] if i != 0]
    if tokenizer.eos_id in ids:
        ids = ids[: ids.index(tokenizer.eos_id) + 1]
    assert maps["output_pieces"] == [tokenizer.id_to_piece(i) for i in ids]
    assert maps["target"] == tokenizer.decode(ids)
    assert maps["cross"].shape == (2, 4, len(ids), len(src))


# ------------------------------------------------------------------------ figures


def test_plot_attention_writes_one_png_per_kind_and_layer(model, tokenizer, tmp_path):
    cfg, params = model
    maps = visualize.attention_maps(cfg, params, tokenizer, SOURCE, TARGET)
    plot = functools.partial(visualize.plot_attention, dpi=60)  # small PNGs draw faster
    only = plot(maps, tmp_path / "one", kinds=["cross"], average_heads=False)
    assert [p.name for p in only] == ["cross_layer0.png", "cross_layer1.png"]
    first_layer = {**maps, **{k: maps[k][:1] for k in visualize.KINDS}}  # fewer figures to draw
    paths = plot(first_layer, tmp_path / "maps")
    names = [f"{k}_{s}.png" for k in visualize.KINDS for s in ("layer0", "mean")]
    assert [p.name for p in paths] == names
    sizes = {p.name: _check_png(p).shape[:2] for p in [*only, *paths]}
    # 4 heads side by side: a layer's figure is wider than tall; the mean (1 panel) is not
    h, w = sizes["cross_layer1.png"]
    assert w > 2 * h and sizes["cross_mean.png"][1] < w / 2
    with pytest.raises(ValueError, match="unknown attention kind"):
        plot(maps, tmp_path, kinds=["crosss"])


def test_heatmap_grid_labels_panels_and_colorbar():
    weights = np.random.default_rng(0).dirichlet(np.ones(4), size=(5, 2))  # [G=5, Q=2, K=4]
    fig = visualize.heatmap_grid(
        weights, ["<s>", "▁a"], ["▁x", "y", "z", "</s>"], ["h0", "h1", "h2", "h3", "h4"], title="t"
    )
    panels = [ax for ax in fig.axes if ax.images]  # 5 heatmaps, 3 cells switched off
    (colorbar,) = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(panels) == 5 and len(fig.axes) == 2 * 4 + 1
    assert colorbar.get_ylabel() == "attention weight"
    assert [ax.get_title() for ax in panels] == ["h0", "h1", "h2", "h3", "h4"]
    first = panels[0]
    assert [t.get_text() for t in first.get_xticklabels()] == ["▁x", "y", "z", "</s>"]
    assert [t.get_text() for t in first.get_yticklabels()] == ["<s>", "▁a"]
    assert all(t.get_rotation() == 90 for t in first.get_xticklabels())
    np.testing.assert_array_equal(first.images[0].get_array(), weights[0])
    assert fig.get_suptitle() == "t"
    with pytest.raises(ValueError, match="labels"):
        visualize.heatmap_grid(weights, ["a"], ["x"] * 4, ["h"] * 5, title="t")


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _runs(tmp_path):
    """Run a: 6 steps, then a restart from step 4 (steps 5-6 logged again, elapsed from 0).
    Run b: 4 steps and a final test-split BLEU."""
    a = [{"step": s, "split": "train", "elapsed": float(s), "loss": 10.0 - s} for s in range(1, 7)]
    a.insert(3, {"step": 3, "split": "validation", "elapsed": 3.5, "loss": 8.0, "bleu": 1.0})
    a += [
        {"step": 5, "split": "train", "elapsed": 0.5, "loss": 4.5},
        {"step": 6, "split": "train", "elapsed": 1.0, "loss": 3.5},
        {"step": 6, "split": "validation", "elapsed": 1.5, "loss": 5.0, "bleu": 7.0},
    ]
    b = [{"step": s, "split": "train", "elapsed": 2.0 * s, "loss": 9.0 - s} for s in range(1, 5)]
    b.append({"step": 4, "split": "test", "elapsed": 9.0, "bleu": 3.0, "loss": float("nan")})
    _write_jsonl(tmp_path / "a" / "metrics.jsonl", a)
    _write_jsonl(tmp_path / "b" / "metrics.jsonl", b)
    return tmp_path / "a" / "metrics.jsonl", tmp_path / "b" / "metrics.jsonl"


def test_read_metrics_keeps_the_last_record_of_a_step_and_cumulative_time(tmp_path):
    path_a, _ = _runs(tmp_path)
    records = visualize.read_metrics(path_a)
    train_records = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in train_records] == [9.0, 8.0, 7.0, 6.0, 4.5, 3.5]
    # the restart began after elapsed 6.0: its records are offset by 6.0
    assert [r["elapsed"] for r in train_records] == [1.0, 2.0, 3.0, 4.0, 6.5, 7.0]
    val = [(r["step"], r["bleu"], r["elapsed"]) for r in records if r["split"] == "validation"]
    assert val == [(3, 1.0, 3.5), (6, 7.0, 7.5)]


def test_curves_figure_draws_every_run_and_split(tmp_path):
    path_a, path_b = _runs(tmp_path)
    runs = {"a": visualize.read_metrics(path_a), "b": visualize.read_metrics(path_b)}
    fig = visualize.curves_figure(runs, keys=("loss", "bleu"))
    loss_ax, bleu_ax = fig.axes
    lines = {line.get_label(): line.get_xydata().tolist() for line in loss_ax.get_lines()}
    assert lines == {
        "a (train)": [[1, 9.0], [2, 8.0], [3, 7.0], [4, 6.0], [5, 4.5], [6, 3.5]],
        "a (validation)": [[3, 8.0], [6, 5.0]],
        "b (train)": [[1, 8.0], [2, 7.0], [3, 6.0], [4, 5.0]],  # the NaN test loss is left out
    }
    lines = {line.get_label(): line.get_xydata().tolist() for line in bleu_ax.get_lines()}
    assert lines == {"a (validation)": [[3, 1.0], [6, 7.0]], "b (test)": [[4, 3.0]]}
    timed = visualize.curves_figure(runs, keys=("loss",), x="elapsed")
    assert timed.axes[0].get_xlabel() == "elapsed (s)"
    assert timed.axes[0].get_lines()[0].get_xdata().tolist() == [1.0, 2.0, 3.0, 4.0, 6.5, 7.0]
    a = [dict(r, train_seconds=600.0 * r["step"]) for r in runs["a"]]
    by_training_time = visualize.curves_figure({"a": a}, keys=("bleu",), x="train_seconds")
    assert by_training_time.axes[0].get_xlabel() == "training time (min)"
    assert by_training_time.axes[0].get_lines()[0].get_xydata().tolist() == [[30, 1.0], [60, 7.0]]
    with pytest.raises(ValueError, match="x="):
        visualize.curves_figure(runs, x="time")


def test_plot_curves_writes_a_png(tmp_path):
    paths = _runs(tmp_path)
    out = visualize.plot_curves(paths, tmp_path / "fig" / "curves.png", keys=("loss", "bleu"))
    height, width = _check_png(out).shape[:2]
    assert width > height  # two panels side by side
    with pytest.raises(ValueError, match="label"):
        visualize.plot_curves(paths, tmp_path / "x.png", labels=["same", "same"])


# ---------------------------------------------------------------------------- CLI


def test_cli_on_a_trained_checkpoint(tmp_path, tfds_dir, capsys):
    workdir = tmp_path / "run"
    train_and_evaluate(tiny_config(tfds_dir, **{"train.num_steps": 4}), workdir)
    capsys.readouterr()
    out = tmp_path / "png"
    argv = [
        "visualize",
        "attention",
        f"--workdir={workdir}",
        f"--source={SOURCE}",
        f"--target={TARGET}",
        f"--out={out}",
    ]
    assert visualize_cli.main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    names = [f"{k}_{s}.png" for k in visualize.KINDS for s in ("layer0", "mean")]  # 1 layer
    assert printed[-len(names) :] == [str(out / n) for n in names]
    assert f"target: {TARGET}" in printed
    for name in names:
        _check_png(out / name)
    # one kind, no head mean (the same pair: the compiled forward pass is reused)
    argv = [
        "visualize",
        "attention",
        f"--workdir={workdir}",
        "--step=4",
        f"--source={SOURCE}",
        f"--target={TARGET}",
        f"--out={tmp_path / 'cross'}",
        "--kinds=cross",
        "--noaverage_heads",
    ]
    assert visualize_cli.main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "cross").iterdir()) == ["cross_layer0.png"]
    assert visualize_cli.main(["visualize", "attention", f"--out={out}"]) == 2  # no --workdir
    assert visualize_cli.main(["visualize", "plot", f"--out={out}"]) == 2  # unknown command
    # curves, through the module's entry point
    png = tmp_path / "curves.png"
    proc = zygote.run(
        [
            sys.executable,
            "-m",
            "tx_jax",
            "visualize",
            "curves",
            f"--metrics={workdir / 'metrics.jsonl'}",
            f"--out={png}",
            "--keys=loss,accuracy",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(png)
    _check_png(png)
