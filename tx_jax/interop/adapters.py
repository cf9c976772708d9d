"""An adapted run's LoRA adapters alone: `python -m tx_jax.export --adapters_only`.

OUT/adapters.safetensors holds A [K, r] and B [r, N] of every adapted projection, named by
its tx_jax path ('decoder/layer_0/self_attention/query_lora_a'; the attention's N is heads x
head_dim, its out projection's K the same); OUT/adapter_config.json their rank, alpha, dropout
and targets, the step, and the base they were trained on (path, step and digest of its
parameters, as the run's checkpoints record it). A weight W [K, N] of the base becomes
W + (alpha / rank) A B (model/lora.py's merge).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
from etils import epath

from tx_jax.inference import restore
from tx_jax.model import lora as lora_lib
from tx_jax.training.checkpoint import Checkpointer


def write(loaded: restore.Loaded, out: str | epath.Path) -> epath.Path:
    """The adapters of `loaded` and their config under `out` (created); returns `out`."""
    from safetensors.numpy import save_file

    lora = loaded.model_config.lora
    if not lora.rank:
        raise ValueError(
            f"{loaded.path} has no adapters (train.lora.rank=0): export the whole model instead"
        )
    out = epath.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: np.ascontiguousarray(np.asarray(v))
        for k, v in jax.device_get(lora_lib.adapters(loaded.params)).items()
    }
    save_file(tensors, str(out / "adapters.safetensors"))
    ckpt = Checkpointer(loaded.directory, read_only=True)
    try:
        meta = ckpt.restore_meta(loaded.step)
    finally:
        ckpt.close()
    config = {
        **dataclasses.asdict(lora),
        "step": loaded.step,
        "base": meta.get("base"),
        "merge": "W + (alpha / rank) * A @ B, reshaped as W",
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out
