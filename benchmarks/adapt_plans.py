"""Full fine-tuning against LoRA of an NLLB-3.3B-shaped model, planned (tx_jax plan's
compilers; no weights, no chip): bytes per chip and whether each fits
(BENCHMARKS.md "Adapting a trained translator").

    python benchmarks/adapt_plans.py [--targets=tpu:v5e-1,tpu:v5e-8,gpu:h100-1] [--json=PATH]

The model is facebook/nllb-200-3.3B's config.json read as tx_jax imports it (interop/
m2m100.py): pre-LN, 24 + 24 layers, d_model 2048, 16 heads, d_ff 8192, 256,206 pieces.
Both adapt with configs/finetune.py's recipe on a batch of 4,096 tokens (rows of 128) and a
(data, fsdp) mesh with fsdp over every chip: full fine-tuning with float32 weights and Adam
moments for all of them ('full'); LoRA rank 16 on every attention and FFN projection, the base
frozen in bfloat16 (train.frozen_dtype), Adam moments for the adapters alone ('lora'); the
same with each layer recomputed in the backward pass and the loss computed by blocks, no
[B, L, V] logits (model.remat=full, model.loss_impl=blocked: 'lora_lean'). Compute in bfloat16.
GPU targets need the plan-gpu extra (jax's CUDA plugin); a target that cannot be compiled
here is reported as such.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

jax.config.update("jax_platforms", "cpu")

NLLB_3_3B = {  # facebook/nllb-200-3.3B config.json, the keys the importer reads
    "model_type": "m2m_100",
    "vocab_size": 256206,
    "d_model": 2048,
    "encoder_layers": 24,
    "decoder_layers": 24,
    "encoder_attention_heads": 16,
    "decoder_attention_heads": 16,
    "encoder_ffn_dim": 8192,
    "decoder_ffn_dim": 8192,
    "activation_function": "relu",
    "dropout": 0.1,
    "attention_dropout": 0.1,
    "activation_dropout": 0.0,
    "max_position_embeddings": 1024,
    "scale_embedding": True,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
    "tie_word_embeddings": True,
}


def config_for(kind: str, devices: int):
    import ml_collections

    from tx_jax.config import load_config
    from tx_jax.interop import m2m100
    from tx_jax.model.lora import DEFAULT_TARGETS

    c = load_config("configs/multi30k.py")
    c.model = ml_collections.ConfigDict(
        {**c.model.to_dict(), **m2m100.model_fields(NLLB_3_3B), "dtype": "bfloat16"}
    )
    c.model.param_dtype = "float32"
    c.data.vocab_size = NLLB_3_3B["vocab_size"]
    c.data.max_train_len = 128
    c.data.max_eval_len = 128
    c.data.bucket_boundaries = [128]
    c.data.tokens_per_batch = 4096
    c.parallel.strategy = "mesh"
    c.parallel.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=devices, tensor=1))
    c.train.init_from = "facebook/nllb-200-3.3B (planned: no weights are read)"
    c.train.lora = ml_collections.ConfigDict(
        dict(rank=0 if kind == "full" else 16, alpha=32.0, dropout=0.0, targets=DEFAULT_TARGETS)
    )
    c.train.trainable = ""
    c.train.frozen_dtype = "bfloat16" if kind != "full" else ""
    if kind == "lora_lean":  # the memory levers: layers recomputed, no [B, L, V] logits
        c.model.remat = "full"
        c.model.loss_impl = "blocked"
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="tpu:v5e-1,tpu:v5e-8,gpu:h100-1")
    ap.add_argument("--kinds", default="full,lora,lora_lean")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from tx_jax.planning import targets
    from tx_jax.planning.plan import make_plan

    rows = []
    for spec in args.targets.split(","):
        target = targets.parse(spec)
        for kind in args.kinds.split(","):
            try:
                plan = make_plan(config_for(kind, target.num_devices), target, ("train",))
            except Exception as e:  # noqa: BLE001 - a compiler this host lacks: said, not fatal
                rows.append({"target": spec, "kind": kind, "error": str(e).splitlines()[0]})
                print(spec, kind, "not planned:", rows[-1]["error"], flush=True)
                continue
            row = {
                "target": spec,
                "kind": kind,
                "fits": plan["fits"],
                "bytes_per_chip": plan["bytes_per_device"],
                "usable_bytes_per_chip": plan["usable_bytes_per_device"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
