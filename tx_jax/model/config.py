"""`ModelConfig`: every architectural choice of the Transformer, one validated field each.

`ModelConfig.from_config` is the one place a ConfigDict (or dict) becomes one, and it
validates every key. Decode and eval variants come from `config.replace(decode=True, ...)`.
`VARIANTS` holds the paper's Table 3 models (and CPU-sized ones); `variant(name)` builds one.

The implementation fields (attention_impl, kernels, dropout_bits, loss_impl) may be 'auto' in a
config; `resolved(platform)`, called once where a run, plan, export or lowering test is built,
makes them concrete: per platform the value tested and timed fastest there (docs/design.md,
"Implementation choices: one rule"). Modules receive only concrete values. A value that timed
runs beat, or that never ran, is gone: `from_config` loads a config naming it as the value that
ran, with a warning (tx_jax/config.py's REPLACED_VALUES and REMOVED_KEYS: every rename of a
stored config is there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from tx_jax.config import upgrade_section
from tx_jax.model.lora import DEFAULT_TARGETS, LoRA
from tx_jax.ops import backend, cudnn
from tx_jax.ops.attention_kernels import IMPLEMENTATIONS
from tx_jax.ops.kernels import DROPOUT_BITS, KERNELS

# gelu: flax's tanh approximation (Transformers' "gelu_new"); gelu_exact: the erf form
# (Transformers' "gelu"); silu: x * sigmoid(x), not gated (Transformers' "swish", Marian's).
ACTIVATIONS = ("relu", "gelu", "swiglu", "silu", "gelu_exact")
NORMS = ("layernorm", "rmsnorm")
POSITIONALS = ("sinusoidal", "learned", "rope", "none")
# paper: sin/cos interleaved (eq. of section 3.5); marian: the same frequencies, every sine
# then every cosine; fairseq (M2M100, NLLB): sines then cosines, frequencies
# exp(-i ln(10000) / (M/2 - 1)) (tensor2tensor's).
SINUSOID_STYLES = ("paper", "marian", "fairseq")
NORM_POSITIONS = ("post", "pre")
REMATS = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16", "float16")
# dense: float32 logits [B, L, V], then the loss; blocked: the output layer and loss over blocks
# of positions, logits recomputed in the backward pass (a memory lever; training/losses.py)
LOSS_IMPLS = ("dense", "blocked")
PLATFORMS = ("cpu", "gpu", "tpu")
# 'auto' in a config; concrete after `ModelConfig.resolved` (what modules take)
IMPLEMENTATION_FIELDS = ("attention_impl", "kernels", "dropout_bits", "loss_impl")
CHUNKED_FROM = 2048  # CPU: from this many keys 'chunked' attention beats 'xla' (BENCHMARKS.md)
_ENUMS = {
    "activation": ACTIVATIONS,
    "norm": NORMS,
    "norm_position": NORM_POSITIONS,
    "positional": POSITIONALS,
    "sinusoid_style": SINUSOID_STYLES,
    "attention_impl": ("auto", *IMPLEMENTATIONS),
    "kernels": ("auto", *KERNELS),
    "remat": REMATS,
    "dropout_bits": ("auto", *DROPOUT_BITS),
    "loss_impl": ("auto", *LOSS_IMPLS),
    "dtype": DTYPES,
    "param_dtype": DTYPES,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every architectural choice, one field each (defaults: the paper's base model)."""

    vocab_size: int = 32_000  # source vocabulary (and target, when shared)
    target_vocab_size: int | None = None  # None: same as vocab_size
    d_model: int = 512  # M
    num_heads: int = 8  # H
    num_kv_heads: int | None = None  # K < H: grouped-query attention; None: K = H
    head_dim: int | None = None  # D; None: d_model // num_heads (the paper's d_k = d_v)
    value_head_dim: int | None = None  # the paper's d_v (3.2.2, Table 3 B); None: head_dim
    d_ff: int = 2048  # F, the FFN's inner width
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout_rate: float = 0.1  # residual and embedding dropout, P_drop (section 5.4)
    attention_dropout_rate: float = 0.0  # on the attention weights
    ffn_dropout_rate: float = 0.0  # on the FFN's hidden activations
    activation: str = "relu"  # relu | gelu (tanh approx.) | swiglu | silu | gelu_exact (erf)
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_position: str = "post"  # post (paper) | pre
    norm_epsilon: float = 1e-6
    positional: str = "sinusoidal"  # sinusoidal | learned | rope | none
    max_len: int = 512  # size of the learned position table
    sinusoid_style: str = "paper"  # paper (interleaved) | marian | fairseq (see SINUSOID_STYLES)
    position_offset: int = 0  # added to every position (fairseq/M2M100: padding_idx + 1 = 2)
    rope_base: float = 10_000.0
    share_embeddings: bool = True  # one source/target embedding (needs a shared vocabulary)
    tie_output: bool = True  # output logits = x E^T with the target embedding E (3.4)
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model) (3.4)
    attention_bias: bool = False  # biases in the Q/K/V/O projections
    ffn_bias: bool = True  # biases in the FFN (eq. 2 has b1, b2)
    logits_bias: bool = False  # a [V] bias added to the output logits (Marian's final_logits_bias)
    # The implementation fields: 'auto' (`resolved` picks per platform) or a concrete value;
    # the defaults are the references. xla | chunked | cudnn | splash (ops/attention_kernels.py)
    attention_impl: str = "xla"
    kernels: str = "generic"  # cpu | generic: the projections (ops/kernels.py)
    dropout_bits: str = "bernoulli"  # bernoulli | packed: dropout's random bits (ops/kernels.py)
    loss_impl: str = "dense"  # dense | blocked (a memory lever): LOSS_IMPLS
    loss_block: int = 64  # 'blocked': target positions per block (of every batch row)
    dtype: str = "float32"  # compute dtype (activations, matmuls)
    param_dtype: str = "float32"  # storage dtype of the parameters
    remat: str = (  # a memory lever
        "none"  # none | full: recompute each layer in the backward pass | dots: keep matmul outputs
    )
    bos_id: int = 2  # first decoder input; 0 (padding's id, Marian's start) is allowed
    decode: bool = False  # incremental decoding with a KV cache
    decode_beams: int = 0  # > 0: decoding over a beam-shared cache of N hypotheses an example
    sow_attention_weights: bool = False  # store attention maps in 'intermediates'
    # low-rank adapters (lora.py): rank 0 is none; a run sets them from train.lora (of_run)
    lora_rank: int = 0
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: str = DEFAULT_TARGETS
    platform: str | None = None  # what `resolved` chose the implementation fields for

    def __post_init__(self):
        self.validate()

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any, **overrides: Any) -> ModelConfig:
        """ConfigDict / dict (e.g. `config.model`) -> ModelConfig, naming any unknown key; a
        removed field or value loads as config.upgrade_section says, with a warning."""
        items = dict(config.items() if hasattr(config, "items") else config)
        items = upgrade_section("model", {**items, **overrides})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(items) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; valid keys: {sorted(known)}")
        return cls(**items)

    @classmethod
    def of_run(cls, config: Any, platform: str, **overrides: Any) -> ModelConfig:
        """A run config's `model` section (plus `overrides`: the vocabulary) resolved for
        `platform` with the run's longest sequence and determinism: the one resolution every
        run, plan, restore and export goes through."""
        data, train = config.get("data", {}), config.get("train", {})
        longest = max(data.get("max_train_len", 0), data.get("max_eval_len", 0))
        lora = train.get("lora") or {}  # a run's adapters (configs/finetune.py has the keys)
        overrides = {
            f"lora_{k}": lora[k] for k in ("rank", "alpha", "dropout", "targets") if k in lora
        } | overrides
        # train.deterministic sets XLA:GPU's flag (tx_jax train); a flag set by hand counts too
        deterministic = bool(train.get("deterministic", False)) or backend.deterministic_ops()
        return cls.from_config(config.model, **overrides).resolved(
            platform, longest=longest, deterministic=deterministic
        )

    def resolved(
        self, platform: str, *, longest: int = 0, deterministic: bool = False
    ) -> ModelConfig:
        """This config with every implementation field concrete for `platform` ('cpu', 'gpu'
        or 'tpu'; 'cuda' and 'rocm' mean 'gpu'): the one place 'auto' is resolved, to the
        value tested and timed fastest there (BENCHMARKS.md, "Implementation choices").
        `longest`: the run's longest sequence ('chunked' attention on a CPU from CHUNKED_FROM);
        `deterministic`: XLA:GPU's deterministic mode (train.deterministic), where cuDNN's
        attention fails at its first call."""
        platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
        if platform not in PLATFORMS:
            raise ValueError(f"platform {platform!r}; expected one of {PLATFORMS}")
        attention = self.attention_impl
        if attention == "cudnn" and deterministic:
            raise ValueError(
                "model.attention_impl='cudnn': cuDNN's fused attention fails in XLA:GPU's "
                "deterministic mode (train.deterministic); use 'auto' or 'xla'"
            )
        if attention == "auto":
            D = self.head_dim or self.d_model // self.num_heads
            cudnn_applies = (
                platform == "gpu"
                and not deterministic
                and self.attention_dropout_rate == 0.0  # cuDNN's call here takes no dropout
                and cudnn.applies(self.dtype, D, self.value_head_dim or D)
            )
            chunked = platform == "cpu" and longest >= CHUNKED_FROM
            attention = "xla"  # the returned weights (sow_attention_weights) exist only here
            if not self.sow_attention_weights:
                attention = "cudnn" if cudnn_applies else "chunked" if chunked else "xla"
        kernels = self.kernels
        if kernels == "auto":
            kernels = "cpu" if platform == "cpu" else "generic"
        bits = self.dropout_bits
        if bits == "auto":  # the CPU kernels' masks go with them
            bits = "packed" if kernels == "cpu" else "bernoulli"
        loss = "dense" if self.loss_impl == "auto" else self.loss_impl
        return self.replace(
            attention_impl=attention,
            kernels=kernels,
            dropout_bits=bits,
            loss_impl=loss,
            platform=platform,
        )

    @property
    def is_resolved(self) -> bool:
        """Whether every implementation field is concrete (what modules take)."""
        return all(getattr(self, key) != "auto" for key in IMPLEMENTATION_FIELDS)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field: values, then shapes and sizes, then
        the architecture's options."""
        for key, allowed in _ENUMS.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"model.{key}={getattr(self, key)!r}; expected one of {allowed}")
        self._check_sizes()
        self._check_options()
        if self.decode_beams < 0 or (self.decode_beams and not self.decode):
            raise ValueError(f"model.decode_beams={self.decode_beams} needs decode=True, >= 0")
        self.lora.validate()
        if self.platform is not None and self.platform not in PLATFORMS:
            raise ValueError(f"model.platform={self.platform!r}; expected one of {PLATFORMS}")

    def _check_sizes(self) -> None:
        for key in ("vocab_size", "d_model", "num_heads", "d_ff", "max_len", "loss_block"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads="
                f"{self.num_heads} (or set model.head_dim)"
            )
        for key in ("head_dim", "value_head_dim", "num_kv_heads"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive (or None)")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not divisible by "
                f"model.num_kv_heads={self.num_kv_heads}"
            )
        if self.share_embeddings and self.target_vocab_size not in (None, self.vocab_size):
            raise ValueError(
                "model.share_embeddings=True needs model.target_vocab_size == vocab_size"
            )
        if not 0 <= self.bos_id < self.output_vocab_size:
            raise ValueError(
                f"model.bos_id={self.bos_id} must be in [0, {self.output_vocab_size}) "
                "(the output vocabulary)"
            )
        for key in ("dropout_rate", "attention_dropout_rate", "ffn_dropout_rate"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be in [0, 1)")

    def _check_options(self) -> None:
        if self.position_offset < 0:
            raise ValueError(f"model.position_offset={self.position_offset} must be >= 0")
        if self.position_offset and self.positional not in ("sinusoidal", "learned"):
            raise ValueError(
                f"model.position_offset={self.position_offset} needs model.positional "
                f"'sinusoidal' or 'learned', not {self.positional!r}"
            )
        if self.sinusoid_style != "paper" and self.positional != "sinusoidal":
            raise ValueError(
                f"model.sinusoid_style={self.sinusoid_style!r} needs model.positional='sinusoidal'"
            )
        if self.sinusoid_style == "fairseq" and self.d_model < 4:
            raise ValueError("model.sinusoid_style='fairseq' needs d_model >= 4")
        if self.positional == "rope" and (self.head_dim or self.d_model // self.num_heads) % 2:
            raise ValueError("model.positional='rope' needs an even head dimension")

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)

    @property
    def lora(self) -> LoRA:
        return LoRA(self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_targets)

    @property
    def output_vocab_size(self) -> int:
        return self.target_vocab_size or self.vocab_size


# The paper's Table 3: base and big (plus CPU-sized variants for tests and the default task).
_VARIANT_FIELDS = (
    "d_model",
    "d_ff",
    "num_heads",
    "num_encoder_layers",
    "num_decoder_layers",
    "dropout_rate",
)
_VARIANT_TABLE = {  # one row per variant, the columns of _VARIANT_FIELDS
    #        d_model  d_ff  num_heads  encoder layers  decoder layers  dropout_rate
    "base":  (   512, 2048,         8,              6,              6,          0.1),
    "big":   (  1024, 4096,        16,              6,              6,          0.3),
    "small": (   256, 1024,         4,              3,              3,          0.1),
    "tiny":  (    64,  128,         4,              2,              2,          0.0),
}  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    name: dict(zip(_VARIANT_FIELDS, row, strict=True)) for name, row in _VARIANT_TABLE.items()
}


def variant(name: str, **overrides: Any) -> ModelConfig:
    """ModelConfig of a named variant, e.g. variant('base', vocab_size=37_000)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown model variant {name!r}; expected one of {sorted(VARIANTS)}")
    return ModelConfig(**{**VARIANTS[name], **overrides})
