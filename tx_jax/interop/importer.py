"""A Hugging Face translator directory (OPUS-MT/Marian, M2M100, NLLB-200) -> a tx_jax workdir
(docs/models.md, "Starting from a pretrained model").

    import_model("opus-mt-en-de/", "runs/opus-mt-en-de", base_config=c, dtype="float32")

DIR holds config.json, the weights (model.safetensors, a sharded model.safetensors.index.json,
or pytorch_model.bin with allow_pickle: torch.load(weights_only=True)) and the tokenizer
files. The workdir is an ordinary run's: WORKDIR/checkpoints/0 (Orbax: the params in `state`,
the config and the tokenizer, which keeps the source's files for export, in `meta`),
WORKDIR/tokenizer.model and WORKDIR/config.json. Everything is read and checked first: a
PretrainedError names the keys or tensors, and the workdir is left untouched.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from etils import epath

from tx_jax.interop import hf_tokenizers, pretrained
from tx_jax.interop.seq2seq_layout import PretrainedError
from tx_jax.model.config import IMPLEMENTATION_FIELDS, ModelConfig
from tx_jax.training import logs
from tx_jax.training.checkpoint import Checkpointer

DTYPES = ("float32", "bfloat16")
# ModelConfig fields a run sets itself (from its tokenizer, or for decoding and analysis).
_SET_BY_THE_RUN = (
    "vocab_size", "bos_id", "decode", "decode_beams", "sow_attention_weights", "platform"
)  # fmt: skip


def read_config(source: epath.Path) -> dict[str, Any]:
    path = source / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing (is --source a Hugging Face model directory?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PretrainedError(f"{path}: not JSON ({e})") from None


def _safetensors(path: epath.Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError) as e:
        raise PretrainedError(f"{path}: not a readable safetensors file ({e})") from None


def read_tensors(source: epath.Path, *, allow_pickle: bool = False) -> dict[str, np.ndarray]:
    """The state dict of `source`: model.safetensors, a sharded index, or (allow_pickle)
    pytorch_model.bin loaded weights-only."""
    index = source / "model.safetensors.index.json"
    if (source / "model.safetensors").exists():
        return _safetensors(source / "model.safetensors")
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, np.ndarray] = {}
        for shard in shards:
            out.update(_safetensors(source / shard))
        return out
    if (source / "pytorch_model.bin").exists():
        if not allow_pickle:
            raise PretrainedError(
                f"{source / 'pytorch_model.bin'} is a pickle: give --allow_pickle to load it "
                "(weights only), or convert it to model.safetensors"
            )
        import torch

        state = torch.load(source / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise FileNotFoundError(
        f"{source}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def run_config(
    base: ml_collections.ConfigDict,
    fields: Mapping[str, Any],
    tokenizer: Any,
    hf_config: Mapping[str, Any],
    dtype: str,
) -> ml_collections.ConfigDict:
    """`base` (--config) with the imported model section and the checkpoint's languages."""
    c = ml_collections.ConfigDict(base.to_dict())
    imported = {k: v for k, v in fields.items() if k not in ("vocab_size", "bos_id")}
    imported.update(dtype=dtype, param_dtype=dtype)
    cfg = ModelConfig.from_config(
        imported, vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id
    )
    # Every field, so that any of them can be overridden (--config.model.remat=dots).
    c.model = ml_collections.ConfigDict()
    for f in dataclasses.fields(ModelConfig):
        if f.name in _SET_BY_THE_RUN:
            continue
        value = getattr(cfg, f.name)
        # resolved per platform when the imported model runs: --config's values ('auto') kept
        if f.name in IMPLEMENTATION_FIELDS and f.name not in imported:
            value = base.model.get(f.name, "auto")
        if value is None:  # typed like configs/default.py's optional fields
            value = ml_collections.FieldReference(None, field_type=int)
        c.model[f.name] = value
    c.task = "translation"
    c.data.vocab_size = tokenizer.vocab_size
    c.data.source_lang = tokenizer.source_lang or c.data.source_lang
    c.data.target_lang = tokenizer.target_lang or c.data.target_lang
    # Sources up to 256 pieces (EOS included) are translated whole; longer ones truncated.
    c.data.max_eval_len = min(int(hf_config.get("max_position_embeddings") or 512), 256)
    return c


def _check(tokenizer: Any, fields: Mapping[str, Any], source: epath.Path) -> None:
    """The tokenizer and the weights must agree on the vocabulary and the start token."""
    problems = []
    if tokenizer.vocab_size != fields["vocab_size"]:
        problems.append(
            f"the tokenizer has {tokenizer.vocab_size} ids, the model {fields['vocab_size']}"
        )
    if fields.get("bos_id", tokenizer.bos_id) != tokenizer.bos_id:
        problems.append(f"decoder start {fields['bos_id']} (weights) != {tokenizer.bos_id}")
    if problems:
        raise PretrainedError(f"{source}: " + "; ".join(problems))


def import_model(
    source: str | epath.PathLike,
    workdir: str | epath.PathLike,
    *,
    base_config: ml_collections.ConfigDict,
    dtype: str = "float32",
    allow_pickle: bool = False,
) -> epath.Path:
    """Reads and checks `source`, then writes the workdir (module docstring); returns it."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r}; expected one of {DTYPES}")
    source, workdir = epath.Path(source), epath.Path(workdir)
    hf_config = read_config(source)
    pretrained.family(hf_config)  # another model_type: refused first
    if (workdir / "checkpoints").exists() and any((workdir / "checkpoints").iterdir()):
        raise PretrainedError(f"{workdir} already holds checkpoints: give a new --workdir")
    tokenizer = hf_tokenizers.read(source, hf_config)
    tensors = read_tensors(source, allow_pickle=allow_pickle)
    fields, params = pretrained.import_state_dict(tensors, hf_config)
    _check(tokenizer, fields, source)
    config = run_config(base_config, fields, tokenizer, hf_config, dtype)
    params = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(jnp.dtype(dtype)), params)
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(workdir / "tokenizer.model")
    (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    meta = {"source": str(source), "model_type": hf_config["model_type"]}
    ckpt = Checkpointer(workdir / "checkpoints", keep=3, best_metric=None, async_save=False)
    ckpt.save(
        0,
        {"params": params},
        data_state=None,
        config=config.to_dict(),
        tokenizer_bytes=tokenizer.to_bytes(),
        versions=logs.versions(),
        extra_meta={"imported": meta},
    )
    ckpt.wait()
    ckpt.close()
    return workdir
