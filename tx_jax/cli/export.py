"""Export a translation checkpoint to Hugging Face Transformers or CTranslate2.

    tx_jax export --workdir=runs/default --format=hf --out=exported/hf
    tx_jax export --workdir=runs/default --format=ct2 --out=exported/ct2 \
        [--quantization=int8] [--average_last=5] [--step=N]
    tx_jax export --workdir=runs/opus-lora --format=peft --out=exported/opus-lora

--format=hf writes a MarianMT directory that `transformers` loads (AutoModelForSeq2SeqLM,
AutoTokenizer, pipeline("translation")); --format=ct2 a CTranslate2 model (weights as
--quantization) with the SentencePiece model beside it. A LoRA run (configs/finetune.py) is
exported with its adapters merged (W + alpha / r A B); --adapters_only writes them alone,
--format=peft as a PEFT LoRA directory for the base as --format=hf exports it. A model the
formats cannot represent exactly is refused with the fields named. docs/models.md says what
is written; needs the export extra: pip install -e '.[export]'.
"""

from __future__ import annotations

import sys

from absl import flags

from tx_jax import paths
from tx_jax.cli import common
from tx_jax.inference import restore
from tx_jax.interop import adapters, huggingface
from tx_jax.interop import ctranslate2 as ct2_export

FORMATS = ("hf", "ct2", "peft")


def _main(argv: list[str], overrides: dict[str, str]) -> None:
    where = common.checkpoint_args(argv)
    f = flags.FLAGS
    if f.out is None:
        raise ValueError("give --out (the directory to write)")
    loaded = restore.load(f.workdir, **where, overrides=overrides)
    with paths.staged_dir(f.out) as local:  # --out may be gs://: written here, copied there
        hf_config = getattr(loaded.tokenizer, "hf_config", None)
        what = f"{loaded.path} (step {loaded.step}) -> {f.out} ({f.format})"
        if f.adapters_only:
            adapters.write(loaded, local)
            what = f"the adapters of {loaded.path} -> {f.out}"
        elif f.format == "peft":
            adapters.write_peft(loaded, local, hf_config)
        elif f.format == "hf":  # an imported model (or one tuned from it) goes back as it came
            merged = restore.merged(loaded)
            huggingface.export(
                merged,
                local,
                beam_size=f.beam_size,
                length_penalty=f.length_penalty,
                hf_config=hf_config,
            )
        else:
            ct2_export.export(restore.merged(loaded), local, quantization=f.quantization)
    print(f"export: {what}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    common.define_checkpoint_flags()
    flags.DEFINE_enum(
        "format",
        "hf",
        FORMATS,
        "hf: Transformers MarianMT; ct2: CTranslate2; peft: a LoRA run's adapters for PEFT.",
    )
    flags.DEFINE_string(
        "out", None, "Output directory, local or gs:// (created; its files are replaced)."
    )
    flags.DEFINE_integer(
        "beam_size", None, "hf: generation_config num_beams (default: the run's test beam)."
    )
    flags.DEFINE_float(
        "length_penalty",
        None,
        "hf: generation_config length_penalty (default: the run's eval.length_penalty).",
    )
    flags.DEFINE_enum(
        "quantization", "float32", ct2_export.QUANTIZATIONS, "ct2: how weights are stored."
    )
    flags.DEFINE_bool(
        "adapters_only", False, "A LoRA run's adapters alone, as safetensors with their config."
    )
    common.run_cli(_main, argv)
