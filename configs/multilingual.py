"""Multilingual Multi30k: one model for several directions among en/de/fr/cs, tagged targets.

    --config=configs/multilingual.py                        en<->de and en<->fr, CPU-sized
    --config=configs/multilingual.py:directions=en-de+en-fr+en-cs,mixture=temperature,temperature=5
    --config=configs/multilingual.py:directions=en-de+de-en,extra=de-fr+fr-de   zero-shot BLEU too
    --config=configs/multilingual.py:debug                  seconds (still reads the Multi30k files)

Arguments (`:a=b,c=d`; a bare word is the variant):
    directions   SRC-TGT directions joined by '+' (',' separates the arguments), each SRC and
                 TGT one of en, de, fr, cs; default en-de+de-en+en-fr+fr-en
    extra        directions decoded for BLEU but not trained (zero-shot), '+'-joined; default none
    mixture      uniform (each direction equally often) | temperature (p_i ~ n_i^(1/T))
    temperature  T of the temperature mixture (1: proportional to the pair counts)
    variant      default (sized for a 2-core CPU) | debug (seconds)

Every source gets the '<2xx>' tag of its target language (one SentencePiece piece), and one
SentencePiece vocabulary is trained over every language involved (tx_jax/data/directions.py).
Validation/test BLEU is logged per direction (bleu/en-de, ...) and as their mean (bleu), which
checkpoint.best_metric uses. For transfer: --config.data.max_train_pairs=N,
--config.train.init_from=runs/multi (its parameters and tokenizer), and
--config.data.tokenizer_path=runs/multi for a from-scratch run on the same vocabulary.
Built on configs/default.py; every key set here is commented, the others are default.py's.
"""

import ml_collections

from tx_jax.config import parse_arg, repo_path, sibling_config, sibling_module
from tx_jax.data import directions as directions_lib
from tx_jax.data.multi30k import LANGUAGES
from tx_jax.data.streams import MIXTURES

VARIANTS = ("default", "debug")


def parse_directions_arg(text: str, key: str = "directions") -> list[str]:
    """'en-de+de-en' -> ['en-de', 'de-en'], every language one of Multi30k's."""
    out = []
    for src, tgt in directions_lib.parse_directions(text, f"configs/multilingual.py: {key}"):
        if src not in LANGUAGES or tgt not in LANGUAGES:
            raise ValueError(
                f"configs/multilingual.py: {key}={text!r}: {src}-{tgt} is not a pair of "
                f"{', '.join(LANGUAGES)}"
            )
        out.append(f"{src}-{tgt}")
    return out


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(
        arg,
        directions="en-de+de-en+en-fr+fr-en",
        extra="",
        mixture="uniform",
        temperature=5.0,
        variant="default",
    )
    if args.variant not in VARIANTS:
        hint = "; join directions with '+' (',' separates arguments)" if "-" in args.variant else ""
        raise ValueError(
            f"configs/multilingual.py: unknown variant {args.variant!r} ({', '.join(VARIANTS)})"
            + hint
        )
    if args.mixture not in MIXTURES:
        raise ValueError(
            f"configs/multilingual.py: mixture={args.mixture!r} ({', '.join(MIXTURES)})"
        )
    trained = parse_directions_arg(args.directions)
    extra = parse_directions_arg(args.extra, "extra") if args.extra else []
    c = sibling_config(__file__, "default")
    c.task = "translation"  # one EncoderDecoder for every direction

    # Model: small enough for a 2-core CPU; shared embeddings across all languages.
    c.model.d_model = 128  # M
    c.model.num_heads = 4  # H
    c.model.d_ff = 512  # FFN inner width
    c.model.num_encoder_layers = 3
    c.model.num_decoder_layers = 3
    c.model.dropout_rate = 0.2  # Multi30k is small: strong regularisation
    c.model.attention_dropout_rate = 0.1
    c.model.norm_position = "post"  # the paper's post-LN
    c.model.share_embeddings = True  # one vocabulary for every language: one matrix
    c.model.tie_output = True  # logits = x E^T

    # Data: Multi30k read in every direction (tags, shared vocabulary: tx_jax/data/directions.py).
    c.data.dataset = "multi30k"
    # The keys of this study (configs/default.py has none; tx_jax/data/directions.py): the
    # trained directions, in sampling-state order, 'en-de,de-en' or a list, each source
    # tagged '<2xx>' with its target language; '' would be one untagged pair.
    c.data.directions = ml_collections.FieldReference(",".join(trained), field_type=object)
    # Also decoded for BLEU (zero-shot 'de-fr': bleu/de-fr), not trained, not in the mean.
    c.data.extra_eval_directions = ml_collections.FieldReference(",".join(extra), field_type=object)
    c.data.mixture = args.mixture  # direction sampling: uniform | temperature
    c.data.temperature = args.temperature  # T: p_i ~ n_i^(1/T) (1: proportional)
    # The first N train pairs of each direction, or per direction 'en-fr=3000,fr-en=3000'
    # (the directions not named keep every pair); 0: all.
    c.data.max_train_pairs = ml_collections.FieldReference(0, field_type=object)
    c.data.tokenizer_path = None  # None: train the shared tokenizer here
    c.data.source_lang, c.data.target_lang = trained[0].split("-")  # unused with directions
    c.data.manual_dir = repo_path(__file__, "..", "shared", "data", "multi30k")  # raw files
    c.data.data_dir = None  # TFDS's default (~/tensorflow_datasets)
    c.data.download = True  # without the files above, fetch them from github.com/multi30k/dataset
    c.data.vocab_size = 8000  # one SentencePiece vocabulary over every language involved
    c.data.tokenizer_pairs = 29_000  # per language pair: the whole train split
    c.data.max_train_len = 64  # Multi30k captions are short; tag + pieces + EOS
    c.data.max_eval_len = 96  # eval sources/references are truncated to this
    c.data.tokens_per_batch = 2048  # padded tokens per side per batch, directions mixed
    c.data.bucket_boundaries = [64]  # packed rows of max_train_len: one shape
    c.data.packing = True  # several pairs per row, separated by segment ids
    c.data.eval_split = "validation"  # 1,014 pairs per direction
    c.data.test_split = "test_2016_flickr"  # 1,000 pairs per direction
    c.data.eval_batch_size = 16  # sentences per eval/decode batch (CPU: small is fastest)

    # Training: the paper's schedule, shorter warmup; ~3 epochs of 4 x 29k pairs (~115 a step).
    c.train.num_steps = 3000
    c.train.schedule = "rsqrt"  # warmup then 1/sqrt(step)
    c.train.warmup_steps = 600
    c.train.lr_scale = 1.0  # peak 128^-0.5 * 600^-0.5 = 3.6e-3
    c.train.label_smoothing = 0.1  # section 5.4
    c.train.clip_grad_norm = 1.0  # global-norm clipping
    c.train.log_every = 100
    c.train.init_from = None  # another run's checkpoint to start from (transfer)

    # Evaluation: greedy BLEU per direction during training, beam 4 on the test set.
    c.eval.every = 1000
    c.eval.bleu_examples = 200  # validation pairs decoded per direction
    c.eval.beam_size = 1  # greedy during training
    c.eval.length_penalty = 0.6  # GNMT length penalty (beam search only)
    c.eval.test_beam_size = 4  # the final test_2016_flickr score per direction
    c.eval.score_test = True  # test_2016_flickr scored at the end of training

    # Checkpoints: the best by mean validation BLEU over the trained directions.
    c.checkpoint.every = 1000
    c.checkpoint.keep = 3  # latest K, plus the best by best_metric
    c.checkpoint.best_metric = "bleu"  # the mean of bleu/<direction>
    c.checkpoint.best_mode = "max"

    if args.variant == "debug":
        sibling_module(__file__, "multi30k").shrink_to_debug(c, bleu_examples=8)
    return c
