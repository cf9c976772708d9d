"""The default experiment: the embedded synthetic language pair, sized for a 2-core CPU.

    ./launch.sh train                       (= tx_jax train --config=configs/default.py
                                               --workdir=runs/default)
    --config=configs/default.py:debug       shrinks everything to seconds (tests, smoke runs)

Sections: model (-> tx_jax.model.ModelConfig), data, train, eval, checkpoint, parallel.
"""

import ml_collections

from tx_jax.config import parse_arg
from tx_jax.model import lora
from tx_jax.training.parallel import DEFAULT_RULES

# The debug variants' model (here and in the configs built on this one): one layer each side,
# so that a run takes seconds.
DEBUG_MODEL = dict(
    d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg, variant="default")
    c = ml_collections.ConfigDict()
    c.seed = 0  # every random stream (init, dropout, data order) derives from this
    c.task = "translation"  # translation (EncoderDecoder) | lm (DecoderOnly; configs/lm.py)

    # Model: a small post-LN Transformer (the paper's design, shrunk for the CPU).
    c.model = ml_collections.ConfigDict()
    c.model.d_model = 128  # M
    c.model.num_heads = 4  # H
    c.model.num_kv_heads = ml_collections.FieldReference(None, field_type=int)  # K<H: GQA
    c.model.head_dim = ml_collections.FieldReference(None, field_type=int)  # None: d_model / H
    c.model.value_head_dim = ml_collections.FieldReference(None, field_type=int)  # d_v (None: D)
    c.model.d_ff = 512  # FFN inner width
    c.model.num_encoder_layers = 2
    c.model.num_decoder_layers = 2
    c.model.dropout_rate = 0.1  # residual + embedding dropout (P_drop)
    c.model.attention_dropout_rate = 0.0
    c.model.norm_position = "post"  # the paper's post-LN; 'pre' for deep models
    c.model.positional = "sinusoidal"  # sinusoidal | learned | rope | none
    c.model.share_embeddings = True  # joint vocabulary -> one embedding matrix
    c.model.tie_output = True  # logits = x E^T
    c.model.dtype = "float32"  # compute dtype; 'bfloat16' on accelerators
    c.model.param_dtype = "float32"  # storage dtype of parameters and Adam moments
    # The implementation fields: 'auto' is resolved once per run for its platform
    # (ModelConfig.resolved: the value tested and timed fastest there; docs/design.md).
    c.model.attention_impl = "auto"  # auto | xla | chunked (memory lever) | cudnn (GPU) | splash
    c.model.kernels = "auto"  # auto (XLA:CPU-tuned kernels on CPU) | cpu | generic
    c.model.remat = "none"  # memory lever: none | full (recompute each layer) | dots (keep matmuls)
    c.model.dropout_bits = "auto"  # auto (CPU packed, else bernoulli) | bernoulli | packed
    c.model.loss_impl = "auto"  # auto (dense) | dense | blocked (memory lever: logits per block)
    c.model.loss_block = 64  # 'blocked': target positions per block

    # Data: TFDS dataset, SentencePiece vocabulary, token-budget batches.
    c.data = ml_collections.ConfigDict()
    c.data.dataset = "synthetic"  # synthetic | multi30k | a TFDS name (wmt14_translate/de-en)
    c.data.source_lang = "src"
    c.data.target_lang = "tgt"
    c.data.data_dir = ml_collections.FieldReference(None, field_type=str)  # TFDS dir; None: default
    c.data.manual_dir = ml_collections.FieldReference(None, field_type=str)  # raw files (Multi30k)
    # A gs:// data_dir is read from a verified local copy here (None: $TX_JAX_DATA_CACHE or
    # ~/.cache/tx_jax/data): array_record reads local files only (tx_jax/data/staging.py).
    c.data.data_cache_dir = ml_collections.FieldReference(None, field_type=str)
    c.data.download = False  # may the TFDS data be downloaded (never for 'synthetic')
    c.data.synthetic = ml_collections.ConfigDict(
        dict(num_train=50_000, num_validation=1_000, num_test=1_000, seed=0)
    )
    c.data.vocab_size = 512  # joint SentencePiece pieces (the model's vocab_size follows it)
    # Train pairs the tokenizer learns from: a uniform sample over the whole train split (drawn
    # with c.seed), all of them when the split has no more.
    c.data.tokenizer_pairs = 50_000
    # SentencePiece's training options (tx_jax/data/run_tokenizer.py).
    c.data.tokenizer = ml_collections.ConfigDict()
    c.data.tokenizer.model_type = "unigram"  # unigram | bpe
    c.data.tokenizer.character_coverage = 1.0  # (0, 1]: share of the sample's characters kept
    c.data.tokenizer.byte_fallback = False  # an unknown character as UTF-8 byte pieces, not <unk>
    # Train pairs with a longer side (in tokens, EOS included) are dropped; packed rows are this
    # long. Not model.max_len, the learned position table's size.
    c.data.max_train_len = 64
    c.data.max_eval_len = 96  # eval sources/references are truncated to this
    # Eval/decode batches are sorted by length and padded to these ([]: x1.5 steps up to
    # max_eval_len, 16, 24, 40, 64, 96; [max_eval_len]: one shape).
    c.data.eval_bucket_boundaries = []
    c.data.tokens_per_batch = 2048  # global token budget per batch (padded, per side)
    # Static shapes: one compilation per bucket (None: every 8 tokens up to max_train_len).
    c.data.bucket_boundaries = [16, 32, 48, 64]
    c.data.packing = True  # pack pairs into max_train_len rows with segment ids (one shape)
    # Train stream shards (fixed for a run, whatever the process count); a pod sets a multiple
    # of its processes so each reads only its share (docs/training.md "Multi-host input").
    c.data.input_shards = 1
    c.data.eval_split = "validation"
    c.data.test_split = "test"  # the dataset's test split ('test' in evaluate --split=test)
    # Sentences per eval/decode batch: on a 2-core CPU small batches decode fastest (sorted by
    # length, they finish together; BENCHMARKS.md "Evaluation speed"); accelerators want more.
    c.data.eval_batch_size = 16
    # Study keys live in the configs of their study (tx_jax/config.py STUDY_KEYS: a config
    # without one reads its neutral value): data.lm_side (configs/lm.py); data.directions,
    # extra_eval_directions, mixture, temperature, max_train_pairs (configs/multilingual.py);
    # data.backtranslation, backtranslation_tag (experiments/backtranslation.py).
    # An existing tokenizer.model (or a run directory holding one) instead of training one here.
    c.data.tokenizer_path = ml_collections.FieldReference(None, field_type=str)

    # Training: Adam with the paper's settings and its rsqrt warmup schedule.
    c.train = ml_collections.ConfigDict()
    c.train.num_steps = 600
    c.train.schedule = "rsqrt"  # rsqrt (paper) | linear_rsqrt | cosine | constant
    c.train.warmup_steps = 200
    c.train.lr_scale = 0.5  # multiplies the paper's d_model^-0.5 * min(...) schedule
    c.train.peak_lr = 1e-3  # for linear_rsqrt / cosine / constant
    c.train.final_lr_fraction = 0.1  # cosine: end at peak_lr * this
    c.train.cooldown_steps = 0  # > 0: the last N updates ramp the rate linearly down to 0
    # > 0: minutes of training, the schedule fitted to them: a new run times its update and
    # fixes num_steps (warmup kept, capped at half; cooldown keeps its share of num_steps) so
    # that set-up, compilation, updates and saves fill it (periodic evaluations not counted;
    # the final evaluation and test score come after). 0: off (runner/budget.py)
    c.train.time_budget_minutes = 0.0
    c.train.beta1 = 0.9
    c.train.beta2 = 0.98
    c.train.eps = 1e-9
    c.train.weight_decay = 0.0  # > 0 switches to AdamW
    c.train.clip_grad_norm = 1.0  # global-norm clipping; 0 disables
    c.train.label_smoothing = 0.1  # section 5.4
    c.train.grad_accum_steps = 1  # split each batch into this many micro-batches
    c.train.log_every = 50
    c.train.restore_data_iterator = True  # resume the exact batch sequence
    c.train.max_nonfinite_steps = 10  # stop after this many non-finite updates in a row
    # Bit-identical GPU runs: XLA:GPU's deterministic ops (no atomics) and XLA's attention in
    # place of cuDNN's, which fails in that mode; a CPU run is deterministic already.
    c.train.deterministic = False
    # (start, stop): a jax.profiler trace of steps start .. stop-1 into WORKDIR/tensorboard
    # (TensorBoard's profile view); () for none.
    c.train.profile_steps = ()
    # Start from another run's parameters and tokenizer (its workdir, checkpoints dir or one
    # step dir) with a fresh optimizer at step 0; read only when this workdir has no checkpoint.
    c.train.init_from = ml_collections.FieldReference(None, field_type=str)
    # Adapting init_from's model (docs/models.md "Adapting a pretrained translator"): rank > 0
    # adds LoRA adapters and only they train; trainable, a pattern over parameter paths, trains
    # those (the rest frozen, stored as frozen_dtype when set)
    c.train.lora = ml_collections.ConfigDict(
        dict(rank=0, alpha=32.0, dropout=0.0, targets=lora.DEFAULT_TARGETS)
    )
    c.train.trainable = ""
    c.train.frozen_dtype = ""

    # Evaluation during training (and the final test-split score).
    c.eval = ml_collections.ConfigDict()
    c.eval.every = 300  # validation loss/accuracy/perplexity + BLEU every N steps
    c.eval.bleu_examples = 200  # validation pairs decoded for BLEU (0 disables)
    c.eval.beam_size = 1  # 1: greedy during training
    c.eval.length_penalty = 0.6  # GNMT length penalty for beam search
    c.eval.test_beam_size = 0  # beam for the final test-split score; 0: eval.beam_size
    c.eval.score_test = True  # the end of training scores data.test_split
    c.eval.average_last = 0  # > 0: the test score (and `evaluate`) use the last K checkpoints' mean

    # Checkpoints (Orbax).
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 200
    c.checkpoint.keep = 3  # latest K, plus the best by best_metric
    c.checkpoint.best_metric = "bleu"  # a validation metric: bleu, loss, accuracy, ...
    c.checkpoint.best_mode = "max"  # max for bleu/accuracy, min for loss/perplexity
    c.checkpoint.async_save = True

    # Devices: 'mesh' (one jit program over a data/fsdp/tensor Mesh) or 'pmap' (jax.pmap,
    # the state replicated on every device).
    c.parallel = ml_collections.ConfigDict()
    c.parallel.strategy = "mesh"
    c.parallel.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    # An axis of 0 in parallel.mesh takes its size from here for the devices' platform
    # ({'tpu': {'tensor': 2}}) where that divides the devices, else 1.
    c.parallel.mesh_by_platform = ml_collections.ConfigDict()
    c.parallel.rules = [list(r) for r in DEFAULT_RULES]  # logical axis -> mesh axes
    c.parallel.distributed = False  # jax.distributed.initialize (TPU pods, multi-host)
    c.parallel.coordinator_address = ml_collections.FieldReference(None, field_type=str)
    c.parallel.num_processes = ml_collections.FieldReference(None, field_type=int)
    c.parallel.process_id = ml_collections.FieldReference(None, field_type=int)

    if args.variant == "debug":
        c.model.update(DEBUG_MODEL)
        c.data.synthetic.update(num_train=400, num_validation=40, num_test=40)
        c.data.vocab_size = 160
        c.data.tokenizer_pairs = 400
        c.data.tokens_per_batch = 512
        c.data.eval_batch_size = 16
        c.train.update(num_steps=8, warmup_steps=4, log_every=2)
        c.eval.update(every=4, bleu_examples=16)
        c.checkpoint.every = 4
    elif args.variant != "default":
        raise ValueError(f"configs/default.py: unknown variant {args.variant!r} (default, debug)")
    return c
