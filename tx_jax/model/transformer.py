"""The Transformer (Vaswani et al. 2017) and a descendant, in pure Flax linen.

    EncoderDecoder  the paper's model: translation (encode / decode / __call__)
    DecoderOnly     a causal language model (GPT-style)

Shape letters: B batch, S source length, L target length, M d_model, V vocabulary.
Token id 0 is padding and only padding; segment ids mark packed examples (0 = padding).

`ModelConfig` (config.py) is the frozen dataclass every module takes;
`ModelConfig.from_config` is the one place a ConfigDict (or dict) becomes one, and it validates
every key. Decode and eval variants come from `config.replace(decode=True, ...)`.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tx_jax.model.config import ModelConfig
from tx_jax.model.layers import DecoderLayer, EncoderLayer, make_norm
from tx_jax.model.positional import LearnedPositionalEmbedding, default_positions, sinusoid
from tx_jax.ops.kernels import Dropout, dense, tied_logits

Array = jax.Array


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


def decoder_segment_ids(decoder_inputs: Array, bos_id: int) -> Array:
    """Default segment ids of unpacked decoder inputs [B, L] -> [B, L] int32: 1 on tokens,
    0 on padding. A start token of id 0 (bos_id=0, Marian's pad) is a token, not padding:
    column 0 of every row is then 1."""
    segment_ids = (decoder_inputs != 0).astype(jnp.int32)
    if bos_id == 0:
        segment_ids = segment_ids.at[:, 0].set(1)
    return segment_ids


class Embedding(nn.Module):
    """Token embedding E [V, M]; `attend` gives tied output logits x E^T (section 3.4)."""

    num_embeddings: int
    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernels: str = "generic"  # ModelConfig.kernels (the tied logits' product)

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
        return tied_logits(x, self.embedding.astype(self.dtype), self.kernels)


def _embedding(cfg: ModelConfig, vocab: int, name: str) -> Embedding:
    return Embedding(
        vocab, cfg.d_model, cfg.compute_dtype, cfg.parameter_dtype, cfg.kernels, name=name
    )


def _layer_cls(cls: type[nn.Module], cfg: ModelConfig) -> type[nn.Module]:
    if cfg.remat == "none":
        return cls
    # `deterministic` is static; argument 0 is the module itself, as in the signature
    static = tuple(inspect.signature(cls.__call__).parameters).index("deterministic")
    # 'dots': keep the outputs of matmuls without batch dimensions (the projections and the
    # FFN), recompute the rest (norms, softmax, dropout, activations) in the backward pass.
    policy = (
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable if cfg.remat == "dots" else None
    )
    return nn.remat(cls, static_argnums=(static,), policy=policy)


class _Stack(nn.Module):
    """Embedding + position information + dropout, shared by the encoder and decoders."""

    config: ModelConfig
    embed: Embedding

    def embed_tokens(self, tokens: Array, positions: Array, deterministic: bool) -> Array:
        cfg = self.config
        x = self.embed(tokens)  # [B, L, M]
        if cfg.scale_embeddings:  # section 3.4: embeddings times sqrt(d_model)
            x = x * jnp.asarray(math.sqrt(cfg.d_model), x.dtype)
        if cfg.position_offset:  # fairseq/M2M100: the first token sits at padding_idx + 1
            positions = positions + cfg.position_offset
        if cfg.positional == "sinusoidal":  # section 3.5: added to the embeddings
            pe = sinusoid(positions, cfg.d_model, style=cfg.sinusoid_style)
            x = x + pe.astype(x.dtype)
        elif cfg.positional == "learned":
            x = x + LearnedPositionalEmbedding(
                cfg.max_len,
                cfg.d_model,
                cfg.compute_dtype,
                cfg.parameter_dtype,
                name="pos_embedding",
            )(positions)
        x = Dropout(cfg.dropout_rate, cfg.dropout_bits)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))

    def final_norm(self, x: Array) -> Array:
        cfg = self.config
        if cfg.norm_position != "pre":  # post-LN already ends every layer with a norm
            return x
        norm = make_norm(
            cfg.norm, cfg.norm_epsilon, cfg.compute_dtype, cfg.parameter_dtype, "final_norm"
        )
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
    """Decoder inputs [B, L] (already shifted) -> logits [B, L, V] in float32, or with
    return_hidden=True the final hidden states [B, L, M] (compute dtype) that the output
    layer would project (the training loss's blocked path projects them itself, with the
    weights `output_weights` gives).

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
        return_hidden: bool = False,
    ) -> Array:
        cfg = self.config
        if cfg.decode:
            positions = self._decode_positions(decoder_inputs, positions)
            segment_ids = None  # the KV cache mask replaces segment masks
        else:
            if segment_ids is None:
                segment_ids = decoder_segment_ids(decoder_inputs, cfg.bos_id)
            if positions is None:
                positions = default_positions(decoder_inputs)
        x = self.embed_tokens(decoder_inputs, positions, deterministic)
        layer = _layer_cls(DecoderLayer, cfg)
        for i in range(cfg.num_decoder_layers):
            x = layer(cfg, cross_attention=self.cross_attention, name=f"layer_{i}")(
                x, encoded, segment_ids, src_segment_ids, positions, deterministic
            )
        x = self.final_norm(x)
        if return_hidden:
            return nn.with_logical_constraint(x, ("batch", "length", "embed"))
        if cfg.tie_output:
            logits = self.embed.attend(x)
        else:
            kernel = self.param(
                "logits_kernel",
                nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "vocab")),
                (cfg.d_model, cfg.output_vocab_size),
                cfg.parameter_dtype,
            )
            logits = dense(x, kernel.astype(x.dtype), kernels=cfg.kernels)
        logits = nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
        logits = logits.astype(jnp.float32)
        if cfg.logits_bias:  # Marian's final_logits_bias
            bias = self.param(
                "logits_bias",
                nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
                (cfg.output_vocab_size,),
                cfg.parameter_dtype,
            )
            logits = logits + bias.astype(jnp.float32)
        return logits

    def output_weights(self) -> tuple[Array, Array | None]:
        """(table [V, M], bias [V] or None) with logits = h table^T + bias: the tied embedding
        E, or the untied kernel's transpose W^T."""
        cfg = self.config
        params = nn.meta.unbox(self.variables["params"])
        table = self.embed.embedding if cfg.tie_output else params["logits_kernel"].T
        return table, params["logits_bias"] if cfg.logits_bias else None

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
            inputs,
            segment_ids=inputs_segmentation,
            positions=inputs_positions,
            deterministic=deterministic,
        )

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
        return_hidden: bool = False,
    ) -> Array:
        """encoded [B, S, M], source tokens [B, S] (for the padding mask), decoder inputs
        [B, L] (shifted targets; one token at a time when decoding) -> logits [B, L, V]
        (return_hidden: the final hidden states [B, L, M], see Decoder)."""
        if inputs_segmentation is None:
            inputs_segmentation = (inputs != 0).astype(jnp.int32)
        return self.decoder(
            decoder_inputs,
            encoded,
            src_segment_ids=inputs_segmentation,
            segment_ids=targets_segmentation,
            positions=targets_positions,
            deterministic=deterministic,
            return_hidden=return_hidden,
        )

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
        return_hidden: bool = False,
    ) -> Array:
        """Teacher forcing: logits[:, t] predicts targets[:, t] from targets[:, :t]
        (return_hidden: the hidden states [B, L, M] that project to them)."""
        encoded = self.encode(
            inputs,
            inputs_segmentation=inputs_segmentation,
            inputs_positions=inputs_positions,
            deterministic=deterministic,
        )
        if targets_segmentation is None:
            targets_segmentation = (targets != 0).astype(jnp.int32)
        decoder_inputs = shift_right(targets, self.config.bos_id, targets_segmentation)
        return self.decode(
            encoded,
            inputs,
            decoder_inputs,
            inputs_segmentation=inputs_segmentation,
            targets_segmentation=targets_segmentation,
            targets_positions=targets_positions,
            deterministic=deterministic,
            return_hidden=return_hidden,
        )

    def output_weights(self) -> tuple[Array, Array | None]:
        """The output layer's (table [V, M], bias [V] or None), logits = h table^T + bias:
        `model.apply({'params': params}, method='output_weights')`."""
        return self.decoder.output_weights()


class DecoderOnly(nn.Module):
    """Causal language model. targets [B, L] -> logits [B, L, V] (shifted internally), or
    the hidden states [B, L, M] with return_hidden=True (see Decoder); in decode mode the
    input is the previous token(s) as is."""

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
        return_hidden: bool = False,
    ) -> Array:
        cfg = self.config
        if cfg.decode:
            inputs = targets
        else:
            if segment_ids is None:
                segment_ids = (targets != 0).astype(jnp.int32)
            inputs = shift_right(targets, cfg.bos_id, segment_ids)
        return self.decoder(
            inputs,
            None,
            segment_ids=segment_ids,
            positions=positions,
            deterministic=deterministic,
            return_hidden=return_hidden,
        )

    def output_weights(self) -> tuple[Array, Array | None]:
        """As EncoderDecoder.output_weights."""
        return self.decoder.output_weights()


def count_params(params: Any) -> int:
    """Number of scalars in a (possibly boxed) parameter tree."""
    return sum(x.size for x in jax.tree_util.tree_leaves(nn.meta.unbox(params)))


TASKS = ("translation", "lm")  # config.task: which model class a run trains


def make_model(cfg: ModelConfig, task: str = "translation") -> EncoderDecoder | DecoderOnly:
    """The model a task trains: EncoderDecoder for 'translation', DecoderOnly for 'lm'. `cfg`
    has concrete implementation fields (ModelConfig.resolved, where the run is built)."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}; expected one of {TASKS}")
    if not cfg.is_resolved:
        raise ValueError(
            "the model config has 'auto' implementation fields: resolve them for the platform "
            "the model runs on, ModelConfig.resolved(platform), when the run is built"
        )
    return DecoderOnly(cfg) if task == "lm" else EncoderDecoder(cfg)


def init_params(model: nn.Module, rng: Array) -> Any:
    """The model's 'params' collection (boxed with logical axis names) from dummy tokens."""
    dummy = jnp.ones((1, 8), jnp.int32)
    args = (dummy,) if isinstance(model, DecoderOnly) else (dummy, dummy)
    return model.init(rng, *args)["params"]
