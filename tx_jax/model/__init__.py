"""The model layer: pure Flax modules and functions, no devices, no data.

positional <- attention (its kernels in ops/) <- multihead <- layers <- transformer, all configured
by config.ModelConfig.
"""

from tx_jax.model.config import VARIANTS, ModelConfig, variant
from tx_jax.model.transformer import (
    TASKS,
    Decoder,
    DecoderOnly,
    Encoder,
    EncoderDecoder,
    count_params,
    init_params,
    make_model,
    shift_right,
)

__all__ = [
    "TASKS",
    "VARIANTS",
    "Decoder",
    "DecoderOnly",
    "Encoder",
    "EncoderDecoder",
    "ModelConfig",
    "count_params",
    "init_params",
    "make_model",
    "shift_right",
    "variant",
]
