"""The three model families: invariances, counts, configs, dtypes."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tx_jax.model.config import ModelConfig, variant
from tx_jax.model.transformer import (
    DecoderOnly,
    EncoderDecoder,
    count_params,
    make_model,
    shift_right,
)

V = 23


def _cfg(**kw):
    return variant("tiny", vocab_size=V, **kw)


def _tokens(shape, seed=0, low=4):
    return jnp.asarray(np.random.default_rng(seed).integers(low, V, size=shape), jnp.int32)


def _init(model, *args):
    return model.init(jax.random.key(0), *args)


@pytest.mark.parametrize(
    "name,paper",
    [("base", 65e6), ("big", 213e6)],
)
def test_parameter_counts_match_the_paper(name, paper):
    cfg = variant(name, vocab_size=37_000)
    model = EncoderDecoder(cfg)
    shapes = jax.eval_shape(
        model.init, jax.random.key(0), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32)
    )
    n = count_params(shapes["params"])
    print(f"{name}: {n:,} parameters (paper: {paper / 1e6:.0f}M)")
    assert abs(n - paper) / paper < 0.04, n


@pytest.mark.parametrize("positional", ["sinusoidal", "rope", "learned"])
def test_decoder_is_causal(positional):
    cfg = _cfg(positional=positional)
    src, tgt = _tokens((2, 6)), _tokens((2, 7), seed=1)
    model = EncoderDecoder(cfg)
    v = _init(model, src, tgt)
    base = model.apply(v, src, tgt)
    t = 3
    changed = tgt.at[:, t].set((tgt[:, t] + 1 - 4) % (V - 4) + 4)
    out = model.apply(v, src, changed)
    # logits[j] predicts target j from targets < j: positions <= t must not move.
    np.testing.assert_allclose(out[:, : t + 1], base[:, : t + 1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(out[:, t + 1 :], base[:, t + 1 :], atol=1e-4)


def test_language_model_is_causal():
    model = DecoderOnly(_cfg(positional="rope"))
    tgt = _tokens((2, 8))
    v = _init(model, tgt)
    base = model.apply(v, tgt)
    changed = tgt.at[:, 4].set(5 if int(tgt[0, 4]) != 5 else 6)
    out = model.apply(v, changed)
    np.testing.assert_allclose(out[:, :5], base[:, :5], rtol=1e-5, atol=1e-5)
    assert not np.allclose(out[:, 5:], base[:, 5:], atol=1e-4)


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_padding_invariance(norm_position):
    """Appending padding changes no output at real positions (encoder, cross-attn, logits)."""
    cfg = _cfg(norm_position=norm_position)
    model = EncoderDecoder(cfg)
    src, tgt = _tokens((2, 5)), _tokens((2, 4), seed=1)
    v = _init(model, src, tgt)
    src_pad = jnp.pad(src, ((0, 0), (0, 6)))
    tgt_pad = jnp.pad(tgt, ((0, 0), (0, 3)))
    enc = model.apply(v, src, method=model.encode)
    enc_pad = model.apply(v, src_pad, method=model.encode)
    np.testing.assert_allclose(enc_pad[:, :5], enc, rtol=1e-5, atol=1e-5)
    logits = model.apply(v, src, tgt)
    np.testing.assert_allclose(model.apply(v, src_pad, tgt)[:, :4], logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        model.apply(v, src_pad, tgt_pad)[:, :4], logits, rtol=1e-5, atol=1e-5
    )


def test_packed_examples_equal_separate_examples():
    """Two examples packed into one row (segment ids, restarting positions) give the logits
    each gives alone: masks, shift_right and positions all respect the packing."""
    model = EncoderDecoder(_cfg())
    s1, s2 = _tokens((1, 4), 1), _tokens((1, 3), 2)
    t1, t2 = _tokens((1, 3), 3), _tokens((1, 5), 4)
    v = _init(model, s1, t1)
    inputs = jnp.concatenate([s1, s2, jnp.zeros((1, 2), jnp.int32)], 1)
    targets = jnp.concatenate([t1, t2, jnp.zeros((1, 1), jnp.int32)], 1)
    seg = lambda a, b, pad: jnp.array([[1] * a + [2] * b + [0] * pad], jnp.int32)
    pos = lambda a, b, pad: jnp.array([list(range(a)) + list(range(b)) + [0] * pad], jnp.int32)
    packed = model.apply(
        v,
        inputs,
        targets,
        inputs_segmentation=seg(4, 3, 2),
        targets_segmentation=seg(3, 5, 1),
        inputs_positions=pos(4, 3, 2),
        targets_positions=pos(3, 5, 1),
    )
    np.testing.assert_allclose(packed[:, :3], model.apply(v, s1, t1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[:, 3:8], model.apply(v, s2, t2), rtol=1e-5, atol=1e-5)


def test_shift_right():
    t = jnp.array([[5, 6, 7, 8, 9, 0]])
    np.testing.assert_array_equal(shift_right(t, 2), [[2, 5, 6, 7, 8, 9]])
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    np.testing.assert_array_equal(shift_right(t, 2, seg), [[2, 5, 2, 7, 8, 0]])


def test_jit_and_bf16_agrees_with_fp32():
    src, tgt = _tokens((2, 6)), _tokens((2, 5), seed=1)
    m32 = EncoderDecoder(_cfg())
    v = _init(m32, src, tgt)
    m16 = EncoderDecoder(_cfg(dtype="bfloat16"))
    f32 = jax.jit(m32.apply)(v, src, tgt)
    f16 = jax.jit(m16.apply)(v, src, tgt)
    assert f16.dtype == jnp.float32  # logits are returned in float32 for the loss
    leaves = jax.tree_util.tree_leaves(nn.meta.unbox(v["params"]))
    assert all(p.dtype == jnp.float32 for p in leaves)  # parameters stay float32
    rel = np.abs(np.asarray(f16) - np.asarray(f32)).max() / np.abs(np.asarray(f32)).max()
    assert 0 < rel < 3e-2, rel  # bf16 has an 8-bit mantissa: ~1e-2 relative


def test_embedding_sharing_and_tying():
    src, tgt = _tokens((1, 4)), _tokens((1, 4))
    shared = _init(EncoderDecoder(_cfg()), src, tgt)["params"]
    assert "source_embed" in shared and "target_embed" not in shared
    assert "logits_kernel" not in shared["decoder"]
    untied = _init(
        EncoderDecoder(_cfg(share_embeddings=False, tie_output=False, target_vocab_size=V + 7)),
        src,
        tgt,
    )["params"]
    assert untied["target_embed"]["embedding"].value.shape == (V + 7, 64)
    assert untied["decoder"]["logits_kernel"].value.shape == (64, V + 7)
    # tied logits are x E^T: E's scale enters both the input and the output
    m = EncoderDecoder(_cfg())
    v = _init(m, src, tgt)
    doubled = jax.tree_util.tree_map(lambda x: x, nn.meta.unbox(v["params"]))
    doubled["source_embed"]["embedding"] = 2 * doubled["source_embed"]["embedding"]
    assert not np.allclose(m.apply({"params": doubled}, src, tgt), m.apply(v, src, tgt))


def test_every_parameter_has_logical_axis_names():
    for model, args in [
        (EncoderDecoder(_cfg(attention_bias=True)), (_tokens((1, 3)), _tokens((1, 3)))),
        (DecoderOnly(_cfg(positional="learned")), (_tokens((1, 3)),)),
        (DecoderOnly(_cfg(norm="rmsnorm")), (_tokens((1, 3)),)),
    ]:
        params = jax.eval_shape(model.init, jax.random.key(0), *args)["params"]
        for path, leaf in jax.tree_util.tree_leaves_with_path(
            params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
        ):
            assert isinstance(leaf, nn.LogicallyPartitioned), path
            assert len(leaf.names) == leaf.value.ndim, path


def test_model_config_validation_names_the_key():
    with pytest.raises(ValueError, match="unknown model config key.*'d_modle'"):
        ModelConfig.from_config({"d_modle": 512})
    with pytest.raises(ValueError, match="d_model=100 is not divisible by model.num_heads=8"):
        ModelConfig(d_model=100)
    with pytest.raises(ValueError, match="norm_position='middle'"):
        ModelConfig(norm_position="middle")
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_kv_heads=3)
    with pytest.raises(ValueError, match=r"bos_id=32000 must be in \[0, 32000\)"):
        ModelConfig(bos_id=32_000)
    assert ModelConfig(bos_id=0).bos_id == 0  # Marian starts decoding at padding's id
    with pytest.raises(ValueError, match="sinusoid_style='fairseq' needs model.positional"):
        ModelConfig(sinusoid_style="fairseq", positional="rope")
    with pytest.raises(ValueError, match="sinusoid_style='t5'"):
        ModelConfig(sinusoid_style="t5")
    with pytest.raises(ValueError, match="position_offset=-1 must be >= 0"):
        ModelConfig(position_offset=-1)
    with pytest.raises(ValueError, match="position_offset=2 needs model.positional"):
        ModelConfig(position_offset=2, positional="rope")
    with pytest.raises(ValueError, match="activation='swish'"):
        ModelConfig(activation="swish")
    with pytest.raises(ValueError, match="model.decode_beams=2 needs decode=True"):
        ModelConfig(decode_beams=2)
    with pytest.raises(ValueError, match="model.value_head_dim=0 must be positive"):
        ModelConfig(value_head_dim=0)
    with pytest.raises(ValueError, match="variant"):
        variant("huge")
    cfg = ModelConfig.from_config({"d_model": 128, "num_heads": 4}, dropout_rate=0.0)
    assert (cfg.d_model, cfg.dropout_rate, cfg.replace(decode=True).decode) == (128, 0.0, True)


@pytest.mark.parametrize(
    "key, old, new",
    [
        ("attention_impl", "cudnn_native", "cudnn"),  # beaten on an H100 (BENCHMARKS.md)
        ("attention_impl", "cudnn_jax", "cudnn"),  # renamed: jax.nn's call is 'cudnn'
        ("attention_impl", "cudnn_nodbias", "cudnn"),  # never ran on a GPU
        ("dropout_bits", "rbg", "bernoulli"),  # beaten on two H100s
        ("dropout_bits", "hash", "auto"),  # never ran: the platform's timed value
        ("loss_impl", "fused", "auto"),
    ],
)
def test_a_removed_value_in_an_old_config_loads_as_the_value_that_ran(key, old, new):
    """An old checkpoint's config (every field as it was saved, with the fields since removed)
    naming a removed value loads, with one warning naming the key; built directly, the value
    is refused."""
    saved = {f.name: getattr(ModelConfig(), f.name) for f in dataclasses.fields(ModelConfig)}
    del saved["platform"]  # not a config key: set by resolved()
    removed = {"residual_norm": "auto", "ffn_impl": "auto", "num_classes": 0, "pooling": "first"}
    saved.update({key: old, **removed})
    with pytest.warns(UserWarning, match=f"model.{key}={old!r} .*model.{key}={new!r}") as caught:
        cfg = ModelConfig.from_config(ml_collections.ConfigDict(saved))
    assert len(caught) == 1  # the removed fields at their one value are dropped silently
    assert getattr(cfg, key) == new
    for name in removed:
        del saved[name]
    assert cfg == ModelConfig(**{**saved, key: new})
    with pytest.raises(ValueError, match=f"model.{key}={old!r}"):
        ModelConfig(**{key: old})
    with pytest.warns(UserWarning, match="model.ffn_impl is no longer a key"):
        assert ModelConfig.from_config({"ffn_impl": "pallas"}) == ModelConfig()
    with pytest.warns(UserWarning, match="model.num_classes is no longer a key"):
        assert ModelConfig.from_config({"num_classes": 3}) == ModelConfig()


# What 'auto' resolves to per platform: on an accelerator only values that passed their tests
# there and were timed fastest there (docs/design.md, "Implementation choices: one rule").
AUTO = {
    "cpu": {"kernels": "cpu", "dropout_bits": "packed", "loss_impl": "dense"},
    "gpu": {"kernels": "generic", "dropout_bits": "bernoulli", "loss_impl": "dense"},
    "tpu": {"kernels": "generic", "dropout_bits": "bernoulli", "loss_impl": "dense"},
}
# attention 'auto' for: bf16 head dim 64 with 256-token sequences, float32 at 4,096
AUTO_ATTENTION = {"cpu": ("xla", "chunked"), "gpu": ("cudnn", "xla"), "tpu": ("xla", "xla")}


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_auto_resolves_per_platform_to_the_tested_and_timed_values(platform):
    auto = dict.fromkeys(("attention_impl", "kernels", "dropout_bits", "loss_impl"), "auto")
    short = ModelConfig(**auto, dtype="bfloat16").resolved(platform, longest=256)
    long = ModelConfig(**auto).resolved(platform, longest=4096)
    for cfg in (short, long):
        assert cfg.is_resolved and cfg.platform == platform
        assert {k: getattr(cfg, k) for k in AUTO[platform]} == AUTO[platform]
    assert (short.attention_impl, long.attention_impl) == AUTO_ATTENTION[platform]
    # cuDNN's call here takes no dropout; returned weights exist only in 'xla'
    for changed in ({"attention_dropout_rate": 0.1}, {"sow_attention_weights": True}):
        cfg = ModelConfig(**auto, dtype="bfloat16", **changed).resolved(platform, longest=256)
        assert cfg.attention_impl == "xla"
    weights = ModelConfig(**auto, sow_attention_weights=True).resolved(platform, longest=4096)
    assert weights.attention_impl == "xla"
    # a run config's longest train or eval sequence decides 'chunked' on a CPU
    run = {"model": auto, "data": {"max_train_len": 64, "max_eval_len": 4096}, "train": {}}
    got = ModelConfig.of_run(ml_collections.ConfigDict(run), platform).attention_impl
    assert got == AUTO_ATTENTION[platform][1]
    gpu = ModelConfig(**auto, dtype="bfloat16").resolved("cuda", deterministic=True)
    assert (gpu.platform, gpu.attention_impl) == ("gpu", "xla")
    explicit = ModelConfig(attention_impl="chunked", kernels="cpu").resolved(platform)
    assert (explicit.attention_impl, explicit.kernels, explicit.dropout_bits) == (
        "chunked",
        "cpu",
        "bernoulli",
    )
    with pytest.raises(ValueError, match="deterministic mode"):
        ModelConfig(attention_impl="cudnn").resolved(platform, deterministic=True)
    with pytest.raises(ValueError, match="'auto' implementation fields"):
        make_model(ModelConfig(kernels="auto"))


def _decode_step_by_step(cfg, params, src, decoder_inputs):
    """Logits of decoder_inputs [B, L] fed one token at a time through the KV cache."""
    model = EncoderDecoder(cfg.replace(decode=True))
    encoded = EncoderDecoder(cfg).apply({"params": params}, src, method="encode")
    _, init = model.apply(
        {"params": params},
        encoded,
        src,
        jnp.zeros_like(decoder_inputs),
        method="decode",
        mutable=["cache"],
    )
    cache, out = init["cache"], []
    for t in range(decoder_inputs.shape[1]):
        logits, state = model.apply(
            {"params": params, "cache": cache},
            encoded,
            src,
            decoder_inputs[:, t : t + 1],
            method="decode",
            mutable=["cache"],
        )
        cache = state["cache"]
        out.append(logits[:, 0])
    return jnp.stack(out, 1)


@pytest.mark.parametrize(
    "options",
    [
        {},  # the paper's model
        {  # MarianMT's options, its decoder starting at padding's id
            "activation": "silu",
            "sinusoid_style": "marian",
            "logits_bias": True,
            "bos_id": 0,
            "share_embeddings": False,
            "target_vocab_size": V - 3,
            "tie_output": False,
            "attention_bias": True,
            "norm_epsilon": 1e-5,
        },
        {  # M2M100's: pre-LN, fairseq sinusoids from position 2, exact GELU
            "activation": "gelu_exact",
            "sinusoid_style": "fairseq",
            "position_offset": 2,
            "norm_position": "pre",
            "attention_bias": True,
        },
    ],
)
def test_incremental_decoding_equals_teacher_forcing(options):
    """The KV-cache path (positions from the cache counter, offset, start token) gives the
    logits of the full teacher-forced pass, also when the start token is id 0."""
    cfg = _cfg(**options)
    model = EncoderDecoder(cfg)
    src, tgt = _tokens((2, 5)), _tokens((2, 4), seed=1, low=4) % (cfg.output_vocab_size - 4) + 4
    src = src.at[1, 3:].set(0)  # a padded source row
    params = _init(model, src, tgt)["params"]
    params = jax.tree_util.tree_map(
        lambda a: a + 0.01 * jnp.arange(a.size).reshape(a.shape) % 0.3, params
    )
    full = model.apply({"params": params}, src, tgt)
    decoder_inputs = shift_right(tgt, cfg.bos_id)
    np.testing.assert_allclose(
        _decode_step_by_step(cfg, params, src, decoder_inputs), full, rtol=1e-4, atol=1e-3
    )  # logits up to ~10: float32 noise of the cached and the full products
    # decode() with the default segment ids reads a start token 0 as a token, not padding
    encoded = model.apply({"params": params}, src, method="encode")
    direct = model.apply({"params": params}, encoded, src, decoder_inputs, method="decode")
    np.testing.assert_allclose(direct, full, rtol=1e-5, atol=1e-5)


def test_start_token_zero_is_not_padding():
    """With bos_id=0 the first decoder input is id 0; were it masked as padding, position 0's
    self-attention would see nothing and its logits would change with nothing else."""
    from tx_jax.model.transformer import decoder_segment_ids

    inputs = jnp.array([[0, 5, 6, 0, 0], [0, 7, 0, 0, 0]])
    np.testing.assert_array_equal(
        decoder_segment_ids(inputs, 0), [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        decoder_segment_ids(inputs, 2), [[0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    )
    cfg = _cfg(bos_id=0)
    model = EncoderDecoder(cfg)
    s1, s2 = _tokens((1, 4), 1), _tokens((1, 3), 2)
    t1, t2 = _tokens((1, 3), 3), _tokens((1, 5), 4)
    v = _init(model, s1, t1)
    # packed rows: each segment starts at id 0 (shift_right), segment ids say which is which
    inputs = jnp.concatenate([s1, s2, jnp.zeros((1, 2), jnp.int32)], 1)
    targets = jnp.concatenate([t1, t2, jnp.zeros((1, 1), jnp.int32)], 1)
    seg = jnp.array([[1] * 3 + [2] * 5 + [0]], jnp.int32)
    np.testing.assert_array_equal(shift_right(targets, 0, seg)[0, [0, 3]], [0, 0])
    packed = model.apply(
        v,
        inputs,
        targets,
        inputs_segmentation=jnp.array([[1] * 4 + [2] * 3 + [0] * 2]),
        targets_segmentation=seg,
        inputs_positions=jnp.array([[0, 1, 2, 3, 0, 1, 2, 0, 0]]),
        targets_positions=jnp.array([[0, 1, 2, 0, 1, 2, 3, 4, 0]]),
    )
    np.testing.assert_allclose(packed[:, :3], model.apply(v, s1, t1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[:, 3:8], model.apply(v, s2, t2), rtol=1e-5, atol=1e-5)


def test_logits_bias_is_added_to_the_logits():
    cfg = _cfg(logits_bias=True)
    model = EncoderDecoder(cfg)
    src, tgt = _tokens((2, 5)), _tokens((2, 4), seed=1)
    params = _init(model, src, tgt)["params"]
    assert params["decoder"]["logits_bias"].value.shape == (V,)
    bias = jnp.arange(V, dtype=jnp.float32) / V
    moved = jax.tree_util.tree_map(lambda a: a, nn.meta.unbox(params))
    moved["decoder"]["logits_bias"] = bias
    diff = model.apply({"params": moved}, src, tgt) - model.apply({"params": params}, src, tgt)
    np.testing.assert_allclose(diff, jnp.broadcast_to(bias, diff.shape), atol=1e-6)
