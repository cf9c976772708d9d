"""Transformers' M2M100 (and NLLB-200, which is model_type m2m_100) <-> tx_jax's
EncoderDecoder, in both directions.

M2M100, as transformers' modeling_m2m_100.py computes it: pre-LN layers with a final
LayerNorm after each stack (`model.{encoder,decoder}.layer_norm`, eps 1e-5), biases on every
projection, one embedding shared by encoder and decoder (scaled by sqrt(d_model) when
scale_embedding), the output tied to it unless tie_word_embeddings=False, no logits bias.
Positions are fairseq's sinusoids (sines then cosines, frequencies exp(-i ln(10000) /
(M/2 - 1))), padding-aware: a real token's position is its index plus padding_idx + 1
(ModelConfig.position_offset; padding_idx is the pad id, 1). For tx_jax's right-padded rows
that is the same number on every real token. Decoding starts at EOS.

Ids: fairseq's <s> 0, <pad> 1, </s> 2, <unk> 3; the swap makes tx 0 = pad, tx 1 = <s>.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tx_jax.interop import seq2seq_layout as layout
from tx_jax.interop import weights as weights_lib
from tx_jax.model.config import ModelConfig
from tx_jax.model.positional import sinusoidal_table

MODEL_TYPE = "m2m_100"
UNK_ID = 3  # fairseq's dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3
_REQUIRED = {"is_decoder": False}
FIXED_FIELDS = {
    "norm": "layernorm",
    "norm_position": "pre",
    "norm_epsilon": 1e-5,
    "positional": "sinusoidal",
    "sinusoid_style": "fairseq",
    "attention_bias": True,
    "ffn_bias": True,
    "logits_bias": False,
    "share_embeddings": True,
}


def vocab_permutation(hf_config: Mapping[str, Any], *, target: bool = False) -> np.ndarray:
    """perm[tx_id] = hf_id (one vocabulary: `target` changes nothing)."""
    del target
    return layout.swap_permutation(int(hf_config["vocab_size"]), int(hf_config["pad_token_id"]))


def special_ids(hf_config: Mapping[str, Any], unk_id: int = UNK_ID) -> layout.SpecialIds:
    """pad, EOS, unk (HF's `unk_id`), decoder start (EOS) and <s>, in tx ids."""
    perm = vocab_permutation(hf_config)
    bos = hf_config.get("bos_token_id")
    return layout.SpecialIds(
        pad=0,
        eos=int(perm[hf_config["eos_token_id"]]),
        unk=int(perm[unk_id]),
        decoder_start=int(perm[hf_config["decoder_start_token_id"]]),
        bos=None if bos is None else int(perm[bos]),
    )


def model_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of an M2M100 config.json (layout.model_fields)."""

    def family_fields() -> dict[str, Any]:
        start = vocab_permutation(hf_config)[hf_config["decoder_start_token_id"]]
        return {
            **FIXED_FIELDS,
            "attention_dropout_rate": float(hf_config.get("attention_dropout", 0.1)),
            "position_offset": int(hf_config["pad_token_id"]) + 1,  # padding_idx + 1
            "scale_embeddings": bool(hf_config.get("scale_embedding", True)),
            "bos_id": int(start),
        }

    return layout.model_fields(
        hf_config, MODEL_TYPE, "M2M100", used=[], required=_REQUIRED, family_fields=family_fields
    )


def import_state_dict(
    state_dict: Mapping[str, Any], hf_config: Mapping[str, Any]
) -> tuple[dict[str, Any], dict]:
    """M2M100ForConditionalGeneration's state dict (names as `save_pretrained` writes them)
    and config.json -> (ModelConfig fields, EncoderDecoder 'params' tree); PretrainedError
    naming each config key or tensor that does not map. Arrays keep the file's dtype."""
    fields = model_fields(hf_config)
    cfg = ModelConfig(**fields)
    m, v = cfg.d_model, cfg.vocab_size
    t = layout.Tensors(state_dict, "M2M100")
    embedding = t.take("model.shared.weight", (v, m))
    t.take_copy("model.encoder.embed_tokens.weight", embedding)
    t.take_copy("model.decoder.embed_tokens.weight", embedding)
    if cfg.tie_output:
        t.take_copy("lm_head.weight", embedding)
        output = None
    else:
        output = t.take("lm_head.weight", (v, m))
    encoder, decoder = layout.read_stacks(t, cfg)
    encoder_norm = (
        t.take("model.encoder.layer_norm.weight", (m,)),
        t.take("model.encoder.layer_norm.bias", (m,)),
    )
    decoder_norm = (
        t.take("model.decoder.layer_norm.weight", (m,)),
        t.take("model.decoder.layer_norm.bias", (m,)),
    )
    table = np.array(sinusoidal_table(cfg.max_len + cfg.position_offset, m, style="fairseq"))
    table[cfg.position_offset - 1] = 0.0  # fairseq zeroes the padding_idx row
    for stack in ("encoder", "decoder"):
        t.take_constant(f"model.{stack}.embed_positions.weights", table, atol=1e-5)
    t.finish()
    perm = vocab_permutation(hf_config)
    w = weights_lib.Weights(
        embedding=embedding[perm],
        encoder=encoder,
        decoder=decoder,
        output=None if output is None else output[perm],
        encoder_norm=encoder_norm,
        decoder_norm=decoder_norm,
    )
    return fields, weights_lib.params_from_weights(w, cfg)


def config_dict(cfg: ModelConfig, hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json for `cfg`: `hf_config` (the imported one) with every key the
    architecture sets taken from `cfg`."""
    out = layout.hf_config_dict(cfg, hf_config, MODEL_TYPE)
    if cfg.position_offset != int(out["pad_token_id"]) + 1:
        raise weights_lib.ExportError(
            f"model.position_offset={cfg.position_offset}: M2M100 needs pad_token_id + 1 "
            f"= {int(out['pad_token_id']) + 1}"
        )
    out["decoder_start_token_id"] = int(vocab_permutation(out)[cfg.bos_id])
    return out


def export_state_dict(
    params: Any, cfg: ModelConfig, hf_config: Mapping[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """tx_jax params (boxed or not) of an imported M2M100 model -> (state dict with the
    names and rows `save_pretrained` writes, config.json dict); `hf_config` is the imported
    config.json. For a model imported unchanged the tensors equal the file's bit for bit."""
    layout.check_exportable(cfg, FIXED_FIELDS, "M2M100")
    config = config_dict(cfg, hf_config)
    w = weights_lib.extract(params, cfg, check=False)
    perm = vocab_permutation(config)
    out: dict[str, np.ndarray] = {"model.shared.weight": w.embedding[perm]}
    if w.output is not None:
        out["lm_head.weight"] = w.output[perm]
    layout.write_stacks(out, w)
    for stack, norm in (("encoder", w.encoder_norm), ("decoder", w.decoder_norm)):
        out[f"model.{stack}.layer_norm.weight"], out[f"model.{stack}.layer_norm.bias"] = norm
    return {k: np.ascontiguousarray(x) for k, x in out.items()}, config
