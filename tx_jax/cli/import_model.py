"""Import a pretrained translator (Hugging Face directory) as a tx_jax workdir.

    tx_jax import --source=opus-mt-en-de --workdir=runs/opus-mt-en-de
    tx_jax import --source=nllb-200-distilled-600M --workdir=runs/nllb \
        --dtype=bfloat16
    tx_jax import --source=DIR --workdir=W --allow_pickle   (pytorch_model.bin)

--source is a directory as `save_pretrained` writes it (config.json, model.safetensors or a
sharded index, the tokenizer files) of model_type marian (OPUS-MT) or m2m_100 (M2M100,
NLLB-200); nothing is downloaded. The workdir then works with every command that reads one:
translate, score, evaluate, export (back to the same format), plan, visualize, and
train.init_from (configs/finetune.py). A model tx_jax cannot represent exactly is refused,
naming the config keys or tensors, before anything is written.
"""

from __future__ import annotations

import pathlib
import sys

from absl import app, flags

from tx_jax.cli import common
from tx_jax.config import apply_overrides, load_config
from tx_jax.interop import importer


def _main(argv: list[str], overrides: dict[str, str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if not f.source or not f.workdir:
        raise app.UsageError("give --source (a Hugging Face directory) and --workdir")
    base = load_config(f.config)
    apply_overrides(base, overrides)  # --config.data.max_eval_len=200, ...
    out = importer.import_model(
        f.source, f.workdir, base_config=base, dtype=f.dtype, allow_pickle=f.allow_pickle
    )
    print(f"import_model: {f.source} -> {out} (step 0, {f.dtype})", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    flags.DEFINE_string("source", None, "A Hugging Face model directory (marian or m2m_100).")
    flags.DEFINE_string("workdir", None, "The tx_jax workdir to write (new, local or gs://).")
    flags.DEFINE_enum("dtype", "float32", importer.DTYPES, "Parameter and compute dtype.")
    flags.DEFINE_bool(
        "allow_pickle",
        False,
        "Load pytorch_model.bin (torch.load, weights only) when no safetensors.",
    )
    flags.DEFINE_string(
        "config",
        str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "default.py"),
        "The config the workdir's data, train and eval sections start from (its model section "
        "is replaced by the imported one); --config.key=value overrides it.",
    )
    common.run_cli(_main, argv)
