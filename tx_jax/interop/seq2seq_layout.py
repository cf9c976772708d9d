"""What Transformers' BART-family translators (MarianMT, M2M100/NLLB) share: layer tensor
names, the vocabulary swap that puts padding at id 0, config keys without effect, and the
bookkeeping that refuses a state dict with a tensor unmapped or missing.

Layer names (as `save_pretrained` writes them), per layer `model.{encoder,decoder}.layers.i`:
    self_attn.{q,k,v,out}_proj.{weight,bias}    self_attn_layer_norm.{weight,bias}
    encoder_attn.{q,k,v,out}_proj.{weight,bias}  encoder_attn_layer_norm.{weight,bias}  (decoder)
    fc1.{weight,bias}  fc2.{weight,bias}        final_layer_norm.{weight,bias}
torch.nn.Linear's weight is [out, in]: interop/weights.py's neutral layout, taken as it is.

Token ids: inside tx_jax id 0 is padding and only padding. The foreign pad id p is swapped
with 0 (tx id 0 = foreign p, tx id p = foreign 0); the swap is its own inverse, so one
array maps ids both ways and rows of every vocabulary-indexed tensor both ways.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from tx_jax.interop import weights as weights_lib
from tx_jax.model.config import ModelConfig


class PretrainedError(ValueError):
    """A checkpoint tx_jax cannot represent exactly, or one that does not match its config;
    the message names the config keys or tensor names. Raised before anything is written."""


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """A checkpoint's special tokens in tx_jax numbering (after `vocab_permutation`)."""

    pad: int  # always 0
    eos: int
    unk: int
    decoder_start: int  # the decoder's first input: ModelConfig.bos_id (Marian: pad = 0)
    bos: int | None = None  # a sentence-start token the model family has (M2M100's <s>)


def swap_permutation(size: int, foreign_pad: int) -> np.ndarray:
    """[size] int64 perm with perm[tx_id] = foreign_id: the foreign pad id swapped with 0.
    An involution (perm[perm] = identity), so it also maps foreign ids to tx ids."""
    if not 0 <= foreign_pad < size:
        raise PretrainedError(f"pad_token_id={foreign_pad} is outside the vocabulary of {size}")
    perm = np.arange(size)
    perm[0], perm[foreign_pad] = foreign_pad, 0
    return perm


# Keys that change neither the function nor the tensors: accepted and carried back unchanged
# on export. Metadata and library switches; training-only regularisation; generation
# defaults; and the ids and size the family's own code reads.
HARMLESS_KEYS = frozenset(
    """
    _name_or_path architectures transformers_version dtype torch_dtype use_cache
    is_encoder_decoder id2label label2id _num_labels num_labels problem_type finetuning_task
    gradient_checkpointing output_past return_dict output_attentions output_hidden_states
    tokenizer_class prefix task_specific_params add_cross_attention tie_encoder_decoder
    pruned_heads chunk_size_feed_forward torchscript use_bfloat16 cross_attention_hidden_size
    tf_legacy_loss
    init_std encoder_layerdrop decoder_layerdrop classif_dropout classifier_dropout
    bos_token_id forced_bos_token_id forced_eos_token_id bad_words_ids num_beams max_length
    min_length length_penalty early_stopping no_repeat_ngram_size num_return_sequences do_sample
    temperature top_k top_p repetition_penalty diversity_penalty num_beam_groups
    encoder_no_repeat_ngram_size suppress_tokens begin_suppress_tokens max_new_tokens
    remove_invalid_values exponential_decay_length_penalty typical_p sep_token_id
    decoder_start_token_id pad_token_id eos_token_id vocab_size model_type
    """.split()  # noqa: SIM905 (a word list: a key a line would hide the groups)
)

# Transformers' activation_function -> ModelConfig.activation
ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu_exact",  # torch's erf GELU
    "gelu_new": "gelu",  # the tanh approximation, flax's nn.gelu
    "gelu_pytorch_tanh": "gelu",
    "swish": "silu",
    "silu": "silu",
}


def activation(hf_config: Mapping[str, Any], problems: list[str]) -> str:
    name = hf_config.get("activation_function", "relu")
    if name not in ACTIVATIONS:
        problems.append(f"activation_function={name!r} (supported: {sorted(ACTIVATIONS)})")
        return "relu"
    return ACTIVATIONS[name]


def hf_activation(cfg: Any, current: str | None) -> str:
    """Transformers' name of cfg.activation: `current` (the imported one) when it means the
    same, so that 'swish' stays 'swish'."""
    if ACTIVATIONS.get(current) == cfg.activation:
        return current
    names = {"relu": "relu", "gelu_exact": "gelu", "gelu": "gelu_new", "silu": "silu"}
    if cfg.activation not in names:
        raise weights_lib.ExportError(
            f"model.activation={cfg.activation!r} has no Transformers name"
        )
    return names[cfg.activation]


def hf_config_dict(cfg: Any, hf_config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """config.json keys the BART-family architectures (MarianMT, M2M100) share, from `cfg`,
    over `hf_config` (the imported one: ids, metadata, generation defaults)."""
    out = dict(hf_config)
    out["activation_function"] = hf_activation(cfg, out.get("activation_function"))
    out.update(
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        encoder_layers=cfg.num_encoder_layers,
        decoder_layers=cfg.num_decoder_layers,
        encoder_attention_heads=cfg.num_heads,
        decoder_attention_heads=cfg.num_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        scale_embedding=cfg.scale_embeddings,
        tie_word_embeddings=cfg.tie_output,
        dropout=cfg.dropout_rate,
        attention_dropout=cfg.attention_dropout_rate,
        activation_dropout=cfg.ffn_dropout_rate,
    )
    return out


def check_exportable(cfg: Any, fixed: Mapping[str, Any], what: str) -> None:
    """ExportError naming each field whose value the family `what` cannot express."""
    width = cfg.d_model // cfg.num_heads
    bad = [
        f"model.{k}={getattr(cfg, k)!r} ({what} needs {v!r})"
        for k, v in fixed.items()
        if getattr(cfg, k) != v
    ]
    for key, ok in (
        ("num_kv_heads", (None, cfg.num_heads)),
        ("head_dim", (None, width)),
        ("value_head_dim", (None, width)),
        ("norm", ("layernorm",)),
    ):
        if getattr(cfg, key) not in ok:
            bad.append(f"model.{key}={getattr(cfg, key)!r} ({what} needs one of {ok})")
    if bad:
        raise weights_lib.ExportError(f"cannot export this model as {what}:\n  " + "\n  ".join(bad))


def check_keys(
    hf_config: Mapping[str, Any],
    model_type: str,
    used: Iterable[str],
    required: Mapping[str, Any],
    problems: list[str],
) -> None:
    """Append a message for another model_type, a key with a value tx_jax cannot represent
    (`required`: key -> the only value it may have), and every key nobody knows."""
    if hf_config.get("model_type") != model_type:
        problems.append(
            f"model_type={hf_config.get('model_type')!r} (this mapping reads {model_type!r})"
        )
    for key, wanted in required.items():
        if key in hf_config and hf_config[key] != wanted:
            problems.append(f"{key}={hf_config[key]!r} (tx_jax represents only {wanted!r})")
    known = HARMLESS_KEYS | set(used) | set(required)
    unknown = sorted(set(hf_config) - known)
    if unknown:
        problems.append(f"config key(s) without a tx_jax field: {unknown}")
    for key in ("eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if not isinstance(hf_config.get(key), int):
            problems.append(f"{key}={hf_config.get(key)!r} (one integer id needed)")


def same_pair(hf_config: Mapping[str, Any], a: str, b: str, problems: list[str]) -> Any:
    """One value for an encoder/decoder pair of keys (tx_jax has one num_heads, one d_ff)."""
    if hf_config.get(a) != hf_config.get(b):
        problems.append(f"{a}={hf_config.get(a)!r} != {b}={hf_config.get(b)!r} (tx_jax has one)")
    return hf_config.get(a)


def raise_problems(problems: list[str], what: str) -> None:
    if problems:
        raise PretrainedError(
            f"cannot import this {what} checkpoint exactly:\n  " + "\n  ".join(problems)
        )


# The config.json keys both families read; each adds its own.
USED_KEYS = """
    d_model encoder_layers decoder_layers encoder_attention_heads decoder_attention_heads
    encoder_ffn_dim decoder_ffn_dim activation_function max_position_embeddings scale_embedding
    tie_word_embeddings dropout attention_dropout activation_dropout num_hidden_layers
""".split()  # noqa: SIM905 (as HARMLESS_KEYS)


def model_fields(
    hf_config: Mapping[str, Any],
    model_type: str,
    what: str,
    *,
    used: Iterable[str],
    required: Mapping[str, Any],
    family_fields: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """The ModelConfig fields of a `what` config.json: the keys both families read, then
    `family_fields()` (called once the keys check out). PretrainedError naming every key
    tx_jax cannot represent, or the ModelConfig error when the fields do not make a model."""
    problems: list[str] = []
    check_keys(hf_config, model_type, [*USED_KEYS, *used], required, problems)
    heads = same_pair(hf_config, "encoder_attention_heads", "decoder_attention_heads", problems)
    d_ff = same_pair(hf_config, "encoder_ffn_dim", "decoder_ffn_dim", problems)
    act = activation(hf_config, problems)
    raise_problems(problems, what)
    fields = {
        "vocab_size": int(hf_config["vocab_size"]),
        "d_model": int(hf_config["d_model"]),
        "num_heads": int(heads),
        "d_ff": int(d_ff),
        "num_encoder_layers": int(hf_config["encoder_layers"]),
        "num_decoder_layers": int(hf_config["decoder_layers"]),
        "dropout_rate": float(hf_config.get("dropout", 0.1)),
        "ffn_dropout_rate": float(hf_config.get("activation_dropout", 0.0)),
        "activation": act,
        "max_len": int(hf_config.get("max_position_embeddings", 1024)),
        "tie_output": bool(hf_config.get("tie_word_embeddings", True)),
        **family_fields(),
    }
    try:
        ModelConfig(**fields)
    except ValueError as e:
        raise PretrainedError(f"{what} config gives no valid tx_jax model: {e}") from e
    return fields


class Tensors:
    """A state dict read once: `take` each mapped tensor, then `finish` refuses what is
    missing, misshapen, or left over (no tensor is dropped silently)."""

    def __init__(self, state_dict: Mapping[str, Any], what: str):
        self._left = dict(state_dict)
        self._what = what
        self.problems: list[str] = []

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._left:
            self.problems.append(f"missing tensor {name} {list(shape)}")
            return np.zeros(shape, np.float32)
        x = np.asarray(self._left.pop(name))
        if x.shape != tuple(shape):
            self.problems.append(f"tensor {name} has shape {list(x.shape)}, expected {list(shape)}")
            return np.zeros(shape, np.float32)
        return x

    def take_copy(self, name: str, of: np.ndarray) -> None:
        """An optional tensor that, when present, must equal `of` bit for bit (a tied
        duplicate older `save_pretrained` versions wrote)."""
        if name in self._left:
            x = np.asarray(self._left.pop(name))
            if x.shape != of.shape or not np.array_equal(x, of):
                self.problems.append(
                    f"tensor {name} should be tied to (equal) another, but differs"
                )

    def take_constant(self, name: str, expected: np.ndarray, *, atol: float = 0.0) -> None:
        """An optional stored constant (a position table) that must equal the computed one."""
        if name in self._left:
            x = np.asarray(self._left.pop(name), np.float32)
            n = min(len(x), len(expected))
            if x.shape[1:] != expected.shape[1:] or not np.allclose(x[:n], expected[:n], atol=atol):
                self.problems.append(f"tensor {name} differs from the positions tx_jax computes")

    def finish(self) -> None:
        if self._left:
            self.problems.append(f"unmapped tensor(s): {sorted(self._left)}")
        raise_problems(self.problems, self._what)


def _linear(t: Tensors, name: str, n_out: int, n_in: int) -> weights_lib.Linear:
    return t.take(f"{name}.weight", (n_out, n_in)), t.take(f"{name}.bias", (n_out,))


def _norm(t: Tensors, name: str, m: int) -> weights_lib.Norm:
    return t.take(f"{name}.weight", (m,)), t.take(f"{name}.bias", (m,))


def _attention(t: Tensors, name: str, m: int) -> dict[str, weights_lib.Linear]:
    out = {short: _linear(t, f"{name}.{short}_proj", m, m) for short in "qkv"}
    out["o"] = _linear(t, f"{name}.out_proj", m, m)
    return out


def read_layer(t: Tensors, prefix: str, m: int, f: int, cross: bool) -> weights_lib.Layer:
    """One layer `prefix` (e.g. model.decoder.layers.3) of d_model m, FFN width f."""
    return weights_lib.Layer(
        self_attention=_attention(t, f"{prefix}.self_attn", m),
        self_attention_norm=_norm(t, f"{prefix}.self_attn_layer_norm", m),
        cross=_attention(t, f"{prefix}.encoder_attn", m) if cross else None,
        cross_norm=_norm(t, f"{prefix}.encoder_attn_layer_norm", m) if cross else None,
        fc1=_linear(t, f"{prefix}.fc1", f, m),
        fc2=_linear(t, f"{prefix}.fc2", m, f),
        ffn_norm=_norm(t, f"{prefix}.final_layer_norm", m),
    )


def read_stacks(
    t: Tensors, cfg: ModelConfig
) -> tuple[list[weights_lib.Layer], list[weights_lib.Layer]]:
    """(encoder layers, decoder layers) of `cfg`'s sizes, read from `t`."""
    m, f = cfg.d_model, cfg.d_ff
    return (
        [
            read_layer(t, f"model.encoder.layers.{i}", m, f, False)
            for i in range(cfg.num_encoder_layers)
        ],
        [
            read_layer(t, f"model.decoder.layers.{i}", m, f, True)
            for i in range(cfg.num_decoder_layers)
        ],
    )


def write_stacks(out: dict[str, np.ndarray], w: weights_lib.Weights) -> None:
    for stack, layers in (("encoder", w.encoder), ("decoder", w.decoder)):
        for i, layer in enumerate(layers):
            write_layer(out, f"model.{stack}.layers.{i}", layer)


def write_layer(out: dict[str, np.ndarray], prefix: str, layer: weights_lib.Layer) -> None:
    def pair(name: str, value: tuple[np.ndarray, np.ndarray]) -> None:
        out[f"{name}.weight"], out[f"{name}.bias"] = value

    for stem, attn in (("self_attn", layer.self_attention), ("encoder_attn", layer.cross)):
        if attn is None:
            continue
        for short in "qkv":
            pair(f"{prefix}.{stem}.{short}_proj", attn[short])
        pair(f"{prefix}.{stem}.out_proj", attn["o"])
    pair(f"{prefix}.self_attn_layer_norm", layer.self_attention_norm)
    if layer.cross is not None:
        pair(f"{prefix}.encoder_attn_layer_norm", layer.cross_norm)
    pair(f"{prefix}.fc1", layer.fc1)
    pair(f"{prefix}.fc2", layer.fc2)
    pair(f"{prefix}.final_layer_norm", layer.ffn_norm)
