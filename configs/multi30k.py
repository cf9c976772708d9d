"""Multi30k (task 1) translation, any pair of en/de/fr/cs: the raw release's files from
data.manual_dir when they are there, else downloaded once (~1.5 MB a pair) into data.data_dir.

    --config=configs/multi30k.py                         en->de, the `small` model
    --config=configs/multi30k.py:pair=fr-en,variant=base
    --config=configs/multi30k.py:debug                   seconds (still reads the Multi30k files)
    --config=configs/multi30k.py:reader=text             the same files read as a user's plain-text
                                                         corpus (configs/text.py's dataset)

Variants: `small` (d_model 256, 3+3 layers; its en->de test BLEU: docs/experiments.md
"Time to BLEU"), `base` (the paper's base model; overfits 29k pairs), `debug`.
Built on configs/default.py; every key set here is commented, the others are default.py's.
"""

import ml_collections

from tx_jax.config import parse_arg, repo_path, sibling_config, sibling_module
from tx_jax.data.multi30k import LANGUAGES
from tx_jax.model.config import VARIANTS as MODEL_VARIANTS

VARIANTS = ("small", "base", "debug")


def parse_pair(pair: str, config_file: str = "configs/multi30k.py") -> tuple[str, str]:
    """'en-de' -> ('en', 'de'); anything else is a ValueError naming the argument."""
    src, sep, tgt = pair.partition("-")
    if not sep or src not in LANGUAGES or tgt not in LANGUAGES or src == tgt:
        raise ValueError(
            f"{config_file}: pair={pair!r}; expected SRC-TGT, two different languages of "
            f"{', '.join(LANGUAGES)} (e.g. en-de, fr-en, cs-fr)"
        )
    return src, tgt


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg, pair="en-de", variant="small", reader="multi30k")
    source, target = parse_pair(args.pair)
    if args.variant not in VARIANTS:
        raise ValueError(
            f"configs/multi30k.py: unknown variant {args.variant!r} ({', '.join(VARIANTS)})"
        )
    c = sibling_config(__file__, "default")
    c.task = "translation"  # EncoderDecoder

    # Model: 'small' (base: MODEL_VARIANTS['base'], the paper's Table 3 base row).
    c.model.update(MODEL_VARIANTS["small"])  # M 256, H 4, d_ff 1024, 3 + 3 layers
    c.model.dropout_rate = 0.3  # 29k pairs overfit quickly: heavy dropout helps most
    c.model.attention_dropout_rate = 0.1
    c.model.norm_position = "post"  # the paper's post-LN (3 layers train fine without pre-LN)
    # bfloat16 compute, float32 parameters and optimizer state: on a CPU with bfloat16 matrix
    # units (AMX: Intel Sapphire Rapids and later) the CPU kernels' dots run on them, 1.8x
    # float32's step rate here (BENCHMARKS.md); AMD Zen 4's avx512_bf16 doubles float32's dot
    # rate too; on a CPU with neither (no `avx512_bf16` in /proc/cpuinfo) use float32.
    c.model.dtype = "bfloat16"

    # Data: the raw Multi30k release, read through the TFDS builder in tx_jax/data/multi30k.py.
    c.data.dataset = "multi30k"
    c.data.source_lang = source
    c.data.target_lang = target
    # The raw files (train.en.gz, val.en.gz, ...) where the project's machines keep them; a
    # directory that does not exist (a fresh clone) means: download them.
    c.data.manual_dir = repo_path(__file__, "..", "shared", "data", "multi30k")
    c.data.data_dir = None  # TFDS's default (~/tensorflow_datasets): shared by every workdir
    c.data.download = True  # without the files above, fetch them from github.com/multi30k/dataset
    c.data.vocab_size = 8000  # joint SentencePiece pieces over both languages
    c.data.tokenizer_pairs = 29_000  # the whole train split
    c.data.max_train_len = 64  # Multi30k sentences are short (~13 words); longer pairs are dropped
    c.data.max_eval_len = 96  # eval sources/references are truncated to this
    c.data.tokens_per_batch = 4096  # padded tokens per side per batch (~4k real with packing)
    c.data.bucket_boundaries = [64]  # packed rows of max_train_len: one shape
    c.data.packing = True  # several pairs per row, separated by segment ids
    c.data.eval_split = "validation"  # 1,014 pairs (val.*.gz)
    c.data.test_split = "test_2016_flickr"  # 1,000 pairs: the usual Multi30k test set
    c.data.eval_batch_size = 16  # sentences per eval/decode batch (CPU: small is fastest)

    # Training: ~238 pairs (~3,850 target tokens) an update: ~122 updates per epoch of the 29k
    # pairs; 9,000 updates (~74 epochs) are ~140 min on the 2-core Sapphire Rapids CPU.
    c.train.num_steps = 9_000
    c.train.schedule = "rsqrt"  # the paper's warmup then 1/sqrt(step) decay
    c.train.warmup_steps = 1000  # shorter than the paper's 4000: far fewer steps in all
    # then a linear cooldown to 0 over the last 20%: the earlier checkpoints (e.g. the 60-minute
    # one) are those of an undecayed run, and the last one is decayed.
    c.train.cooldown_steps = 1_800
    c.train.lr_scale = 1.0  # peak d_model^-0.5 * warmup^-0.5 = 2.0e-3
    c.train.label_smoothing = 0.1  # section 5.4
    c.train.clip_grad_norm = 1.0  # global-norm clipping
    c.train.log_every = 100

    # Evaluation: greedy BLEU on validation during training; beam 4, length penalty 0.6 on the
    # test set.
    c.eval.every = 1000  # ~20 s of greedy decoding each
    c.eval.bleu_examples = 1014  # the whole validation split
    c.eval.beam_size = 1  # greedy during training (fast)
    c.eval.length_penalty = 0.6  # GNMT length penalty (beam search only)
    c.eval.test_beam_size = 4  # the final test_2016_flickr score uses beam 4
    c.eval.score_test = True  # test_2016_flickr scored at the end of training

    # Checkpoints: every ~8 minutes, all kept (averaging candidates, and the choice within a
    # time budget: experiments/multi30k_ende.py --budgets), plus the best validation BLEU.
    c.checkpoint.every = 500
    c.checkpoint.keep = 20  # latest K, plus the best by best_metric
    c.checkpoint.best_metric = "bleu"
    c.checkpoint.best_mode = "max"

    if args.variant == "base":
        c.model.update(MODEL_VARIANTS["base"])  # M 512, H 8, d_ff 2048, 6 + 6 layers
        c.model.dropout_rate = 0.3  # the paper's 0.1 overfits Multi30k within a few epochs
        c.train.warmup_steps = 4000  # the paper's warmup
        c.train.lr_scale = 1.0  # peak 512^-0.5 * 4000^-0.5 = 7.0e-4
        c.train.num_steps = 20_000
        c.train.cooldown_steps = 4_000
    elif args.variant == "debug":
        shrink_to_debug(c, bleu_examples=16)
    if args.reader == "text":  # the raw files as prefixes: train.en.gz + train.de.gz, ...
        c.data.dataset = "text"
        for split, prefix in (("train", "train"), ("validation", "val"), (c.data.test_split, "")):
            c.data[split] = f"{c.data.manual_dir}/{prefix or split}"
        c.data.clean = ml_collections.ConfigDict(dict(max_chars=0, max_ratio=0.0, dedup=False))
    elif args.reader != "multi30k":
        raise ValueError(f"configs/multi30k.py: reader={args.reader!r} (multi30k, text)")
    return c


def shrink_to_debug(c: ml_collections.ConfigDict, bleu_examples: int) -> None:
    """The `debug` variant over the real Multi30k files (also configs/multilingual.py's):
    a one-layer model and one batch shape, so that a run takes seconds."""
    c.model.update(sibling_module(__file__, "default").DEBUG_MODEL, attention_dropout_rate=0.0)
    c.model.dtype = "float32"
    c.data.vocab_size = 200  # small enough for a few hundred fixture lines per language
    c.data.tokenizer_pairs = 500
    c.data.max_train_len = 32
    c.data.max_eval_len = 32
    c.data.bucket_boundaries = [32]
    c.data.tokens_per_batch = 512  # 16 rows of 32
    c.data.eval_batch_size = 16
    c.train.update(num_steps=8, warmup_steps=4, lr_scale=0.5, log_every=2, cooldown_steps=0)
    c.eval.update(every=4, bleu_examples=bleu_examples, test_beam_size=2)
    c.checkpoint.every = 4
