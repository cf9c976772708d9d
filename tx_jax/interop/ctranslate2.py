"""A tx_jax translation checkpoint as a CTranslate2 model, built from CTranslate2's own
Transformer spec (its Transformers converter assumes Opus-MT's padding and start token).

The spec takes tx_jax's layout as it is (interleaved sinusoids, LayerNorm epsilon, start
token), so nothing is permuted. CTranslate2 appends EOS to sources (add_source_eos), as
tx_jax's pipeline does: give `translate_batch` the SentencePiece pieces.
"""

from __future__ import annotations

import math

import numpy as np
from etils import epath

from tx_jax.data.tokenizer import BOS_ID, EOS_ID, UNK_ID
from tx_jax.inference import restore
from tx_jax.interop import weights as weights_lib
from tx_jax.interop.huggingface import max_decode_len
from tx_jax.model.positional import sinusoidal_table

QUANTIZATIONS = ("float32", "int8", "int8_float32", "int16", "float16", "bfloat16")


def _import_ct2():
    try:
        import ctranslate2
    except ImportError as e:
        raise ImportError(
            "exporting to CTranslate2 needs ctranslate2: pip install -e '.[export]'"
        ) from e
    return ctranslate2


def _linear(spec, linears: list[weights_lib.Linear]) -> None:
    """One LinearSpec from one or more [out, in] maps stacked along `out` (fused Q/K/V)."""
    spec.weight = np.concatenate([w for w, _ in linears], axis=0)
    spec.bias = np.concatenate([b for _, b in linears], axis=0)


def _norm(spec, norm: weights_lib.Norm) -> None:
    spec.gamma, spec.beta = norm


def _attention(spec, a: dict[str, weights_lib.Linear], norm: weights_lib.Norm, cross: bool) -> None:
    if cross:  # query from the decoder; keys and values from the encoder output
        _linear(spec.linear[0], [a["q"]])
        _linear(spec.linear[1], [a["k"], a["v"]])
    else:
        _linear(spec.linear[0], [a["q"], a["k"], a["v"]])
    _linear(spec.linear[-1], [a["o"]])
    _norm(spec.layer_norm, norm)


def _layers(specs, layers: list[weights_lib.Layer]) -> None:
    for spec, layer in zip(specs, layers, strict=True):
        _attention(spec.self_attention, layer.self_attention, layer.self_attention_norm, False)
        if layer.cross is not None:
            _attention(spec.attention, layer.cross, layer.cross_norm, True)
        _linear(spec.ffn.linear_0, [layer.fc1])
        _linear(spec.ffn.linear_1, [layer.fc2])
        _norm(spec.ffn.layer_norm, layer.ffn_norm)


def build_spec(loaded: restore.Loaded):
    """The checkpoint as a ctranslate2.specs.TransformerSpec, vocabulary registered."""
    _import_ct2()  # a clear message when the extra is missing
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = loaded.model_config
    w = weights_lib.extract(loaded.params, cfg, loaded.task)
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELUTanh}
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.num_encoder_layers, cfg.num_decoder_layers),
        cfg.num_heads,
        pre_norm=False,
        activation=activation[cfg.activation],
    )
    positions = sinusoidal_table(max(1024, max_decode_len(loaded)), cfg.d_model)
    scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
    for stack, layers in ((spec.encoder, w.encoder), (spec.decoder, w.decoder)):
        embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
        embeddings.weight = w.embedding
        stack.scale_embeddings = scale
        stack.position_encodings.encodings = positions
        _layers(stack.layer, layers)
    spec.decoder.projection.weight = w.embedding  # tied output logits x E^T
    pieces = weights_lib.vocabulary(loaded.tokenizer, cfg.vocab_size)
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.layer_norm_epsilon = cfg.norm_epsilon
    spec.config.unk_token = pieces[UNK_ID]
    spec.config.bos_token = pieces[BOS_ID]
    spec.config.eos_token = pieces[EOS_ID]
    spec.config.decoder_start_token = pieces[cfg.bos_id]
    spec.config.add_source_eos = True
    return spec


def export(
    loaded: restore.Loaded, out: str | epath.PathLike, *, quantization: str = "float32"
) -> epath.Path:
    """Writes the CTranslate2 model directory `out` (replaced if it exists), its weights
    stored as `quantization` (int8: 8-bit weights, float32 activations)."""
    ct2 = _import_ct2()
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}; expected one of {QUANTIZATIONS}")

    class _Converter(ct2.converters.Converter):
        def _load(self):
            return build_spec(loaded)

    out = epath.Path(out)
    _Converter().convert(str(out), quantization=quantization, force=True)
    loaded.tokenizer.save(out / "sentencepiece.model")  # to turn text into pieces and back
    return out
