"""The Transformer (Vaswani et al. 2017) and two descendants, in pure Flax linen.

    EncoderDecoder  the paper's model: translation (encode / decode / __call__)
    DecoderOnly     a causal language model (GPT-style)
    EncoderOnly     a bidirectional encoder with a pooled output (classification, embeddings)

Shape letters: B batch, S source length, L target length, M d_model, V vocabulary.
Token id 0 is padding and only padding; segment ids mark packed examples (0 = padding).

`ModelConfig` is the frozen dataclass every module takes; `ModelConfig.from_config` is the
one place a ConfigDict (or dict) becomes one, and it validates every key. Decode and eval
variants come from `config.replace(decode=True, ...)`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tx_jax.attention import IMPLEMENTATIONS
from tx_jax.dropout import Dropout
from tx_jax.layers import ACTIVATIONS, NORMS, DecoderLayer, EncoderLayer, make_norm
from tx_jax.matmul import dense, tied_logits
from tx_jax.positional import LearnedPositionalEmbedding, default_positions, sinusoid

Array = jax.Array
POSITIONALS = ("sinusoidal", "learned", "rope", "none")
NORM_POSITIONS = ("post", "pre")
POOLINGS = ("mean", "first")
REMATS = ("none", "full")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every architectural choice, one field each (defaults: the paper's base model)."""

    vocab_size: int = 32_000  # source vocabulary (and target, when shared)
    target_vocab_size: int | None = None  # None: same as vocab_size
    d_model: int = 512  # M
    num_heads: int = 8  # H
    num_kv_heads: int | None = None  # K < H: grouped-query attention; None: K = H
    head_dim: int | None = None  # D; None: d_model // num_heads (the paper's d_k = d_v)
    d_ff: int = 2048  # F, the FFN's inner width
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout_rate: float = 0.1  # residual and embedding dropout, P_drop (section 5.4)
    attention_dropout_rate: float = 0.0  # on the attention weights
    ffn_dropout_rate: float = 0.0  # on the FFN's hidden activations
    activation: str = "relu"  # relu | gelu | swiglu
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_position: str = "post"  # post (paper) | pre
    norm_epsilon: float = 1e-6
    positional: str = "sinusoidal"  # sinusoidal | learned | rope | none
    max_len: int = 512  # size of the learned position table
    rope_base: float = 10_000.0
    share_embeddings: bool = True  # one source/target embedding (needs a shared vocabulary)
    tie_output: bool = True  # output logits = x E^T with the target embedding E (3.4)
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model) (3.4)
    attention_bias: bool = False  # biases in the Q/K/V/O projections
    ffn_bias: bool = True  # biases in the FFN (eq. 2 has b1, b2)
    attention_impl: str = "auto"  # auto | xla | chunked | cudnn
    dtype: str = "float32"  # compute dtype (activations, matmuls)
    param_dtype: str = "float32"  # storage dtype of the parameters
    remat: str = "none"  # none | full: recompute each layer in the backward pass
    bos_id: int = 2  # first decoder input (never 0: that is padding)
    num_classes: int = 0  # EncoderOnly: > 0 adds a classification head
    pooling: str = "mean"  # EncoderOnly: mean (over real tokens) | first
    decode: bool = False  # incremental decoding with a KV cache
    sow_attention_weights: bool = False  # store attention maps in 'intermediates'

    def __post_init__(self):
        self.validate()

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any, **overrides: Any) -> ModelConfig:
        """ConfigDict / dict (e.g. `config.model`) -> ModelConfig, naming any unknown key."""
        items = dict(config.items() if hasattr(config, "items") else config)
        items.update(overrides)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(items) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; valid keys: {sorted(known)}")
        return cls(**items)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        enums = {
            "activation": ACTIVATIONS, "norm": NORMS, "norm_position": NORM_POSITIONS,
            "positional": POSITIONALS, "attention_impl": IMPLEMENTATIONS, "pooling": POOLINGS,
            "remat": REMATS, "dtype": DTYPES, "param_dtype": DTYPES,
        }  # fmt: skip
        for key, allowed in enums.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"model.{key}={getattr(self, key)!r}; expected one of {allowed}")
        for key in ("vocab_size", "d_model", "num_heads", "d_ff", "max_len"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads="
                f"{self.num_heads} (or set model.head_dim)"
            )
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not divisible by "
                f"model.num_kv_heads={self.num_kv_heads}"
            )
        if self.share_embeddings and self.target_vocab_size not in (None, self.vocab_size):
            raise ValueError(
                "model.share_embeddings=True needs model.target_vocab_size == vocab_size"
            )
        if self.bos_id == 0:
            raise ValueError("model.bos_id=0 collides with padding (id 0)")
        for key in ("dropout_rate", "attention_dropout_rate", "ffn_dropout_rate"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be in [0, 1)")
        if self.positional == "rope" and (self.head_dim or self.d_model // self.num_heads) % 2:
            raise ValueError("model.positional='rope' needs an even head dimension")

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)

    @property
    def output_vocab_size(self) -> int:
        return self.target_vocab_size or self.vocab_size


# The paper's Table 3: base and big (plus CPU-sized variants for tests and the default task).
VARIANTS: dict[str, dict[str, Any]] = {
    "base": dict(d_model=512, d_ff=2048, num_heads=8, num_encoder_layers=6,
                 num_decoder_layers=6, dropout_rate=0.1),
    "big": dict(d_model=1024, d_ff=4096, num_heads=16, num_encoder_layers=6,
                num_decoder_layers=6, dropout_rate=0.3),
    "small": dict(d_model=256, d_ff=1024, num_heads=4, num_encoder_layers=3,
                  num_decoder_layers=3, dropout_rate=0.1),
    "tiny": dict(d_model=64, d_ff=128, num_heads=4, num_encoder_layers=2,
                 num_decoder_layers=2, dropout_rate=0.0),
}  # fmt: skip


def variant(name: str, **overrides: Any) -> ModelConfig:
    """ModelConfig of a named variant, e.g. variant('base', vocab_size=37_000)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown model variant {name!r}; expected one of {sorted(VARIANTS)}")
    return ModelConfig(**{**VARIANTS[name], **overrides})


def shift_right(targets: Array, bos_id: int, segment_ids: Array | None = None) -> Array:
    """Decoder inputs for teacher forcing: [B, L] -> [B, L], BOS at every example's start.

    With packing, each segment starts with BOS and never sees the previous segment's last
    token; padding positions (segment 0) stay 0.
    """
    shifted = jnp.pad(targets, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]
    if segment_ids is None:
        return shifted
    prev = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
    shifted = jnp.where(segment_ids != prev, bos_id, shifted)
    return jnp.where(segment_ids == 0, 0, shifted)


class Embedding(nn.Module):
    """Token embedding E [V, M]; `attend` gives tied output logits x E^T (section 3.4)."""

    num_embeddings: int
    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        # With sqrt(M) scaling, std M^-0.5 gives unit-variance scaled embeddings.
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(
                nn.initializers.normal(self.features**-0.5), ("vocab", "embed")
            ),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(self, tokens: Array) -> Array:
        """[B, L] int -> [B, L, M]."""
        return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)

    def attend(self, x: Array) -> Array:
        """[B, L, M] -> [B, L, V] logits against the embedding table."""
        return tied_logits(x, self.embedding.astype(self.dtype))


def _embedding(cfg: ModelConfig, vocab: int, name: str) -> Embedding:
    return Embedding(vocab, cfg.d_model, cfg.compute_dtype, cfg.parameter_dtype, name=name)


def _layer_cls(cls: type[nn.Module], cfg: ModelConfig) -> type[nn.Module]:
    # Argument 0 is the module itself, so `deterministic` (the last one) is static.
    if cfg.remat == "full":
        n_args = {EncoderLayer: 4, DecoderLayer: 6}[cls]
        return nn.remat(cls, static_argnums=(n_args,))
    return cls


class _Stack(nn.Module):
    """Embedding + position information + dropout, shared by the encoder and decoders."""

    config: ModelConfig
    embed: Embedding

    def embed_tokens(self, tokens: Array, positions: Array, deterministic: bool) -> Array:
        cfg = self.config
        x = self.embed(tokens)  # [B, L, M]
        if cfg.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(cfg.d_model), x.dtype)
        if cfg.positional == "sinusoidal":
            x = x + sinusoid(positions, cfg.d_model).astype(x.dtype)
        elif cfg.positional == "learned":
            x = x + LearnedPositionalEmbedding(
                cfg.max_len, cfg.d_model, cfg.compute_dtype, cfg.parameter_dtype,
                name="pos_embedding",
            )(positions)  # fmt: skip
        x = Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))

    def final_norm(self, x: Array) -> Array:
        cfg = self.config
        if cfg.norm_position != "pre":  # post-LN already ends every layer with a norm
            return x
        norm = make_norm(cfg.norm, cfg.norm_epsilon, cfg.compute_dtype, cfg.parameter_dtype,
                         "final_norm")  # fmt: skip
        return norm(x)


class Encoder(_Stack):
    """tokens [B, S] -> [B, S, M]. segment ids default to (tokens != 0)."""

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        *,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        cfg = self.config
        if segment_ids is None:
            segment_ids = (tokens != 0).astype(jnp.int32)
        if positions is None:
            positions = default_positions(tokens)
        x = self.embed_tokens(tokens, positions, deterministic)
        layer = _layer_cls(EncoderLayer, cfg)
        for i in range(cfg.num_encoder_layers):
            x = layer(cfg, name=f"layer_{i}")(x, segment_ids, positions, deterministic)
        return self.final_norm(x)


class Decoder(_Stack):
    """Decoder inputs [B, L] (already shifted) -> logits [B, L, V] in float32.

    With `encoded` [B, S, M] it cross-attends (EncoderDecoder); with encoded=None and
    cross_attention=False it is a language model. In decode mode, positions come from a
    counter in the 'cache' collection.
    """

    cross_attention: bool = True

    @nn.compact
    def __call__(
        self,
        decoder_inputs: Array,
        encoded: Array | None = None,
        *,
        src_segment_ids: Array | None = None,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        cfg = self.config
        if cfg.decode:
            positions = self._decode_positions(decoder_inputs, positions)
            segment_ids = None  # the KV cache mask replaces segment masks
        else:
            if segment_ids is None:
                segment_ids = (decoder_inputs != 0).astype(jnp.int32)
            if positions is None:
                positions = default_positions(decoder_inputs)
        x = self.embed_tokens(decoder_inputs, positions, deterministic)
        layer = _layer_cls(DecoderLayer, cfg)
        for i in range(cfg.num_decoder_layers):
            x = layer(cfg, cross_attention=self.cross_attention, name=f"layer_{i}")(
                x, encoded, segment_ids, src_segment_ids, positions, deterministic
            )
        x = self.final_norm(x)
        if cfg.tie_output:
            logits = self.embed.attend(x)
        else:
            kernel = self.param(
                "logits_kernel",
                nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "vocab")),
                (cfg.d_model, cfg.output_vocab_size),
                cfg.parameter_dtype,
            )
            logits = dense(x, kernel.astype(x.dtype))
        logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
        return logits.astype(jnp.float32)

    def _decode_positions(self, tokens: Array, positions: Array | None) -> Array:
        initialised = self.has_variable("cache", "position")
        counter = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
        start = counter.value if initialised else 0
        if initialised:
            counter.value = counter.value + tokens.shape[1]
        if positions is not None:
            return positions
        return jnp.broadcast_to(start + jnp.arange(tokens.shape[1])[None], tokens.shape)


class EncoderDecoder(nn.Module):
    """The Transformer of the paper. inputs [B, S], targets [B, L] -> logits [B, L, V]."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.source_embed = _embedding(cfg, cfg.vocab_size, "source_embed")
        if cfg.share_embeddings:
            self.target_embed = self.source_embed
        else:
            self.target_embed = _embedding(cfg, cfg.output_vocab_size, "target_embed")
        self.encoder = Encoder(cfg, self.source_embed)
        self.decoder = Decoder(cfg, self.target_embed)

    def encode(
        self,
        inputs: Array,
        *,
        inputs_segmentation: Array | None = None,
        inputs_positions: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """inputs [B, S] -> encoded [B, S, M]."""
        return self.encoder(
            inputs, segment_ids=inputs_segmentation, positions=inputs_positions,
            deterministic=deterministic,
        )  # fmt: skip

    def decode(
        self,
        encoded: Array,
        inputs: Array,
        decoder_inputs: Array,
        *,
        inputs_segmentation: Array | None = None,
        targets_segmentation: Array | None = None,
        targets_positions: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """encoded [B, S, M], source tokens [B, S] (for the padding mask), decoder inputs
        [B, L] (shifted targets; one token at a time when decoding) -> logits [B, L, V]."""
        if inputs_segmentation is None:
            inputs_segmentation = (inputs != 0).astype(jnp.int32)
        return self.decoder(
            decoder_inputs, encoded, src_segment_ids=inputs_segmentation,
            segment_ids=targets_segmentation, positions=targets_positions,
            deterministic=deterministic,
        )  # fmt: skip

    def __call__(
        self,
        inputs: Array,
        targets: Array,
        *,
        inputs_segmentation: Array | None = None,
        targets_segmentation: Array | None = None,
        inputs_positions: Array | None = None,
        targets_positions: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """Teacher forcing: logits[:, t] predicts targets[:, t] from targets[:, :t]."""
        encoded = self.encode(
            inputs, inputs_segmentation=inputs_segmentation,
            inputs_positions=inputs_positions, deterministic=deterministic,
        )  # fmt: skip
        if targets_segmentation is None:
            targets_segmentation = (targets != 0).astype(jnp.int32)
        decoder_inputs = shift_right(targets, self.config.bos_id, targets_segmentation)
        return self.decode(
            encoded, inputs, decoder_inputs, inputs_segmentation=inputs_segmentation,
            targets_segmentation=targets_segmentation, targets_positions=targets_positions,
            deterministic=deterministic,
        )  # fmt: skip


class DecoderOnly(nn.Module):
    """Causal language model. targets [B, L] -> logits [B, L, V] (shifted internally);
    in decode mode the input is the previous token(s) as is."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.embed = _embedding(cfg, cfg.vocab_size, "embed")
        self.decoder = Decoder(cfg, self.embed, cross_attention=False)

    def __call__(
        self,
        targets: Array,
        *,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        cfg = self.config
        if cfg.decode:
            inputs = targets
        else:
            if segment_ids is None:
                segment_ids = (targets != 0).astype(jnp.int32)
            inputs = shift_right(targets, cfg.bos_id, segment_ids)
        return self.decoder(
            inputs, None, segment_ids=segment_ids, positions=positions,
            deterministic=deterministic,
        )  # fmt: skip


class EncoderOnly(nn.Module):
    """Bidirectional encoder. tokens [B, S] -> pooled [B, M], or logits [B, num_classes]
    when config.num_classes > 0. `encode` gives the per-token output [B, S, M]."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.embed = _embedding(cfg, cfg.vocab_size, "embed")
        self.encoder = Encoder(cfg, self.embed)
        if cfg.num_classes > 0:
            self.classifier = nn.Dense(
                cfg.num_classes,
                dtype=cfg.compute_dtype,
                param_dtype=cfg.parameter_dtype,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.xavier_uniform(), ("embed", None)
                ),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)),
            )

    def encode(self, tokens: Array, *, deterministic: bool = True, **kw: Array) -> Array:
        return self.encoder(tokens, deterministic=deterministic, **kw)

    def __call__(
        self,
        tokens: Array,
        *,
        segment_ids: Array | None = None,
        positions: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        x = self.encoder(
            tokens, segment_ids=segment_ids, positions=positions, deterministic=deterministic
        )
        if self.config.pooling == "first":
            pooled = x[:, 0]
        else:  # mean over real tokens only, so padding never changes the result
            valid = (tokens != 0)[..., None].astype(x.dtype)
            pooled = (x * valid).sum(1) / jnp.maximum(valid.sum(1), 1)
        if self.config.num_classes > 0:
            return self.classifier(pooled).astype(jnp.float32)
        return pooled


def count_params(params: Any) -> int:
    """Number of scalars in a (possibly boxed) parameter tree."""
    return sum(x.size for x in jax.tree_util.tree_leaves(nn.meta.unbox(params)))
