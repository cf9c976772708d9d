"""Transformers' MarianMT (OPUS-MT) <-> tx_jax's EncoderDecoder, in both directions.

MarianMT, as transformers' modeling_marian.py computes it: post-LN layers (LayerNorm eps
1e-5), biases on every projection, fixed sinusoids with every sine before every cosine (not
stored in the file), embeddings scaled by sqrt(d_model) when scale_embedding, logits
`lm_head(x) + final_logits_bias`, decoding started from the pad token. The encoder and
decoder share one embedding unless share_encoder_decoder_embeddings=False (then the decoder
has its own vocabulary of decoder_vocab_size), and the output layer is the decoder's
embedding unless tie_word_embeddings=False (then `lm_head.weight`).

Ids: OPUS-MT puts EOS at 0 and pad last; seq2seq_layout swaps pad with 0 (tx id V-1 is EOS),
on both embeddings, final_logits_bias and lm_head's rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tx_jax.interop import seq2seq_layout as layout
from tx_jax.interop import weights as weights_lib
from tx_jax.model.config import ModelConfig

MODEL_TYPE = "marian"
UNK_ID = 1  # OPUS-MT's vocab.json: </s> 0, <unk> 1 (the config does not name it)
# Keys of the BART era that older Marian configs carry; tx_jax represents only these values
# (transformers' MarianMTModel ignores them, so another value means another model).
_REQUIRED = {
    "normalize_before": False,
    "normalize_embedding": False,
    "layernorm_embedding": False,
    "add_final_layer_norm": False,
    "static_position_embeddings": True,
    "add_bias_logits": False,
    "is_decoder": False,
}
_USED = ["share_encoder_decoder_embeddings", "decoder_vocab_size", "extra_pos_embeddings"]
# The fields every MarianMT import has, whatever its sizes: what export checks.
FIXED_FIELDS = {
    "norm": "layernorm",
    "norm_position": "post",
    "norm_epsilon": 1e-5,
    "positional": "sinusoidal",
    "sinusoid_style": "marian",
    "position_offset": 0,
    "attention_bias": True,
    "ffn_bias": True,
    "logits_bias": True,
}


def _sizes(hf_config: Mapping[str, Any]) -> tuple[int, int, bool, bool]:
    """(V source, V target, shared embeddings, tied output)."""
    shared = bool(hf_config.get("share_encoder_decoder_embeddings", True))
    tied = bool(hf_config.get("tie_word_embeddings", True))
    v = int(hf_config["vocab_size"])
    v_t = v if shared else int(hf_config.get("decoder_vocab_size") or v)
    return v, v_t, shared, tied


def vocab_permutation(hf_config: Mapping[str, Any], *, target: bool = False) -> np.ndarray:
    """perm[tx_id] = hf_id over the source (target=True: the decoder's) vocabulary."""
    v, v_t, _, _ = _sizes(hf_config)
    return layout.swap_permutation(v_t if target else v, int(hf_config["pad_token_id"]))


def special_ids(hf_config: Mapping[str, Any], unk_id: int = UNK_ID) -> layout.SpecialIds:
    """pad, EOS, unk (`unk_id`: HF's, from vocab.json) and the decoder start, in tx ids."""
    perm = vocab_permutation(hf_config, target=True)
    return layout.SpecialIds(
        pad=0,
        eos=int(perm[hf_config["eos_token_id"]]),
        unk=int(perm[unk_id]),
        decoder_start=int(perm[hf_config["decoder_start_token_id"]]),
    )


def model_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a MarianMT config.json (layout.model_fields)."""

    def family_fields() -> dict[str, Any]:
        _, v_t, shared, _ = _sizes(hf_config)
        start = vocab_permutation(hf_config, target=True)[hf_config["decoder_start_token_id"]]
        return {
            **FIXED_FIELDS,
            "target_vocab_size": None if shared else v_t,
            "attention_dropout_rate": float(hf_config.get("attention_dropout", 0.0)),
            "share_embeddings": shared,
            "scale_embeddings": bool(hf_config.get("scale_embedding", False)),
            "bos_id": int(start),
        }

    return layout.model_fields(
        hf_config,
        MODEL_TYPE,
        "MarianMT",
        used=_USED,
        required=_REQUIRED,
        family_fields=family_fields,
    )


def position_table(rows: int, d_model: int) -> np.ndarray:
    """Transformers' Marian table (float64 angles, sines then cosines, rounded to float32):
    what an older `save_pretrained` stored as embed_positions.weight, checked on import."""
    j = np.arange(d_model)
    angle = np.arange(rows)[:, None] / np.power(10_000, 2 * (j // 2) / d_model)[None]
    return np.concatenate([np.sin(angle[:, 0::2]), np.cos(angle[:, 1::2])], 1).astype(np.float32)


def import_state_dict(
    state_dict: Mapping[str, Any], hf_config: Mapping[str, Any]
) -> tuple[dict[str, Any], dict]:
    """MarianMTModel's state dict (numpy or torch tensors, names as `save_pretrained`
    writes them) and config.json -> (ModelConfig fields, EncoderDecoder 'params' tree).
    PretrainedError, before anything is built, naming each config key or tensor that does
    not map. Arrays keep the file's dtype."""
    fields = model_fields(hf_config)
    cfg = ModelConfig(**fields)
    m = cfg.d_model
    v, v_t, shared, tied = _sizes(hf_config)
    t = layout.Tensors(state_dict, "MarianMT")
    if shared:
        embedding = t.take("model.shared.weight", (v, m))
        t.take_copy("model.encoder.embed_tokens.weight", embedding)
        t.take_copy("model.decoder.embed_tokens.weight", embedding)
        target = embedding
    else:
        embedding = t.take("model.encoder.embed_tokens.weight", (v, m))
        target = t.take("model.decoder.embed_tokens.weight", (v_t, m))
        t.take_copy("model.shared.weight", embedding)
    if tied:
        t.take_copy("lm_head.weight", target)
        output = None
    else:
        output = t.take("lm_head.weight", (v_t, m))
    bias = t.take("final_logits_bias", (1, v_t))
    table = position_table(cfg.max_len, m)
    for stack in ("encoder", "decoder"):
        t.take_constant(f"model.{stack}.embed_positions.weight", table, atol=1e-6)
    encoder, decoder = layout.read_stacks(t, cfg)
    t.finish()
    perm, perm_t = vocab_permutation(hf_config), vocab_permutation(hf_config, target=True)
    w = weights_lib.Weights(
        embedding=embedding[perm],
        encoder=encoder,
        decoder=decoder,
        target_embedding=None if shared else target[perm_t],
        output=None if output is None else output[perm_t],
        logits_bias=bias[0][perm_t],
    )
    return fields, weights_lib.params_from_weights(w, cfg)


def config_dict(cfg: ModelConfig, hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json for `cfg`: `hf_config` (the imported one: ids, metadata, generation
    defaults) with every key the architecture sets taken from `cfg`."""
    out = layout.hf_config_dict(cfg, hf_config, MODEL_TYPE)
    out.update(
        decoder_vocab_size=cfg.output_vocab_size,
        share_encoder_decoder_embeddings=cfg.share_embeddings,
    )
    out["decoder_start_token_id"] = int(vocab_permutation(out, target=True)[cfg.bos_id])
    return out


def export_state_dict(
    params: Any, cfg: ModelConfig, hf_config: Mapping[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """tx_jax params (boxed or not) of an imported MarianMT model -> (state dict with the
    names and rows `save_pretrained` writes, config.json dict). `hf_config` is the imported
    config.json (its pad id undoes the vocabulary swap). For a model imported unchanged the
    tensors equal the original file's bit for bit (float32)."""
    layout.check_exportable(cfg, FIXED_FIELDS, "MarianMT")
    config = config_dict(cfg, hf_config)
    w = weights_lib.extract(params, cfg, check=False)
    perm, perm_t = vocab_permutation(config), vocab_permutation(config, target=True)
    target = w.embedding if w.target_embedding is None else w.target_embedding
    out: dict[str, np.ndarray] = {}
    if cfg.share_embeddings:
        out["model.shared.weight"] = w.embedding[perm]
    else:
        out["model.encoder.embed_tokens.weight"] = w.embedding[perm]
        out["model.decoder.embed_tokens.weight"] = target[perm_t]
    if w.output is not None:
        out["lm_head.weight"] = w.output[perm_t]
    out["final_logits_bias"] = w.logits_bias[perm_t][None]
    layout.write_stacks(out, w)
    return {k: np.ascontiguousarray(x) for k, x in out.items()}, config
