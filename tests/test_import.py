"""Importing Transformers' MarianMT and M2M100 checkpoints (interop/marian.py, m2m100.py).

Tiny random checkpoints are built here with transformers' own classes and written with its
`save_pretrained` (no downloads). Every bias, LayerNorm gain, final_logits_bias and
embedding row (padding's included) is randomised first, so that a wrong mapping cannot hide
behind zeros and ones. Asserted: tx_jax's teacher-forced log-probabilities equal
transformers' (float32, a padded batch of pairs of different lengths), greedy and beam-4
decoding (length_penalty_kind='hf') equal `generate`, export(import(x)) reproduces x bit for
bit, and each refusal names what it refuses.
"""

from __future__ import annotations

import copy
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from tx_jax.interop import pretrained  # noqa: E402
from tx_jax.interop.weights import ExportError  # noqa: E402
from tx_jax.model.config import ModelConfig  # noqa: E402
from tx_jax.model.transformer import EncoderDecoder  # noqa: E402

SMALL = dict(
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=24,
    decoder_ffn_dim=24,
    max_position_embeddings=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)
V = 40  # source vocabulary
V_T = 33  # Marian's separate decoder vocabulary


def _marian(activation, *, shared=True, tied=True, scale=True, decoder_layers=2):
    # shared=True with tied=False is not a case: transformers 5 then keeps three unequal
    # embeddings (shared, encoder's, decoder's); import refuses it by name (test below).
    v_t = V if shared else V_T
    pad = v_t - 1  # OPUS-MT: EOS 0, <unk> 1, pad last
    return transformers.MarianConfig(
        vocab_size=V,
        decoder_vocab_size=v_t,
        share_encoder_decoder_embeddings=shared,
        tie_word_embeddings=tied,
        activation_function=activation,
        scale_embedding=scale,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        **dict(SMALL, decoder_layers=decoder_layers),
    )


def _m2m100(activation="relu", decoder_layers=2):
    # Untied M2M100 (tie_word_embeddings=False) is not a case here: transformers 5 then keeps
    # three unequal embeddings (shared, encoder's, decoder's), which import refuses by name.
    return transformers.M2M100Config(
        vocab_size=V,
        activation_function=activation,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        **dict(SMALL, decoder_layers=decoder_layers),
    )


# One case of each family has two decoder layers (a second layer's tensors mapped, the
# decoding tests' caches per layer); the others one, which the decoding tests (compilation:
# most of this file's time) compile faster: what those cases vary (activation, tying,
# vocabularies, search settings) does not depend on the depth.
CASES = {
    "marian-tied-swish": lambda: _marian("swish"),
    "marian-untied-relu": lambda: _marian(
        "relu", shared=False, tied=False, scale=False, decoder_layers=1
    ),
    "marian-tied-gelu": lambda: _marian("gelu", decoder_layers=1),
    "marian-untied-swish": lambda: _marian("swish", shared=False, tied=False, decoder_layers=1),
    "marian-separate-tied-gelu_new": lambda: _marian("gelu_new", shared=False, decoder_layers=1),
    "m2m100-relu": lambda: _m2m100(),
    "m2m100-gelu": lambda: _m2m100("gelu", decoder_layers=1),
}


def _randomise(model, seed=0):
    """Every parameter and buffer that initialises to zeros or ones gets random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name or "shared" in name or "lm_head" in name:
                p.copy_(0.5 * noise)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=g))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    """(HF model, its directory's state dict (numpy), its config.json dict)."""
    config = CASES[request.param]()
    cls = (
        transformers.MarianMTModel
        if config.model_type == "marian"
        else transformers.M2M100ForConditionalGeneration
    )
    torch.manual_seed(0)
    model = _randomise(cls(config).eval())
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    state = safetensors_numpy.load_file(str(out / "model.safetensors"))
    hf_config = json.loads((out / "config.json").read_text())
    return model, state, hf_config


@pytest.fixture(scope="module")
def imported(checkpoint):
    _, state, hf_config = checkpoint
    fields, params = pretrained.import_state_dict(state, hf_config)
    return ModelConfig(**fields), jax.tree.map(jnp.asarray, params)


def _pairs(hf_config, seed=0):
    """Source and target ids (HF numbering), EOS-terminated, right-padded with HF's pad, of
    lengths that differ across the batch; the HF ids of special tokens never occur inside."""
    rng = np.random.default_rng(seed)
    pad, eos = hf_config["pad_token_id"], hf_config["eos_token_id"]
    v_t = hf_config.get("decoder_vocab_size") or hf_config["vocab_size"]

    def batch(lengths, vocab):
        rows = np.full((len(lengths), max(lengths) + 1), pad, np.int64)
        for i, n in enumerate(lengths):
            rows[i, :n] = rng.integers(4, vocab - 1, n)
            rows[i, n] = eos
        return rows

    return batch([7, 3, 5, 1], hf_config["vocab_size"]), batch([4, 6, 2, 5], v_t)


def _hf_log_probs(model, hf_config, src, tgt):
    pad, start = hf_config["pad_token_id"], hf_config["decoder_start_token_id"]
    decoder_inputs = np.concatenate([np.full((len(tgt), 1), start), tgt[:, :-1]], 1)
    with torch.no_grad():
        logits = model(
            input_ids=torch.as_tensor(src),
            attention_mask=torch.as_tensor(src != pad).long(),
            decoder_input_ids=torch.as_tensor(decoder_inputs),
        ).logits
    return torch.log_softmax(logits.double(), -1).numpy()  # [B, L, V_t], HF ids


def test_teacher_forced_log_probs_equal_transformers(checkpoint, imported):
    model, _, hf_config = checkpoint
    cfg, params = imported
    src, tgt = _pairs(hf_config)
    perm = pretrained.vocab_permutation(hf_config)
    perm_t = pretrained.vocab_permutation(hf_config, target=True)
    want = _hf_log_probs(model, hf_config, src, tgt)[..., perm_t]  # columns in tx ids
    inputs, targets = jnp.asarray(perm[src]), jnp.asarray(perm_t[tgt])  # HF pad -> 0
    assert int(inputs[1, -1]) == 0 and int(targets[2, -1]) == 0
    logits = EncoderDecoder(cfg).apply({"params": params}, inputs, targets)
    got = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)
    real = np.asarray(targets) != 0
    rel = np.abs(got - want)[real] / np.abs(want)[real]
    print(f"max relative difference of log-probabilities: {rel.max():.2e}")
    assert rel.max() < 1e-4
    token = np.take_along_axis(got, np.asarray(targets)[..., None], -1)[..., 0]
    hf_token = np.take_along_axis(want, np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose((token * real).sum(1), (hf_token * real).sum(1), rtol=1e-4)


def test_export_of_import_reproduces_the_checkpoint(checkpoint, imported):
    _, state, hf_config = checkpoint
    cfg, params = imported
    out, config = pretrained.export_state_dict(params, cfg, hf_config)
    assert sorted(out) == sorted(state)
    for name, x in state.items():
        assert out[name].dtype == x.dtype and out[name].shape == x.shape, name
        assert np.array_equal(out[name], x), name
    assert config == hf_config


def test_special_ids_and_permutation(checkpoint):
    _, _, hf_config = checkpoint
    perm = pretrained.vocab_permutation(hf_config)
    np.testing.assert_array_equal(perm[perm], np.arange(len(perm)))  # an involution
    assert perm[0] == hf_config["pad_token_id"]
    ids = pretrained.special_ids(hf_config)
    if hf_config["model_type"] == "marian":  # EOS 0, pad last: the two trade places with 0
        pad = hf_config["pad_token_id"]  # the target vocabulary's last id
        assert (ids.pad, ids.eos, ids.unk, ids.decoder_start) == (0, pad, 1, 0)
        perm_t = pretrained.vocab_permutation(hf_config, target=True)
        assert len(perm_t) == (V if hf_config["share_encoder_decoder_embeddings"] else V_T)
    else:  # <s> 0, pad 1, </s> 2, <unk> 3 -> pad 0, <s> 1
        assert (ids.pad, ids.bos, ids.eos, ids.unk, ids.decoder_start) == (0, 1, 2, 3, 2)


def test_greedy_decoding_equals_generate(checkpoint, imported):
    from tx_jax.inference.decoding import translate_greedy

    model, _, hf_config = checkpoint
    cfg, params = imported
    src, _ = _pairs(hf_config, seed=1)
    perm = pretrained.vocab_permutation(hf_config)
    perm_t = pretrained.vocab_permutation(hf_config, target=True)
    T = 9
    pad = hf_config["pad_token_id"]
    with torch.no_grad():
        hf = model.generate(
            input_ids=torch.as_tensor(src),
            attention_mask=torch.as_tensor(src != pad).long(),
            max_new_tokens=T,
            num_beams=1,
            do_sample=False,
            suppress_tokens=[pad],  # tx_jax never generates padding
            forced_eos_token_id=None,
            bad_words_ids=None,
        ).numpy()[:, 1:]  # drop the decoder start
    want = np.zeros((len(src), T), np.int64)
    want[:, : hf.shape[1]] = perm_t[hf]  # HF pads finished rows with its pad -> 0
    ids = pretrained.special_ids(hf_config)
    got = translate_greedy(
        cfg,
        params,
        jnp.asarray(perm[src]),
        max_decode_len=T,
        eos_id=ids.eos,
        max_len_a=0.0,
        max_len_b=T,
    )
    np.testing.assert_array_equal(np.asarray(got)[:, :T], want)


def _hf_beams(model, hf_config, src, T, N, **kw):
    """generate's beam search of src (HF ids) with the output limit T -> (best hypotheses
    [B, T] in HF ids, HF's pad after the end, their scores [B])."""
    pad = hf_config["pad_token_id"]
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.as_tensor(src),
            attention_mask=torch.as_tensor(src != pad).long(),
            max_new_tokens=T,
            num_beams=N,
            do_sample=False,
            suppress_tokens=[pad],  # tx_jax never generates padding
            forced_eos_token_id=None,
            bad_words_ids=None,
            return_dict_in_generate=True,
            output_scores=True,
            **kw,
        )
    tokens = np.full((len(src), T), pad, np.int64)
    tokens[:, : out.sequences.shape[1] - 1] = out.sequences.numpy()[:, 1:]  # no decoder start
    return tokens, out.sequences_scores.numpy()


# Beyond generate's defaults (early_stopping=False, length_penalty 1.0), each case checks one
# more of its settings (rule, early_stopping, length_penalty, forced_bos_token_id): every
# setting is covered, at one compilation more per case.
MORE_BEAMS = {
    "marian-tied-swish": ("hf_early", True, 0.6, None),
    "marian-untied-relu": ("hf_never", "never", 1.0, None),
    "marian-tied-gelu": ("hf", False, 0.6, None),
    "marian-untied-swish": ("hf_early", True, 1.0, None),
    "marian-separate-tied-gelu_new": ("hf_never", "never", 0.6, None),
    "m2m100-relu": ("hf", False, 1.0, 7),
    "m2m100-gelu": ("hf_early", True, 0.6, 7),
}


def test_beam4_decoding_equals_generate(request, checkpoint, imported):
    """translate_beam(length_penalty_kind='hf') is generate(num_beams=4) token for token, with
    its score (sequences_scores), for every case, at generate's defaults (early_stopping
    False, length_penalty 1.0) and at the case's MORE_BEAMS setting ('hf_early': True,
    'hf_never': "never"; M2M100 with a forced first token, forced_bos_token_id, as tx_jax's
    prompt). These random models seldom end early, so the searches here mostly differ from
    tx_jax's own rules only in their scores' bookkeeping; test_decoding.py's hand-made
    models show each rule that does differ (test_hf_rules_*)."""
    from tx_jax.inference.decoding import translate_beam

    model, _, hf_config = checkpoint
    cfg, params = imported
    src = np.concatenate([_pairs(hf_config, seed=s)[0] for s in (1, 2)])  # 8 rows
    perm = pretrained.vocab_permutation(hf_config)
    perm_t = pretrained.vocab_permutation(hf_config, target=True)
    ids = pretrained.special_ids(hf_config)
    T, N = 9, 4
    more = MORE_BEAMS[request.node.callspec.params["checkpoint"]]
    for rule, early_stopping, alpha, first in [("hf", False, 1.0, None), more]:
        kw = {} if first is None else dict(forced_bos_token_id=first)
        hf, hf_scores = _hf_beams(
            model, hf_config, src, T, N, length_penalty=alpha, early_stopping=early_stopping, **kw
        )
        prompt = None if first is None else jnp.full((len(src), 1), perm_t[first], jnp.int32)
        tokens, scores = translate_beam(
            cfg,
            params,
            jnp.asarray(perm[src]),
            beam_size=N,
            length_penalty=alpha,
            length_penalty_kind=rule,
            max_decode_len=T,
            eos_id=ids.eos,
            prompt=prompt,
            max_len_a=0.0,
            max_len_b=T,
        )
        setting = f"{rule=} {alpha=} {first=}"
        np.testing.assert_array_equal(np.asarray(tokens)[:, 0, :T], perm_t[hf], setting)
        np.testing.assert_allclose(np.asarray(scores)[:, 0], hf_scores, rtol=1e-5, err_msg=setting)


# ------------------------------------------------------------------ refusals


@functools.cache
def _marian_model():
    config = _marian("swish")
    model = transformers.MarianMTModel(config)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}, config.to_dict()


def _marian_checkpoint():
    """(state dict, config.json dict) of one untrained MarianMTModel, built once per module:
    fresh copies, which a test may change."""
    state, hf_config = _marian_model()
    return {k: v.copy() for k, v in state.items()}, copy.deepcopy(hf_config)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "bart"}, "model_type='bart' cannot be imported"),
        ({"normalize_before": True}, "normalize_before=True"),
        ({"normalize_embedding": True}, "normalize_embedding=True"),
        ({"add_bias_logits": True}, "add_bias_logits=True"),
        ({"static_position_embeddings": False}, "static_position_embeddings=False"),
        ({"relative_attention_num_buckets": 32}, r"without a tx_jax field: \['relative_attent"),
        ({"decoder_ffn_dim": 48}, "encoder_ffn_dim=24 != decoder_ffn_dim=48"),
        ({"activation_function": "gelu_fast"}, "activation_function='gelu_fast'"),
        ({"eos_token_id": [0, 1]}, r"eos_token_id=\[0, 1\]"),
    ],
)
def test_config_refusals_name_the_key(change, message):
    state, hf_config = _marian_checkpoint()
    with pytest.raises(pretrained.PretrainedError, match=message):
        pretrained.import_state_dict(state, {**hf_config, **change})


def test_tensor_refusals_name_the_tensor():
    state, hf_config = _marian_checkpoint()
    state = {k: v for k, v in state.items() if "embed_positions" not in k}  # not saved
    pretrained.import_state_dict(state, hf_config)  # as it is: accepted
    cases = [
        ({**state, "model.encoder.extra.weight": np.ones(3)}, "unmapped.*model.encoder.extra"),
        (
            {k: v for k, v in state.items() if k != "model.decoder.layers.1.fc2.bias"},
            r"missing tensor model.decoder.layers.1.fc2.bias \[16\]",
        ),
        ({**state, "lm_head.weight": state["lm_head.weight"] + 1}, "lm_head.weight should be tied"),
        ({**state, "final_logits_bias": np.zeros((1, 7))}, "final_logits_bias has shape"),
    ]
    for bad, message in cases:
        with pytest.raises(pretrained.PretrainedError, match=message):
            pretrained.import_state_dict(bad, hf_config)


def test_untied_output_with_unequal_shared_embeddings_is_refused():
    """transformers 5 unties Marian's shared embedding when tie_word_embeddings=False: the
    encoder and decoder read their own copies and model.shared.weight is unused."""
    config = _marian("relu", tied=False)
    model = transformers.MarianMTModel(config)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    with pytest.raises(
        pretrained.PretrainedError, match="encoder.embed_tokens.weight should be tied"
    ):
        pretrained.import_state_dict(state, config.to_dict())


def test_m2m100_refusals():
    config = _m2m100()
    model = transformers.M2M100ForConditionalGeneration(config)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    hf_config = config.to_dict()
    fields, _ = pretrained.import_state_dict(state, hf_config)
    assert (fields["position_offset"], fields["sinusoid_style"], fields["bos_id"]) == (
        2,
        "fairseq",
        2,
    )
    with pytest.raises(pretrained.PretrainedError, match="scale_layer_norm"):
        pretrained.import_state_dict(state, {**hf_config, "scale_layer_norm": True})
    del state["model.encoder.layer_norm.bias"]
    with pytest.raises(
        pretrained.PretrainedError, match="missing tensor model.encoder.layer_norm.bias"
    ):
        pretrained.import_state_dict(state, hf_config)


def test_stored_position_tables_are_checked():
    """Older `save_pretrained` versions stored the sinusoids; they must be the ones computed."""
    state, hf_config = _marian_checkpoint()
    table = state["model.encoder.embed_positions.weight"]
    assert table.shape == (64, 16)
    pretrained.import_state_dict(state, hf_config)  # equal: consumed
    state["model.encoder.embed_positions.weight"] = table[:, ::-1].copy()
    with pytest.raises(pretrained.PretrainedError, match="embed_positions.weight differs"):
        pretrained.import_state_dict(state, hf_config)


def test_export_refuses_another_architecture():
    state, hf_config = _marian_checkpoint()
    fields, params = pretrained.import_state_dict(state, hf_config)  # this architecture's tree
    cfg = ModelConfig(**fields).replace(sinusoid_style="paper")
    with pytest.raises(ExportError, match="sinusoid_style='paper'"):
        pretrained.export_state_dict(params, cfg, hf_config)


def test_written_directory_loads_in_transformers(checkpoint, imported, tmp_path):
    """pretrained.write's directory is what from_pretrained reads: the same function."""
    model, _, hf_config = checkpoint
    cfg, params = imported
    out = pretrained.write(params, cfg, hf_config, tmp_path / "hf")
    again = type(model).from_pretrained(str(out)).eval()
    src, tgt = _pairs(hf_config)
    np.testing.assert_array_equal(
        _hf_log_probs(again, hf_config, src, tgt), _hf_log_probs(model, hf_config, src, tgt)
    )


def test_paper_layout_export_refuses_the_imported_fields():
    """The trained-run export (weights.problems) names the fields only interop.pretrained maps."""
    from tx_jax.interop import weights

    _, hf_config = _marian_checkpoint()
    found = "\n".join(weights.problems(ModelConfig(**pretrained.model_fields(hf_config))))
    for field in ("logits_bias=True", "sinusoid_style='marian'", "activation='silu'"):
        assert field in found
