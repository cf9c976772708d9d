"""Model FLOPs of a Transformer step, for MFU (model FLOPs utilisation).

Shape letters: B batch rows, S source length, L target length, M d_model, H query heads,
K key/value heads, D query/key head dim (d_k), E value head dim (d_v, default D), F d_ff,
V output vocabulary, N_e / N_d encoder / decoder layers.

Only matrix multiplications are counted, 2 FLOPs per multiply-add (norms, softmax, dropout
and the optimizer are a few percent and are left out, as in Kaplan et al. 2020 and the PaLM
paper's MFU). Forward pass:

    encoder layer   2BS M((H+K)D + KE) + 2BS HE M  Q, K, V and output projections
                  + 2B H S^2 (D+E)                 scores QK^T and weights x V
                  + 2BS M F n_ffn                  FFN (n_ffn = 2 matrices, 3 for SwiGLU)
    decoder layer   2BL M((H+K)D + KE) + 2BL HE M + 2B H L^2 (D+E) + 2BL M F n_ffn  (self)
                  + 2BL M HD + 2BL HE M + 2BS M K(D+E) + 2B H L S (D+E)          (cross)
    output          2BL M V                         (logits; tied or not, the same matmul)

    train step    = 3 x forward (the backward pass: two matmuls for each forward one)

Attention terms count the whole L x L (or L x S) score matrix, causal or padded positions
included, because that is what the dense implementation computes. Embedding lookups are
gathers (0 FLOPs). With H D = M, E = D, K = H and no SwiGLU, an encoder layer is
8BSM^2 + 4BS^2M + 4BSMF: "6 x parameters x tokens" plus the attention terms for training.
tests/test_flops.py checks these counts against the matmuls in the model's own jaxpr.
"""

from __future__ import annotations

import dataclasses

from tx_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one forward pass, split by where they go; `train` is 3 x `forward`."""

    projections: int  # Q/K/V/O projections, all layers
    attention: int  # scores and weighted sums, all layers
    ffn: int  # feed-forward matmuls, all layers
    logits: int  # output projection onto the vocabulary

    @property
    def forward(self) -> int:
        return self.projections + self.attention + self.ffn + self.logits

    @property
    def train(self) -> int:
        return 3 * self.forward


def _dims(cfg: ModelConfig) -> tuple[int, int, int, int, int, int, int]:
    H = cfg.num_heads
    K = cfg.num_kv_heads or H
    D = cfg.head_dim or cfg.d_model // H
    n_ffn = 3 if cfg.activation == "swiglu" else 2
    return cfg.d_model, H, K, D, cfg.value_head_dim or D, cfg.d_ff, n_ffn


def encoder_decoder_flops(cfg: ModelConfig, batch: int, source_len: int, target_len: int):
    """StepFlops of an EncoderDecoder on [batch, source_len] inputs, [batch, target_len]
    targets (padded lengths: padding is computed, so it is counted)."""
    M, H, K, D, E, F, n_ffn = _dims(cfg)
    B, S, L = batch, source_len, target_len
    self_proj = lambda T: 2 * B * T * M * ((H + K) * D + K * E) + 2 * B * T * H * E * M  # noqa: E731
    cross_proj = 2 * B * L * M * H * D + 2 * B * L * H * E * M + 2 * B * S * M * K * (D + E)
    proj = cfg.num_encoder_layers * self_proj(S) + cfg.num_decoder_layers * (
        self_proj(L) + cross_proj
    )
    attn = cfg.num_encoder_layers * 2 * B * H * S * S * (D + E) + cfg.num_decoder_layers * (
        2 * B * H * L * L * (D + E) + 2 * B * H * L * S * (D + E)
    )
    ffn = 2 * B * M * F * n_ffn * (cfg.num_encoder_layers * S + cfg.num_decoder_layers * L)
    logits = 2 * B * L * M * cfg.output_vocab_size
    return StepFlops(proj, attn, ffn, logits)


def decoder_only_flops(cfg: ModelConfig, batch: int, length: int) -> StepFlops:
    """StepFlops of a DecoderOnly (no encoder, no cross-attention) on [batch, length]."""
    M, H, K, D, E, F, n_ffn = _dims(cfg)
    B, L, N = batch, length, cfg.num_decoder_layers
    proj = N * (2 * B * L * M * ((H + K) * D + K * E) + 2 * B * L * H * E * M)
    return StepFlops(
        projections=proj,
        attention=N * 2 * B * H * L * L * (D + E),
        ffn=N * 2 * B * L * M * F * n_ffn,
        logits=2 * B * L * M * cfg.output_vocab_size,
    )
