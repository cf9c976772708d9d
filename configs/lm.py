"""Decoder-only language modelling (config.task='lm') on one side of a translation corpus.

    --config=configs/lm.py                   the synthetic corpus's target side, CPU, ~minutes
    --config=configs/lm.py:multi30k          Multi30k's English side (manual_dir, else downloaded)
    --config=configs/lm.py:debug             seconds
    --config=configs/lm.py:variant=long,length=32768   long context: a base-size
                                             model on packed rows of `length` tokens, sized for
                                             accelerators (tx_jax plan plans it)
    tx_jax generate --workdir=DIR --prompt="the red"     samples from the result

The model is a DecoderOnly (tx_jax/model/transformer.py): pre-LN and RoPE, the choices of
current LMs.
Validation (and test) give loss, accuracy and perplexity; there is no BLEU.
Built on configs/default.py; every key set here is commented, the others are default.py's.
"""

import ml_collections

from tx_jax.config import parse_arg, repo_path, sibling_config

VARIANTS = ("default", "multi30k", "debug", "long")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg, variant="default", length=8192)
    if args.variant not in VARIANTS:
        raise ValueError(f"configs/lm.py: unknown variant {args.variant!r} ({', '.join(VARIANTS)})")
    c = sibling_config(__file__, "default")
    c.task = "lm"  # DecoderOnly; batches hold 'targets' only

    # Model: a small pre-LN decoder with rotary positions.
    c.model.d_model = 128  # M
    c.model.num_heads = 4  # H (head dim 32: even, as RoPE needs)
    c.model.d_ff = 512
    c.model.num_encoder_layers = 1  # unused by DecoderOnly (kept valid for ModelConfig)
    c.model.num_decoder_layers = 4
    c.model.dropout_rate = 0.1
    c.model.norm_position = "pre"  # x + f(norm(x)), plus a final norm
    c.model.positional = "rope"  # rotary positions in every attention layer
    c.model.tie_output = True  # logits = x E^T

    # Data: the synthetic pair corpus; the model reads its target side only.
    c.data.dataset = "synthetic"
    c.data.lm_side = "target"  # this task's key: target | source | both (2 texts per pair)
    c.data.vocab_size = 512  # SentencePiece trained on the modelled side only
    c.data.max_train_len = 64  # longer texts (in tokens, EOS included) are dropped
    c.data.max_eval_len = 64  # eval texts are truncated to this (one padded shape)
    c.data.tokens_per_batch = 2048  # padded tokens per batch (32 packed rows of 64)
    c.data.bucket_boundaries = [64]  # packed rows of max_train_len: one shape
    c.data.packing = True  # several texts per row, separated by segment ids

    # Training: linear warmup then 1/sqrt decay from a fixed peak.
    c.train.num_steps = 600
    c.train.schedule = "linear_rsqrt"
    c.train.warmup_steps = 100
    c.train.peak_lr = 2e-3
    c.train.label_smoothing = 0.0  # plain cross-entropy: perplexity is the objective
    c.train.log_every = 50

    # Evaluation: loss / accuracy / perplexity on validation, then on the test split.
    c.eval.every = 300
    c.eval.bleu_examples = 0  # no BLEU for a language model (ignored anyway)
    c.eval.score_test = True  # data.test_split's perplexity is logged at the end

    # Checkpoints: the best by validation perplexity is kept too.
    c.checkpoint.every = 300
    c.checkpoint.best_metric = "perplexity"
    c.checkpoint.best_mode = "min"

    if args.variant == "multi30k":
        # 29k sentences: a wider model with heavy dropout.
        c.model.update(d_model=256, num_heads=4, d_ff=1024, num_decoder_layers=4, dropout_rate=0.3)
        c.data.dataset = "multi30k"
        c.data.source_lang = "en"  # the modelled side
        c.data.target_lang = "de"  # read but not modelled (Multi30k comes in pairs)
        c.data.lm_side = "source"
        c.data.manual_dir = repo_path(__file__, "..", "shared", "data", "multi30k")
        c.data.data_dir = None  # TFDS's default (~/tensorflow_datasets)
        c.data.download = True  # without the files above, fetched from github.com/multi30k
        c.data.vocab_size = 4000  # English only: ~10k word types
        c.data.tokenizer_pairs = 29_000  # the whole train split
        c.data.tokens_per_batch = 4096
        c.data.eval_split = "validation"
        c.data.test_split = "test_2016_flickr"
        c.train.update(num_steps=6000, warmup_steps=500, peak_lr=1e-3, log_every=100)
        c.eval.every = 1000
        c.checkpoint.every = 1000
    elif args.variant == "long":
        # Long context: the paper's base width, 6 decoder layers, bf16, one packed row of
        # `length` tokens per chip of a 16-chip slice. Attention 'chunked', the memory lever:
        # memory linear in the length, where 'xla' (TPU's 'auto') does not fit a v5e at 32k
        # ('cudnn', by name, is faster on a GPU; 'splash' is the TPU's candidate).
        c.model.update(d_model=512, num_heads=8, d_ff=2048, num_decoder_layers=6, dropout_rate=0.1)
        c.model.attention_impl = "chunked"
        c.model.dtype = "bfloat16"
        c.data.vocab_size = 32_000
        c.data.max_train_len = c.data.max_eval_len = int(args.length)
        c.data.bucket_boundaries = [int(args.length)]
        c.data.tokens_per_batch = 16 * int(args.length)  # 16 rows
        c.data.eval_batch_size = 4  # rows per host per eval batch
        c.parallel.strategy = "mesh"
    elif args.variant == "debug":
        c.model.update(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=1, dropout_rate=0.0)
        c.data.synthetic.update(num_train=400, num_validation=40, num_test=40)
        c.data.vocab_size = 160
        c.data.tokenizer_pairs = 400
        c.data.max_train_len = 32
        c.data.max_eval_len = 32
        c.data.bucket_boundaries = [32]
        c.data.tokens_per_batch = 512  # 16 rows of 32: divisible by 8 devices
        c.data.eval_batch_size = 16
        c.train.update(num_steps=8, warmup_steps=4, log_every=2)
        c.eval.every = 4
        c.checkpoint.every = 4
    return c
