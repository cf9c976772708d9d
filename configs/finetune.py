"""Fine-tuning a pretrained translator (imported with tx_jax import) or a trained run.

    tx_jax import --source=opus-mt-en-de --workdir=runs/opus-mt-en-de
    tx_jax train --workdir=runs/opus-mt-en-de-multi30k \
        --config=configs/finetune.py:init_from=runs/opus-mt-en-de,pair=en-de
    --config=configs/finetune.py:init_from=WORKDIR,debug     a few steps (tests, smoke runs)
    --config=configs/finetune.py:init_from=WORKDIR,data=text \
        --config.data.train='corpus/train-*' --config.data.validation=corpus/dev.tsv
                                                             your own corpus (configs/text.py)
    --config=configs/finetune.py:init_from=WORKDIR,lora=16   LoRA rank 16 (only the adapters
                                                             train) at a peak rate of 1e-3
    --config.train.trainable='^decoder/'                     these train, the rest is frozen

The model section and the tokenizer come from `init_from` (its latest checkpoint's config and
WORKDIR/tokenizer.model, the parameters through train.init_from); the data section is
configs/multi30k.py's for `pair`, or with data=text configs/text.py's: a plain-text corpus
whose lengths and batch the run chooses from it (tx_jax/runner/sizing.py). Training: a short
warmup to a small rate, then cosine decay, the usual recipe for adapting a converged model
(a rate near pretraining's would undo it); dropout as the checkpoint has it.

Parameter-efficient: train.lora.rank > 0 adds low-rank adapters (tx_jax/model/lora.py) to the
projections train.lora.targets names, and only they train; train.trainable (a pattern over
parameter paths) trains those parameters, with or without LoRA, and freezes the rest
(tx_jax/training/freezing.py); train.frozen_dtype='bfloat16' keeps the frozen weights in
bfloat16. Checkpoints then hold the trainable part and a digest of the base, which evaluate,
translate and export read again from train.init_from.

An imported M2M100/NLLB model trains in `pair`'s languages as transformers fine-tunes it
(data/tasks.py): sources [__en__] + pieces + EOS, targets [__fr__] + pieces + EOS fed from
the decoder start (EOS), so decoding's forced first token is what it learned; NLLB reads
`en`/`de`/`fr`/`cs` as eng_Latn/... (data/imported_tokenizer.NLLB_CODES).
"""

import ml_collections

from tx_jax.config import parse_arg, sibling_config


def _stored_config(init_from: str) -> ml_collections.ConfigDict:
    from tx_jax.inference import restore  # a config file loads the package lazily

    return restore.stored_config(init_from)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg, init_from="", pair="en-de", data="multi30k", lora=0, variant="default")
    if not args.init_from:
        raise ValueError(
            "configs/finetune.py needs the model to start from: "
            "--config=configs/finetune.py:init_from=WORKDIR (an imported or a trained run)"
        )
    if args.variant not in ("default", "debug"):
        raise ValueError(f"configs/finetune.py: unknown variant {args.variant!r} (default, debug)")
    if args.data not in ("multi30k", "text"):
        raise ValueError(f"configs/finetune.py: data={args.data!r}; expected multi30k or text")
    c = sibling_config(__file__, "multi30k", f"pair={args.pair}")
    if args.data == "text":  # its data section, lengths and batch left to the corpus
        c.data = sibling_config(__file__, "text", "default").data
    stored = _stored_config(args.init_from)
    c.model = ml_collections.ConfigDict(stored.model.to_dict())  # the architecture as stored
    # float32 master weights and optimizer state (a bfloat16 import is upcast on restore);
    # the compute dtype stays the checkpoint's.
    c.model.param_dtype = "float32"
    c.task = stored.get("task", "translation")
    c.data.tokenizer_path = args.init_from  # its WORKDIR/tokenizer.model: the same vocabulary
    c.data.vocab_size = stored.data.vocab_size
    if c.data.max_eval_len is not None:  # pretrained models' pieces are short
        c.data.max_eval_len = max(c.data.max_eval_len, 128)
    c.train.init_from = args.init_from  # parameters from there, optimizer fresh, step 0

    c.train.schedule = "cosine"  # linear warmup, then cosine decay to 0.1 x peak_lr
    c.train.warmup_steps = 100
    c.train.peak_lr = 5e-5  # small: the model is converged already
    c.train.final_lr_fraction = 0.1
    if args.lora:  # LoRA's rate: the one benchmarks/adapt_cpu.py's LoRA ran at
        c.train.lora.rank = args.lora
        c.train.peak_lr = 1e-3
    c.train.cooldown_steps = 0
    c.train.num_steps = 2_000
    c.train.label_smoothing = 0.1
    c.train.log_every = 50
    c.eval.every = 500
    c.eval.bleu_examples = 1014  # the whole Multi30k validation split
    c.eval.test_beam_size = 4
    c.checkpoint.every = 500
    c.checkpoint.keep = 3
    # Sharded jit over a (data, fsdp, tensor) mesh: a large model shards its parameters and
    # optimizer state with --config.parallel.mesh.fsdp=N (tx_jax plan --search finds N).
    c.parallel.strategy = "mesh"
    if args.variant == "debug":
        c.data.max_train_len = 48
        c.data.tokens_per_batch = 512
        c.data.bucket_boundaries = [48]
        c.data.max_train_pairs = 64  # the first 64 train pairs (a key configs/default.py lacks)
        c.train.update(num_steps=6, warmup_steps=2, log_every=2, peak_lr=1e-3)
        c.eval.update(every=6, bleu_examples=8, test_beam_size=1, score_test=False)
        c.checkpoint.every = 6
    return c
