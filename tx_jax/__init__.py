"""tx_jax: the Transformer ("Attention Is All You Need") and its descendants in JAX/Flax.

The public model API; data, training and decoding live in their own modules
(tx_jax.data, tx_jax.train, tx_jax.decoding) and are imported from there.
"""

from tx_jax.attention import (
    MultiHeadAttention,
    causal_mask,
    combine_masks,
    dense_mask,
    dot_product_attention,
    padding_mask,
    segment_mask,
)
from tx_jax.layers import DecoderLayer, EncoderLayer, FeedForward, make_norm
from tx_jax.models import (
    VARIANTS,
    Decoder,
    DecoderOnly,
    Encoder,
    EncoderDecoder,
    EncoderOnly,
    ModelConfig,
    count_params,
    shift_right,
    variant,
)
from tx_jax.positional import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    apply_rope,
    sinusoid,
    sinusoidal_table,
)

__version__ = "0.1.0"

__all__ = [
    "VARIANTS",
    "Decoder",
    "DecoderLayer",
    "DecoderOnly",
    "Encoder",
    "EncoderDecoder",
    "EncoderLayer",
    "EncoderOnly",
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
    "make_norm",
    "padding_mask",
    "segment_mask",
    "shift_right",
    "sinusoid",
    "sinusoidal_table",
    "variant",
]
