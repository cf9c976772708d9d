"""Your own parallel corpus in plain text: Moses/OPUS pairs, TSV files, shards, gzip, gs://.

    tx_jax train --config=configs/text.py --workdir=runs/mine \
      --config.data.source_lang=en --config.data.target_lang=de \
      --config.data.train='corpus/train-*' --config.data.validation=corpus/dev.tsv \
      --config.data.test=corpus/test
    --config=configs/text.py:debug     seconds (the debug model and schedule of default.py)

Each of data.train, data.validation and data.test is a prefix P, read as P.<source_lang> and
P.<target_lang> (each plain or .gz; a wildcard in P's file name matches shards, paired by
name), or a path ending .tsv or .tsv.gz (source TAB target). Each split is prepared once into
data_dir, keyed by its files' content (tx_jax/data/text_corpus.py; docs/data.md "Your own
corpus"). The model, vocabulary, lengths and schedule are left to the data (None): the run
chooses them from the prepared train split and says so in one line (tx_jax/runner/
sizing.py's rule; `tx_jax prepare` prints the same choices); any of them set on the
command line wins. The rest is configs/default.py's; every key set here is commented.
"""

import ml_collections

from tx_jax.config import parse_arg, sibling_config
from tx_jax.runner.sizing import SIZED_KEYS, SIZED_TYPES


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg, variant="default")
    if args.variant not in ("default", "debug"):
        raise ValueError(f"configs/text.py: unknown variant {args.variant!r} (default, debug)")
    c = sibling_config(__file__, "default", args.variant)

    c.data.dataset = "text"  # tx_jax/data/text_corpus.py
    c.data.source_lang = "en"  # a language code: the files' suffix (train.en) and a feature
    c.data.target_lang = "de"
    none = dict(field_type=str)
    c.data.train = ml_collections.FieldReference(None, **none)  # prefix, glob or .tsv[.gz]
    c.data.validation = ml_collections.FieldReference(None, **none)  # read for eval_split
    c.data.test = ml_collections.FieldReference(None, **none)  # read for test_split; optional
    # Cleaning of the train split (every split drops pairs with an empty side); 0: off.
    c.data.clean = ml_collections.ConfigDict()
    c.data.clean.max_chars = 0  # drop train pairs whose longer side has more characters
    c.data.clean.max_ratio = 0.0  # drop train pairs whose sides' lengths differ more (e.g. 3)
    c.data.clean.dedup = False  # drop a train pair identical to an earlier one (both sides)
    # A character the vocabulary lacks is encoded as its UTF-8 bytes, not <unk> (256 of the
    # pieces: the debug variant's 160 pieces have no room for them).
    c.data.tokenizer.byte_fallback = args.variant == "default"
    c.eval.bleu_examples = 1000  # validation pairs decoded for BLEU during training
    c.train.lr_scale = 1.0  # the paper's d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    if args.variant == "default":
        c.eval.test_beam_size = (
            4  # the test score: beam 4, length penalty 0.6 (the paper's section 6.1)
        )
        leave_to_data(c)
    return c


def leave_to_data(c: ml_collections.ConfigDict) -> None:
    """The model, vocabulary, lengths and schedule are chosen from the corpus when the run
    reads it (tx_jax/runner/sizing.py; docs/data.md "Your own corpus"): each is None here,
    and any of them set on the command line is kept as set."""
    for key in SIZED_KEYS:
        section, name = key.split(".")
        c[section][name] = ml_collections.FieldReference(None, field_type=SIZED_TYPES[key])
