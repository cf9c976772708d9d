"""Pretrained translators from Transformers' formats, by config.json's model_type: one
mapping module per family (marian.py, m2m100.py), read in both directions.

    vocab_permutation(hf_config, target=False) -> perm [V] (perm[tx_id] = hf_id, an involution)
    special_ids(hf_config, unk_id=None) -> SpecialIds (pad 0, eos, unk, decoder_start, bos)
    model_fields(hf_config) -> ModelConfig field dict
    import_state_dict(state_dict, hf_config) -> (ModelConfig field dict, params tree)
    export_state_dict(params, model_config, hf_config) -> (state dict, config.json dict)
    write(params, model_config, hf_config, out) -> out: model.safetensors + config.json

Each refuses (PretrainedError, an ExportError on the way out) before anything is built or
written, naming the config keys or tensors it cannot map.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from tx_jax.interop import m2m100, marian
from tx_jax.interop.seq2seq_layout import PretrainedError, SpecialIds
from tx_jax.model.config import ModelConfig

FAMILIES: dict[str, ModuleType] = {marian.MODEL_TYPE: marian, m2m100.MODEL_TYPE: m2m100}

__all__ = [
    "FAMILIES",
    "PretrainedError",
    "SpecialIds",
    "export_state_dict",
    "family",
    "import_state_dict",
    "model_fields",
    "special_ids",
    "vocab_permutation",
    "write",
]


def family(hf_config: Mapping[str, Any]) -> ModuleType:
    """The mapping module of config.json's model_type; PretrainedError for any other."""
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise PretrainedError(
            f"model_type={model_type!r} cannot be imported (supported: {sorted(FAMILIES)})"
        )
    return FAMILIES[model_type]


def vocab_permutation(hf_config: Mapping[str, Any], *, target: bool = False) -> np.ndarray:
    """[V] ints, perm[tx_id] = hf_id and perm[hf_id] = tx_id: the checkpoint's pad id swapped
    with 0. target=True: the decoder's vocabulary (Marian's decoder_vocab_size)."""
    return family(hf_config).vocab_permutation(hf_config, target=target)


def special_ids(hf_config: Mapping[str, Any], unk_id: int | None = None) -> SpecialIds:
    """The special tokens in tx ids. unk_id: the HF id of <unk> from the tokenizer's vocabulary
    (config.json has none); default the family's convention (Marian 1, M2M100 3)."""
    fam = family(hf_config)
    return fam.special_ids(hf_config, fam.UNK_ID if unk_id is None else unk_id)


def model_fields(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    return family(hf_config).model_fields(hf_config)


def import_state_dict(
    state_dict: Mapping[str, Any], hf_config: Mapping[str, Any]
) -> tuple[dict[str, Any], dict]:
    """(ModelConfig fields, EncoderDecoder params) of a Transformers checkpoint."""
    return family(hf_config).import_state_dict(state_dict, hf_config)


def export_state_dict(
    params: Any, cfg: ModelConfig, hf_config: Mapping[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """An imported model back in its family's format; `hf_config` is its original config.json."""
    return family(hf_config).export_state_dict(params, cfg, hf_config)


def write(params: Any, cfg: ModelConfig, hf_config: Mapping[str, Any], out: Any) -> Any:
    """Writes `out`/model.safetensors and config.json of an imported model (the directory is
    created; nothing is written if the model cannot be exported). Returns the epath.Path."""
    from etils import epath

    try:
        from safetensors.numpy import save_file
    except ImportError as e:
        raise ImportError("exporting needs safetensors: pip install -e '.[export]'") from e
    tensors, config = export_state_dict(params, cfg, hf_config)
    out = epath.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
