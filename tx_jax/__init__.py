"""tx_jax: the Transformer ("Attention Is All You Need") and its descendants in JAX/Flax.

The package is layered (docs/design.md "Architecture"); this module re-exports the model API and
gives short names to the modules researchers use most:

    tx_jax.EncoderDecoder, tx_jax.variant("base"), ...       the model (tx_jax.model)
    tx_jax.train_and_evaluate(config, workdir)               a run (tx_jax.runner.loop)
    tx_jax.restore.load(workdir), tx_jax.averaging, tx_jax.evaluation, tx_jax.multilingual,
    tx_jax.decoding, tx_jax.translation, tx_jax.generation   (tx_jax.inference.*)
    tx_jax.similarity, tx_jax.flops                           (tx_jax.analysis.*)

The modules are imported on first use, so `import tx_jax` loads the model code alone.
"""

import importlib
from typing import Any

from tx_jax.model import (
    VARIANTS,
    Decoder,
    DecoderOnly,
    Encoder,
    EncoderDecoder,
    ModelConfig,
    count_params,
    make_model,
    shift_right,
    variant,
)
from tx_jax.model.attention import dot_product_attention
from tx_jax.model.layers import DecoderLayer, EncoderLayer, FeedForward, make_norm
from tx_jax.model.multihead import MultiHeadAttention
from tx_jax.model.positional import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    apply_rope,
    sinusoid,
    sinusoidal_table,
)
from tx_jax.ops.masks import (
    causal_mask,
    combine_masks,
    dense_mask,
    padding_mask,
    segment_mask,
)

__version__ = "0.1.0"

_LAZY = {
    "restore": "tx_jax.inference.restore",
    "averaging": "tx_jax.inference.averaging",
    "decoding": "tx_jax.inference.decoding",
    "evaluation": "tx_jax.inference.evaluation",
    "multilingual": "tx_jax.inference.multilingual",
    "translation": "tx_jax.inference.translation",
    "generation": "tx_jax.inference.generation",
    "similarity": "tx_jax.analysis.similarity",
    "flops": "tx_jax.analysis.flops",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(_LAZY[name])
    if name == "train_and_evaluate":
        return importlib.import_module("tx_jax.runner.loop").train_and_evaluate
    raise AttributeError(f"module 'tx_jax' has no attribute {name!r}")


__all__ = [
    "VARIANTS",
    "Decoder",
    "DecoderLayer",
    "DecoderOnly",
    "Encoder",
    "EncoderDecoder",
    "EncoderLayer",
    "FeedForward",
    "LearnedPositionalEmbedding",
    "ModelConfig",
    "MultiHeadAttention",
    "SinusoidalPositionalEncoding",
    "apply_rope",
    "causal_mask",
    "combine_masks",
    "count_params",
    "dense_mask",
    "dot_product_attention",
    "make_model",
    "make_norm",
    "padding_mask",
    "segment_mask",
    "shift_right",
    "sinusoid",
    "sinusoidal_table",
    "variant",
]
