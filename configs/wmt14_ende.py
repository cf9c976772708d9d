"""WMT 2014 English-German: the paper's setup (Vaswani et al., 2017, sections 5 and 6.1).

    --config=configs/wmt14_ende.py                       base, en->de (100k steps)
    --config=configs/wmt14_ende.py:variant=big           big (300k steps, P_drop 0.3)
    --config=configs/wmt14_ende.py:direction=de-en       the other direction
    --config=configs/wmt14_ende.py:debug                 tiny model, a few steps

Needs the network once (download=True: TFDS fetches and prepares wmt14_translate/de-en, ~4.5M
pairs), then accelerators: sized for a TPU v3-8 / 8 GPUs like the paper's 8 P100s.
Paper results (newstest2014, beam 4, length penalty 0.6, averaged checkpoints): base 27.3, big 28.4.
Built on configs/default.py; every key set here is commented, the others are default.py's.
"""

import ml_collections

from tx_jax.config import parse_arg, sibling_config, sibling_module
from tx_jax.model.config import VARIANTS as MODEL_VARIANTS

VARIANTS = ("base", "big", "debug")
DIRECTIONS = ("en-de", "de-en")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg, variant="base", direction="en-de")
    if args.direction not in DIRECTIONS:
        raise ValueError(
            f"configs/wmt14_ende.py: direction={args.direction!r}; expected one of "
            f"{', '.join(DIRECTIONS)}"
        )
    if args.variant not in VARIANTS:
        raise ValueError(
            f"configs/wmt14_ende.py: unknown variant {args.variant!r} ({', '.join(VARIANTS)})"
        )
    source, target = args.direction.split("-")
    c = sibling_config(__file__, "default")
    c.task = "translation"  # EncoderDecoder

    # Model: Table 3's base row (big below); post-LN, sinusoidal positions, tied embeddings.
    c.model.update(MODEL_VARIANTS["base"])  # M 512, H 8, d_ff 2048, 6 + 6 layers, P_drop 0.1
    c.model.attention_dropout_rate = 0.0  # the paper drops residuals and embeddings only
    c.model.norm_position = "post"  # the paper's post-LN
    c.model.positional = "sinusoidal"  # section 3.5
    c.model.share_embeddings = True  # one matrix for both embeddings and the output (3.4)
    c.model.tie_output = True
    c.model.dtype = "bfloat16"  # compute in bf16 (parameters and optimizer stay float32)

    # Data: TFDS wmt14_translate/de-en (train: europarl, commoncrawl, news commentary).
    c.data.dataset = "wmt14_translate/de-en"
    c.data.source_lang = source
    c.data.target_lang = target
    c.data.data_dir = None  # TFDS's default (~/tensorflow_datasets); gs://... on TPU VMs
    c.data.download = True  # online only: TFDS downloads and prepares the corpus once
    c.data.vocab_size = 37_000  # shared source-target SentencePiece vocabulary (section 5.1)
    c.data.tokenizer_pairs = 1_000_000  # a sample is enough for the pieces; 4.5M is slow
    c.data.max_train_len = 256  # longer pairs (in tokens, EOS included) are dropped
    c.data.max_eval_len = 256  # newstest sources/references are truncated to this
    # The paper's batches hold ~25k source + ~25k target tokens. tokens_per_batch is the
    # *padded* budget per side (B * max_train_len <= it, tx_jax/data/batches.py); packed rows are
    # ~96% real, so 104 rows of 256 = 26,624 positions carry ~25.5k real tokens per side.
    c.data.tokens_per_batch = 26_624
    c.data.bucket_boundaries = [256]  # packed rows of max_train_len: one shape
    c.data.packing = True
    c.data.eval_split = "validation"  # newstest2013 (section 6.2's development set)
    c.data.test_split = "test"  # newstest2014
    c.data.eval_batch_size = 128  # rows per eval/decode batch

    # Training: section 5.3 (Adam 0.9 / 0.98 / 1e-9, rsqrt schedule, warmup 4000).
    c.train.num_steps = 100_000  # the paper's base: 100k steps (12 hours on 8 P100s)
    c.train.schedule = "rsqrt"  # lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    c.train.warmup_steps = 4000
    c.train.lr_scale = 1.0  # exactly the paper's formula
    c.train.beta1 = 0.9
    c.train.beta2 = 0.98
    c.train.eps = 1e-9
    c.train.weight_decay = 0.0  # plain Adam
    c.train.clip_grad_norm = 0.0  # the paper does not clip
    c.train.label_smoothing = 0.1  # section 5.4
    c.train.grad_accum_steps = 1  # raise on fewer devices to keep the 25k-token batch
    c.train.log_every = 100

    # Evaluation: beam 4, length penalty 0.6 (section 6.1), on a validation subset during training.
    c.eval.every = 5000
    c.eval.bleu_examples = 500  # newstest2013 sentences decoded for BLEU during training
    c.eval.beam_size = 4
    c.eval.length_penalty = 0.6
    c.eval.test_beam_size = 4  # the final newstest2014 score
    c.eval.score_test = True  # newstest2014 scored at the end of training
    # Section 6.1 averages the last 5 (base) / 20 (big) checkpoints, written every 10
    # minutes; for the averaged score run:
    #   tx_jax evaluate --workdir=DIR --average_last=5 --split=test
    c.eval.average_last = 5

    # Checkpoints: every ~10 minutes (the paper's 0.4 s/step for base on 8 P100s -> 1500 steps).
    c.checkpoint.every = 1500
    c.checkpoint.keep = 5  # at least eval.average_last, plus the best by best_metric
    c.checkpoint.best_metric = "bleu"
    c.checkpoint.best_mode = "max"

    # Devices: sharded jit over a (data, fsdp, tensor) mesh; all devices on the data axis,
    # but on TPU the tensor axis 2 (0 = the platform's size): for base on a v5e-16 the plan's
    # --search ranks data=8 tensor=2 first, 3.6 GB of HBM traffic a chip a step against 4.6
    # with data=16, because each chip's Adam update and embedding gradient are half as large
    # (benchmarks/HISTORY.md, "Plans"). On one GPU or 8 CPU devices the same config is data-
    # parallel. Any size given explicitly wins: --config.parallel.mesh.tensor=1 for data=16.
    c.parallel.strategy = "mesh"
    c.parallel.mesh.tensor = 0
    c.parallel.mesh_by_platform = {"tpu": {"tensor": 2}}

    if args.variant == "big":
        c.model.update(MODEL_VARIANTS["big"])  # M 1024, H 16, d_ff 4096, 6 + 6 layers
        c.model.dropout_rate = 0.3  # P_drop 0.3 for EN-DE big (Table 3; 0.1 for EN-FR)
        c.train.num_steps = 300_000  # the paper's: 3.5 days on 8 P100s
        c.eval.average_last = 20  # section 6.1: the last 20 checkpoints
        c.checkpoint.every = 600  # ~10 minutes at the paper's 1.0 s/step
        c.checkpoint.keep = 20
    elif args.variant == "debug":
        c.model.update(sibling_module(__file__, "default").DEBUG_MODEL)
        c.model.dtype = "float32"
        c.data.vocab_size = 512
        c.data.tokenizer_pairs = 2000
        c.data.max_train_len = 64
        c.data.max_eval_len = 64
        c.data.bucket_boundaries = [64]
        c.data.tokens_per_batch = 1024  # 16 rows of 64
        c.data.eval_batch_size = 16
        c.train.update(num_steps=8, warmup_steps=4, lr_scale=0.5, log_every=2)
        c.eval.update(every=4, bleu_examples=16, beam_size=1, test_beam_size=1, average_last=2)
        c.eval.score_test = False  # skip the 3,003-sentence newstest2014 decode
        c.checkpoint.update(every=4, keep=2)
    return c
