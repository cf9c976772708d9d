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
    embedding: np.ndarray  # [V, M], shared by encoder, decoder and the output layer
    encoder: list[Layer]
    decoder: list[Layer]


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


def extract(params: Any, cfg: ModelConfig, task: str = "translation") -> Weights:
    """An EncoderDecoder's parameters (boxed or not, any device) -> Weights (float32);
    ExportError first if the model cannot be exported exactly."""
    check_exportable(cfg, task)
    p = nn.meta.unbox(params)
    return Weights(
        embedding=_f32(p["source_embed"]["embedding"]),
        encoder=[_layer(p["encoder"][f"layer_{i}"], False) for i in range(cfg.num_encoder_layers)],
        decoder=[_layer(p["decoder"][f"layer_{i}"], True) for i in range(cfg.num_decoder_layers)],
    )


def vocabulary(tokenizer: Any, size: int) -> list[str]:
    """The model's `size` pieces in id order; ids past the tokenizer's (a vocabulary padded
    for the hardware) get names no text produces."""
    pieces = [tokenizer.id_to_piece(i) for i in range(min(size, tokenizer.vocab_size))]
    return pieces + [f"<tx_jax_unused_{i}>" for i in range(len(pieces), size)]
