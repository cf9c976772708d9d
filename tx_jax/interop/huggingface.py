"""A tx_jax translation checkpoint as a Transformers MarianMT directory (docs/models.md).

Marian puts every sine before every cosine where tx_jax interleaves them: permuting the model
dimension of every residual-stream tensor (embeddings, the input side of Q/K/V and FFN-in,
the output side of W^O and FFN-out, the norms) by `residual_order` moves the network into
Marian's order without changing its function (scores, the norms' statistics and the tied
logits are sums over that dimension). Missing biases are zeros; Marian's LayerNorm epsilon
stays 1e-5 (tests/test_export.py states the tolerance). Writing needs only `safetensors`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from etils import epath

from tx_jax.data.tokenizer import EOS_ID, PAD_ID, UNK_ID
from tx_jax.inference import restore
from tx_jax.inference.decoding import decode_length
from tx_jax.inference.translation import max_source_len
from tx_jax.interop import weights as weights_lib
from tx_jax.model.config import ModelConfig


def residual_order(d_model: int) -> np.ndarray:
    """Marian feature k is tx_jax feature residual_order[k]: the sines (even), then the cosines."""
    return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def state_dict(w: weights_lib.Weights, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """MarianMTModel's state dict (names as `save_pretrained` writes them), float32."""
    order = residual_order(cfg.d_model)
    out = {"model.shared.weight": w.embedding[:, order]}

    def reads(name: str, linear: weights_lib.Linear) -> None:  # input side in the residual
        out[f"{name}.weight"], out[f"{name}.bias"] = linear[0][:, order], linear[1]

    def writes(name: str, linear: weights_lib.Linear) -> None:  # output side in the residual
        out[f"{name}.weight"], out[f"{name}.bias"] = linear[0][order, :], linear[1][order]

    def norm(name: str, n: weights_lib.Norm) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = n[0][order], n[1][order]

    def attention(name: str, a: dict[str, weights_lib.Linear]) -> None:
        for short in "qkv":
            reads(f"{name}.{short}_proj", a[short])
        writes(f"{name}.out_proj", a["o"])

    for stack, layers in (("encoder", w.encoder), ("decoder", w.decoder)):
        for i, layer in enumerate(layers):
            p = f"model.{stack}.layers.{i}"
            attention(f"{p}.self_attn", layer.self_attention)
            norm(f"{p}.self_attn_layer_norm", layer.self_attention_norm)
            if layer.cross is not None:
                attention(f"{p}.encoder_attn", layer.cross)
                norm(f"{p}.encoder_attn_layer_norm", layer.cross_norm)
            reads(f"{p}.fc1", layer.fc1)
            writes(f"{p}.fc2", layer.fc2)
            norm(f"{p}.final_layer_norm", layer.ffn_norm)
    out["final_logits_bias"] = np.zeros((1, w.embedding.shape[0]), np.float32)
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def max_decode_len(loaded: restore.Loaded) -> int:
    """tx_jax's output limit for sources padded as `translate` pads them (length + 50)."""
    return decode_length(max_source_len(loaded), config=loaded.model_config)


def model_config(loaded: restore.Loaded) -> dict[str, Any]:
    cfg = loaded.model_config
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": cfg.vocab_size,
        "decoder_vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.num_encoder_layers,
        "decoder_layers": cfg.num_decoder_layers,
        "encoder_attention_heads": cfg.num_heads,
        "decoder_attention_heads": cfg.num_heads,
        "encoder_ffn_dim": cfg.d_ff,
        "decoder_ffn_dim": cfg.d_ff,
        "activation_function": weights_lib.ACTIVATIONS[cfg.activation],
        "max_position_embeddings": max(1024, max_decode_len(loaded)),
        "scale_embedding": cfg.scale_embeddings,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
        "dropout": cfg.dropout_rate,
        "attention_dropout": cfg.attention_dropout_rate,
        "activation_dropout": cfg.ffn_dropout_rate,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "bos_token_id": None,
        "decoder_start_token_id": cfg.bos_id,
        "forced_eos_token_id": None,
        "is_encoder_decoder": True,
        "use_cache": True,
        "dtype": "float32",
    }


def generation_config(
    loaded: restore.Loaded, beam_size: int, length_penalty: float
) -> dict[str, Any]:
    """The run's test-time search. Transformers divides a beam's log-probability by
    length^length_penalty (tx_jax's 'fairseq' rule), not GNMT's
    ((5 + length) / 6)^length_penalty."""
    out = {
        "decoder_start_token_id": loaded.model_config.bos_id,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "num_beams": beam_size,
        "max_length": max_decode_len(loaded) + 1,  # + the decoder's start token
        "suppress_tokens": [PAD_ID],  # tx_jax's search never emits padding
    }
    if beam_size > 1:  # transformers warns about a length penalty without beams
        out["length_penalty"] = length_penalty
    return out


def write_tokenizer(loaded: restore.Loaded, out: epath.Path) -> None:
    spm_bytes = loaded.tokenizer.to_bytes()
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes(spm_bytes)
    pieces = weights_lib.vocabulary(loaded.tokenizer, loaded.model_config.vocab_size)
    (out / "vocab.json").write_text(
        json.dumps({p: i for i, p in enumerate(pieces)}, ensure_ascii=False, indent=0)
    )
    special = {
        "unk_token": pieces[UNK_ID],
        "eos_token": pieces[EOS_ID],
        "pad_token": pieces[PAD_ID],
    }
    data = loaded.config.data
    tokenizer_config = {
        "tokenizer_class": "MarianTokenizer",
        "source_lang": data.get("source_lang"),
        "target_lang": data.get("target_lang"),
        "separate_vocabs": False,
        "model_max_length": data.max_eval_len,  # tx_jax truncates sources to this (EOS included)
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def export(
    loaded: restore.Loaded,
    out: str | epath.PathLike,
    *,
    beam_size: int | None = None,
    length_penalty: float | None = None,
    hf_config: dict[str, Any] | None = None,
) -> epath.Path:
    """Writes the Hugging Face directory `out` (created; files in it are replaced).

    beam_size / length_penalty default to the run's test-time search (eval.test_beam_size or
    eval.beam_size, eval.length_penalty). A model imported from Transformers (`hf_config`: the
    config.json it came with) goes back in its own family's format through
    interop.pretrained (model.safetensors and config.json; the tokenizer's files are the
    tokenizer's to write)."""
    if hf_config is not None:
        from tx_jax.interop import pretrained

        out = pretrained.write(loaded.params, loaded.model_config, hf_config, out)
        write_hf = getattr(loaded.tokenizer, "write_hf", None)
        if write_hf is not None:
            write_hf(out)
        return out
    try:
        from safetensors.numpy import save_file
    except ImportError as e:
        raise ImportError("exporting needs safetensors: pip install -e '.[export]'") from e
    cfg = loaded.model_config
    tensors = state_dict(weights_lib.extract(loaded.params, cfg, loaded.task), cfg)
    ev = loaded.config.eval
    beam_size = beam_size or ev.get("test_beam_size") or ev.beam_size
    length_penalty = ev.length_penalty if length_penalty is None else length_penalty
    out = epath.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model_config(loaded), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(generation_config(loaded, beam_size, length_penalty), indent=2)
    )
    write_tokenizer(loaded, out)
    return out
