"""An adapted run's LoRA adapters alone, in two forms (docs/models.md, LoRA's "Export").

`write` (`--adapters_only`): OUT/adapters.safetensors holds A [K, r] and B [r, N] of every
adapted projection by tx_jax path ('decoder/layer_0/self_attention/query_lora_a'; attention's
N is heads x head_dim, its out projection's K the same); OUT/adapter_config.json the rank,
alpha, dropout, targets, step and the base's path, step and digest. A base weight W [K, N]
becomes W + (alpha / rank) A B (model/lora.py's merge).

`write_peft` (`--format=peft`): a PEFT LoRA directory for the base as `--format=hf` exports
it. Where each tx_jax index lands in a Transformers weight is read from the exporter itself,
run on probes whose adapted kernels hold their row, their column and their own number; a
projection the exporter does not map index for index onto one Linear weight is refused.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from etils import epath
from flax import traverse_util

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


def write_peft(
    loaded: restore.Loaded, out: str | epath.Path, hf_config: dict[str, Any] | None = None
) -> epath.Path:
    """The adapters of `loaded` as a PEFT LoRA directory `out` (created) for the base as
    huggingface.export writes it (`hf_config`: an imported model's config.json); returns `out`."""
    from safetensors.numpy import save_file

    lora = loaded.model_config.lora
    if not lora.rank:
        raise ValueError(
            f"{loaded.path} has no adapters (train.lora.rank=0): export the whole model instead"
        )
    params = nn.meta.unbox(loaded.params)
    flat = traverse_util.flatten_dict(params, sep="/")
    adapted = {
        k: np.asarray(jax.device_get(v), np.float32) for k, v in lora_lib.adapters(params).items()
    }
    shapes = {k: v.shape for k, v in flat.items() if not lora_lib.ADAPTER.search(k)}
    stems = sorted(k[: -len("_lora_a")] for k in adapted if k.endswith("_lora_a"))
    tensors, modules = {}, []
    for name, (j, rows, cols, c) in _hf_places(loaded, shapes, adapted, stems, hf_config).items():
        a, b = adapted[f"{stems[j]}_lora_a"], adapted[f"{stems[j]}_lora_b"]
        module = name[: -len(".weight")]
        tensors[f"base_model.model.{module}.lora_A.weight"] = a[cols].T.copy()  # [r, in]
        tensors[f"base_model.model.{module}.lora_B.weight"] = (c * b[:, rows]).T.copy()
        modules.append(module)
    out = epath.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "SEQ_2_SEQ_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": (hf_config or {}).get("_name_or_path"),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def _hf_places(
    loaded: restore.Loaded,
    shapes: dict[str, tuple[int, ...]],
    adapted: dict[str, np.ndarray],
    stems: list[str],
    hf_config: Any,
) -> dict[str, tuple[int, np.ndarray, np.ndarray, float]]:
    """Transformers weight name -> (the adapted kernel it holds, by index into `stems`; the
    tx_jax column N of each of its rows; the tx_jax row K of each of its columns; the factor
    the exporter scales the kernel by), read from three exports of probe parameters (zeros but
    the adapted kernels), one at a time: one export's memory at the most."""
    from tx_jax.interop import huggingface, pretrained, weights

    cfg = loaded.model_config.replace(lora_rank=0)
    sizes = {s: (adapted[f"{s}_lora_a"].shape[0], adapted[f"{s}_lora_b"].shape[1]) for s in stems}

    def export(fill) -> dict[str, np.ndarray]:
        probe = {k: np.zeros(shape, np.float32) for k, shape in shapes.items()}
        for j, stem in enumerate(stems):
            K, N = sizes[stem]
            probe[f"{stem}_kernel"] = fill(j, K, N).reshape(shapes[f"{stem}_kernel"])
        params = traverse_util.unflatten_dict(probe, sep="/")
        if hf_config is not None:
            return pretrained.export_state_dict(params, cfg, hf_config)[0]
        return huggingface.state_dict(weights.extract(params, cfg, loaded.task), cfg)

    def indices(name: str, x: np.ndarray, c: float, axis: int) -> np.ndarray:
        """The probe's numbers (from 0) along `axis` of `x`, the same along the other axis."""
        index = np.rint(x / c)
        first = index.take([0], axis=1 - axis)
        if (
            x.ndim != 2
            or not name.endswith(".weight")
            or not np.allclose(x / c, index, atol=1e-3)
            or (index != first).any()
        ):
            raise ValueError(f"PEFT export: {name} is not one adapted kernel index for index")
        return first.reshape(-1).astype(np.int64) - 1

    def rows_k(j: int, K: int, N: int) -> np.ndarray:
        return np.broadcast_to(np.arange(1, K + 1, dtype=np.float32)[:, None], (K, N))

    def cols_n(j: int, K: int, N: int) -> np.ndarray:
        return np.broadcast_to(np.arange(1, N + 1, dtype=np.float32), (K, N))

    found: dict[str, list] = {}
    for name, x in export(rows_k).items():  # a column holds one tx_jax row K
        if x.any():
            c = float(np.abs(x[x != 0]).min())  # row 0 probed as 1
            found[name] = [c, indices(name, x, c, axis=1)]
    for name, x in export(cols_n).items():  # a row holds one tx_jax column N
        if name in found:
            found[name].append(indices(name, x, found[name][0], axis=0))
    for name, x in export(lambda j, K, N: np.full((K, N), j + 1, np.float32)).items():
        if name in found:  # one kernel's number throughout
            found[name].append(int(indices(name, x.reshape(1, -1), found[name][0], axis=0)[0]))
    places = {name: (j, rows, cols, c) for name, (c, cols, rows, j) in found.items()}
    held = sorted(j for j, *_ in places.values())
    if held != list(range(len(stems))):
        missing = sorted(set(range(len(stems))) - set(held))
        raise ValueError(
            "PEFT export: the Transformers model has no single Linear weight for "
            + ", ".join(stems[j] for j in missing)
            if missing
            else "PEFT export: an adapted kernel became several Transformers weights"
        )
    return places
