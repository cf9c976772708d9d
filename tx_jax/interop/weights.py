"""The exportable subset of ModelConfig, and a checkpoint's weights in a neutral layout.

Neutral layout: every linear map as (weight [out, in], bias [out]), the layout of
torch.nn.Linear and of CTranslate2's LinearSpec; a projection tx_jax stores without a bias
gets a zero bias, which computes the same function. Feature order is tx_jax's own; a format
that orders the model dimension differently permutes it (huggingface.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from flax import linen as nn

from tx_jax.model.config import ModelConfig


class ExportError(ValueError):
    """A model that no target format can represent exactly; the message names the fields."""


# field -> (value the paper's architecture has, why another value has no exact counterpart)
_REQUIRED = {
    "norm_position": ("post", "MarianMT normalises after each residual (post-LN)"),
    "norm": ("layernorm", "MarianMT and CTranslate2's Marian spec use LayerNorm"),
    "positional": ("sinusoidal", "MarianMT has fixed sinusoidal positions only"),
    "num_kv_heads": (None, "MarianMT has no grouped-query attention"),
    "share_embeddings": (True, "the exported tokenizer is one joint vocabulary"),
    "tie_output": (True, "an untied output layer is not mapped"),
    "logits_bias": (False, "an output bias is not mapped"),
    "sinusoid_style": ("paper", "the export re-orders the paper's interleaved sinusoids"),
    "position_offset": (0, "MarianMT's positions start at 0"),
}
ACTIVATIONS = {"relu": "relu", "gelu": "gelu_new"}  # flax's gelu is the tanh approximation


def problems(cfg: ModelConfig, task: str = "translation") -> list[str]:
    """Why `cfg` cannot be exported exactly: one message per field (empty: it can)."""
    out = []
    if task != "translation":
        out.append(f"config.task={task!r}: only translation models (EncoderDecoder) export")
    for field, (wanted, why) in _REQUIRED.items():
        value = getattr(cfg, field)
        if field == "num_kv_heads" and value == cfg.num_heads:
            continue  # K == H is ordinary multi-head attention
        if value != wanted:
            out.append(f"model.{field}={value!r} (export needs {wanted!r}: {why})")
    if cfg.activation not in ACTIVATIONS:
        out.append(
            f"model.activation={cfg.activation!r} (export needs one of {sorted(ACTIVATIONS)}: "
            "MarianMT's FFN has one weight matrix in, one out)"
        )
    width = cfg.d_model // cfg.num_heads
    for field in ("head_dim", "value_head_dim"):
        value = getattr(cfg, field)
        if value is not None and value * cfg.num_heads != cfg.d_model:
            out.append(
                f"model.{field}={value} (export needs num_heads * {field} = d_model "
                f"= {cfg.d_model}, i.e. {width}: MarianMT's heads split d_model)"
            )
    return out


def check_exportable(cfg: ModelConfig, task: str = "translation") -> None:
    found = problems(cfg, task)
    if found:
        raise ExportError("cannot export this model exactly:\n  " + "\n  ".join(found))


Linear = tuple[np.ndarray, np.ndarray]  # weight [out, in], bias [out]
Norm = tuple[np.ndarray, np.ndarray]  # scale [M], bias [M]


@dataclasses.dataclass
class Layer:
    """One encoder or decoder layer; `cross` is None in the encoder."""

    self_attention: dict[str, Linear]  # q, k, v, o
    self_attention_norm: Norm
    cross: dict[str, Linear] | None
    cross_norm: Norm | None
    fc1: Linear
    fc2: Linear
    ffn_norm: Norm


@dataclasses.dataclass
class Weights:
    """An EncoderDecoder's weights. The optional parts are None where the model has none:
    then the target embedding is `embedding`, the output rows are the target embedding's,
    there is no logits bias and no final norm (post-LN)."""

    embedding: np.ndarray  # [V, M], the source embedding (and target/output when shared/tied)
    encoder: list[Layer]
    decoder: list[Layer]
    target_embedding: np.ndarray | None = None  # [V_t, M] (share_embeddings=False)
    output: np.ndarray | None = None  # [V_t, M] output rows (tie_output=False)
    logits_bias: np.ndarray | None = None  # [V_t] (logits_bias=True)
    encoder_norm: Norm | None = None  # pre-LN's final norms (norm_position='pre')
    decoder_norm: Norm | None = None


def _f32(x: Any) -> np.ndarray:
    return np.array(x, np.float32)  # a writable copy: CTranslate2 quantizes in place


def _bias(p: dict, name: str, size: int) -> np.ndarray:
    """The [size] bias `name`, or zeros where tx_jax has none (the same function)."""
    bias = p.get(name)
    return np.zeros(size, np.float32) if bias is None else _f32(bias).reshape(-1)


def _attention(p: dict) -> dict[str, Linear]:
    out = {}
    for short, name in (("q", "query"), ("k", "key"), ("v", "value")):
        kernel = _f32(p[f"{name}_kernel"])  # [M, H, D]
        weight = kernel.reshape(kernel.shape[0], -1).T  # [H*D, M]: heads outermost, as torch
        out[short] = (weight, _bias(p, f"{name}_bias", weight.shape[0]))
    kernel = _f32(p["out_kernel"])  # [H, D, M]
    weight = kernel.reshape(-1, kernel.shape[-1]).T  # [M, H*D]
    out["o"] = (weight, _bias(p, "out_bias", weight.shape[0]))
    return out


def _linear(p: dict, name: str) -> Linear:
    weight = _f32(p[f"{name}_kernel"]).T  # [in, out] -> [out, in]
    return weight, _bias(p, f"{name}_bias", weight.shape[0])


def _norm(p: dict) -> Norm:
    return _f32(p["scale"]), _f32(p["bias"])


def _layer(p: dict, cross: bool) -> Layer:
    return Layer(
        self_attention=_attention(p["self_attention"]),
        self_attention_norm=_norm(p["self_attention_norm"]),
        cross=_attention(p["cross_attention"]) if cross else None,
        cross_norm=_norm(p["cross_attention_norm"]) if cross else None,
        fc1=_linear(p["ffn"], "wi"),
        fc2=_linear(p["ffn"], "wo"),
        ffn_norm=_norm(p["ffn_norm"]),
    )


def extract(
    params: Any, cfg: ModelConfig, task: str = "translation", *, check: bool = True
) -> Weights:
    """An EncoderDecoder's parameters (boxed or not, any device) -> Weights (float32);
    ExportError first if the model cannot be exported exactly to MarianMT's paper layout
    (`check=False`: every part, for the pretrained families' own mappings)."""
    if check:
        check_exportable(cfg, task)
    p = nn.meta.unbox(params)
    dec = p["decoder"]
    pre = cfg.norm_position == "pre"
    return Weights(
        embedding=_f32(p["source_embed"]["embedding"]),
        encoder=[_layer(p["encoder"][f"layer_{i}"], False) for i in range(cfg.num_encoder_layers)],
        decoder=[_layer(dec[f"layer_{i}"], True) for i in range(cfg.num_decoder_layers)],
        target_embedding=None if cfg.share_embeddings else _f32(p["target_embed"]["embedding"]),
        output=None if cfg.tie_output else _f32(dec["logits_kernel"]).T,
        logits_bias=_f32(dec["logits_bias"]) if cfg.logits_bias else None,
        encoder_norm=_norm(p["encoder"]["final_norm"]) if pre else None,
        decoder_norm=_norm(dec["final_norm"]) if pre else None,
    )


# ------------------------------------------------------------------ neutral -> tx_jax


def _attention_params(a: dict[str, Linear], cfg: ModelConfig, where: str) -> dict:
    H, M = cfg.num_heads, cfg.d_model
    out = {}
    for short, name in (("q", "query"), ("k", "key"), ("v", "value")):
        weight, bias = a[short]  # [H*D, M], [H*D]
        out[f"{name}_kernel"] = weight.T.reshape(M, H, -1)
        _put_bias(out, f"{name}_bias", bias.reshape(H, -1), cfg.attention_bias, f"{where}.{short}")
    weight, bias = a["o"]  # [M, H*D], [M]
    out["out_kernel"] = weight.T.reshape(H, -1, M)
    _put_bias(out, "out_bias", bias, cfg.attention_bias, f"{where}.o")
    return out


def _put_bias(out: dict, name: str, bias: np.ndarray, used: bool, where: str) -> None:
    if used:
        out[name] = bias
    elif np.any(bias):
        raise ValueError(f"{where}: a nonzero bias, but the model config has no such bias")


def _layer_params(layer: Layer, cfg: ModelConfig, where: str) -> dict:
    ffn = {"wi_kernel": layer.fc1[0].T, "wo_kernel": layer.fc2[0].T}
    _put_bias(ffn, "wi_bias", layer.fc1[1], cfg.ffn_bias, f"{where}.fc1")
    _put_bias(ffn, "wo_bias", layer.fc2[1], cfg.ffn_bias, f"{where}.fc2")
    out = {
        "self_attention": _attention_params(layer.self_attention, cfg, f"{where}.self_attention"),
        "self_attention_norm": _norm_params(layer.self_attention_norm),
        "ffn": ffn,
        "ffn_norm": _norm_params(layer.ffn_norm),
    }
    if layer.cross is not None:
        out["cross_attention"] = _attention_params(layer.cross, cfg, f"{where}.cross_attention")
        out["cross_attention_norm"] = _norm_params(layer.cross_norm)
    return out


def _norm_params(norm: Norm) -> dict:
    return {"scale": norm[0], "bias": norm[1]}


def params_from_weights(w: Weights, cfg: ModelConfig) -> dict:
    """Weights -> an EncoderDecoder's unboxed 'params' tree for `cfg` (the inverse of
    `extract(..., check=False)`); arrays keep their dtype. ValueError where a part the
    weights have has no place in `cfg` (or the reverse)."""
    parts = {
        "target_embedding": (w.target_embedding, not cfg.share_embeddings),
        "output": (w.output, not cfg.tie_output),
        "logits_bias": (w.logits_bias, cfg.logits_bias),
        "encoder_norm": (w.encoder_norm, cfg.norm_position == "pre"),
        "decoder_norm": (w.decoder_norm, cfg.norm_position == "pre"),
    }
    for name, (value, wanted) in parts.items():
        if (value is not None) != wanted:
            raise ValueError(f"Weights.{name} is {'missing' if wanted else 'not expected'}")
    if (len(w.encoder), len(w.decoder)) != (cfg.num_encoder_layers, cfg.num_decoder_layers):
        raise ValueError(
            f"{len(w.encoder)}+{len(w.decoder)} layers for the config's "
            f"{cfg.num_encoder_layers}+{cfg.num_decoder_layers}"
        )
    enc = {f"layer_{i}": _layer_params(x, cfg, f"encoder.{i}") for i, x in enumerate(w.encoder)}
    dec = {f"layer_{i}": _layer_params(x, cfg, f"decoder.{i}") for i, x in enumerate(w.decoder)}
    if w.encoder_norm is not None:
        enc["final_norm"] = _norm_params(w.encoder_norm)
        dec["final_norm"] = _norm_params(w.decoder_norm)
    if w.output is not None:
        dec["logits_kernel"] = w.output.T
    if w.logits_bias is not None:
        dec["logits_bias"] = w.logits_bias
    params = {"source_embed": {"embedding": w.embedding}, "encoder": enc, "decoder": dec}
    if w.target_embedding is not None:
        params["target_embed"] = {"embedding": w.target_embedding}
    return params


def vocabulary(tokenizer: Any, size: int) -> list[str]:
    """The model's `size` pieces in id order; ids past the tokenizer's (a vocabulary padded
    for the hardware) get names no text produces."""
    pieces = [tokenizer.id_to_piece(i) for i in range(min(size, tokenizer.vocab_size))]
    return pieces + [f"<tx_jax_unused_{i}>" for i in range(len(pieces), size)]
