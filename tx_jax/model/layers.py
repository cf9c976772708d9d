"""Feed-forward, normalisation, and the encoder and decoder layers (paper section 3.1-3.3).

Shape letters: B batch, L target length, S source length, M model dim, F d_ff.

Each sub-layer is wrapped in a residual connection with dropout (section 5.4), in one of
two orders (`ModelConfig.norm_position`):
    'post' (the paper):  x = Norm(x + Dropout(Sublayer(x)))
    'pre' (Xiong et al. 2020, most descendants):  x = x + Dropout(Sublayer(Norm(x)))
Pre-LN stacks end with one more Norm (Encoder/Decoder in transformer.py add it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tx_jax.model.config import ACTIVATIONS, NORMS, ModelConfig
from tx_jax.model.lora import LoRA, adapt
from tx_jax.model.multihead import MultiHeadAttention
from tx_jax.ops.kernels import Dropout, bias_add, dense

Array = jax.Array


def _dense_init() -> Callable:
    return nn.initializers.xavier_uniform()


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (eq. 2); 'gelu' (tanh approximation), 'gelu_exact'
    (erf), 'silu' (x sigmoid(x), Marian's "swish") in place of max(0, .), or 'swiglu' (Shazeer
    2020): (silu(x W1) * x W3) W2. [B, L, M] -> [B, L, M]; dropout on the hidden activations."""

    d_ff: int
    activation: str = "relu"
    dropout_rate: float = 0.0
    use_bias: bool = True
    kernels: str = "generic"  # ModelConfig.kernels
    dropout_bits: str = "bernoulli"  # ModelConfig.dropout_bits
    dtype: Any = None
    param_dtype: Any = jnp.float32
    lora: LoRA = LoRA()  # low-rank adapters on wi, wi_gate, wo (lora.py)

    def _params(self, name: str, shape: tuple[int, int], axes: tuple[str, str]):
        """`name`_kernel [K, N] and, with use_bias, `name`_bias [N] (else None)."""
        kernel = self.param(
            f"{name}_kernel",
            nn.with_logical_partitioning(_dense_init(), axes),
            shape,
            self.param_dtype,
        )
        if not self.use_bias:
            return kernel, None
        bias = self.param(
            f"{name}_bias",
            nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]),
            shape[1:],
            self.param_dtype,
        )
        return kernel, bias

    def _dense(self, x: Array, features: int, axes: tuple[str, str], name: str, det: bool):
        kernel, b = self._params(name, (x.shape[-1], features), axes)
        dtype = self.dtype or x.dtype
        x = x.astype(dtype)
        y = dense(x, kernel.astype(dtype), kernels=self.kernels)  # [B, L, M] @ [M, F]
        y = adapt(
            self, name, x, y, self.lora, deterministic=det, kernels=self.kernels,
            dropout_bits=self.dropout_bits,
        )  # fmt: skip
        if b is not None:
            y = bias_add(y, b.astype(dtype), kernels=self.kernels)
        return y

    @nn.compact
    def __call__(self, x: Array, deterministic: bool = True) -> Array:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}; expected one of {ACTIVATIONS}")
        M = x.shape[-1]
        h = self._dense(x, self.d_ff, ("embed", "mlp"), "wi", deterministic)  # [B, L, F]
        if self.activation == "relu":
            h = nn.relu(h)
        elif self.activation == "gelu":
            h = nn.gelu(h)
        elif self.activation == "gelu_exact":
            h = nn.gelu(h, approximate=False)
        elif self.activation == "silu":
            h = nn.silu(h)
        else:  # swiglu
            h = nn.silu(h) * self._dense(x, self.d_ff, ("embed", "mlp"), "wi_gate", deterministic)
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        h = Dropout(self.dropout_rate, self.dropout_bits)(h, deterministic=deterministic)
        return self._dense(h, M, ("mlp", "embed"), "wo", deterministic)


def make_norm(kind: str, epsilon: float, dtype: Any, param_dtype: Any, name: str) -> nn.Module:
    """LayerNorm (Ba et al. 2016, the paper's choice) or RMSNorm (Zhang & Sennrich 2019)."""
    scale_init = nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",))
    if kind == "layernorm":
        bias_init = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",))
        return nn.LayerNorm(
            epsilon=epsilon,
            dtype=dtype,
            param_dtype=param_dtype,
            scale_init=scale_init,
            bias_init=bias_init,
            name=name,
        )
    if kind == "rmsnorm":
        return nn.RMSNorm(
            epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, scale_init=scale_init, name=name
        )
    raise ValueError(f"norm={kind!r}; expected one of {NORMS}")


class _ResidualLayer(nn.Module):
    """Shared plumbing: one residual sub-layer in the configured LN order."""

    config: ModelConfig

    def residual(self, x: Array, fn: Callable[[Array], Array], name: str, det: bool) -> Array:
        cfg = self.config
        drop = Dropout(cfg.dropout_rate, cfg.dropout_bits, name=f"{name}_dropout")
        norm = make_norm(
            cfg.norm, cfg.norm_epsilon, cfg.compute_dtype, cfg.parameter_dtype, f"{name}_norm"
        )
        if cfg.norm_position == "pre":
            x = x + drop(fn(norm(x)), deterministic=det)
        else:
            x = norm(x + drop(fn(x), deterministic=det))
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))

    def attention(self, name: str, *, cross: bool) -> MultiHeadAttention:
        cfg = self.config
        return MultiHeadAttention(
            num_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            value_head_dim=cfg.value_head_dim,
            num_kv_heads=cfg.num_kv_heads,
            use_bias=cfg.attention_bias,
            dropout_rate=cfg.attention_dropout_rate,
            implementation=cfg.attention_impl,
            rope_base=cfg.rope_base if (cfg.positional == "rope" and not cross) else None,
            decode=cfg.decode,
            beams=cfg.decode_beams,
            sow_weights=cfg.sow_attention_weights,
            kernels=cfg.kernels,
            dropout_bits=cfg.dropout_bits,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.parameter_dtype,
            lora=cfg.lora,
            name=name,
        )

    def self_attention(
        self,
        x: Array,
        segment_ids: Array | None,
        positions: Array | None,
        det: bool,
        *,
        causal: bool,
    ) -> Array:
        """The self-attention sub-layer: x [B, T, M] -> [B, T, M] (causal in the decoder)."""
        attn = self.attention("self_attention", cross=False)

        def call(y: Array) -> Array:
            return attn(
                y,
                is_causal=causal,
                q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids,
                q_positions=positions,
                kv_positions=positions,
                deterministic=det,
            )

        return self.residual(x, call, "self_attention", det)

    def feed_forward(self) -> FeedForward:
        cfg = self.config
        return FeedForward(
            d_ff=cfg.d_ff,
            activation=cfg.activation,
            dropout_rate=cfg.ffn_dropout_rate,
            use_bias=cfg.ffn_bias,
            kernels=cfg.kernels,
            dropout_bits=cfg.dropout_bits,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.parameter_dtype,
            lora=cfg.lora,
            name="ffn",
        )


class EncoderLayer(_ResidualLayer):
    """Self-attention then FFN, each in a residual sub-layer. x [B, S, M] -> [B, S, M].

    segment_ids [B, S] (0 = padding) mask padding and packed neighbours; positions [B, S]
    feed RoPE when it is on.
    """

    @nn.compact
    def __call__(
        self, x: Array, segment_ids: Array, positions: Array, deterministic: bool = True
    ) -> Array:
        x = self.self_attention(x, segment_ids, positions, deterministic, causal=False)
        ffn = self.feed_forward()
        return self.residual(x, lambda y: ffn(y, deterministic), "ffn", deterministic)


class DecoderLayer(_ResidualLayer):
    """Masked self-attention, cross-attention over the encoder output (skipped when
    `cross_attention` is False: the decoder-only LM), then FFN.

    x [B, L, M], encoded [B, S, M] or None; segment ids 0 = padding.
    """

    cross_attention: bool = True

    @nn.compact
    def __call__(
        self,
        x: Array,
        encoded: Array | None,
        segment_ids: Array | None,
        src_segment_ids: Array | None,
        positions: Array | None,
        deterministic: bool = True,
    ) -> Array:
        x = self.self_attention(x, segment_ids, positions, deterministic, causal=True)
        if self.cross_attention:
            cross = self.attention("cross_attention", cross=True)
            q_seg = segment_ids
            if q_seg is None:  # decoding: the query positions are real tokens
                q_seg = jnp.ones(x.shape[:2], jnp.int32)
            x = self.residual(
                x,
                lambda y: cross(
                    y,
                    encoded,
                    q_segment_ids=q_seg,
                    kv_segment_ids=src_segment_ids,
                    deterministic=deterministic,
                ),
                "cross_attention",
                deterministic,
            )
        ffn = self.feed_forward()
        return self.residual(x, lambda y: ffn(y, deterministic), "ffn", deterministic)
