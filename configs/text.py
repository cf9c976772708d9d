"""Your own parallel corpus in plain text: Moses/OPUS pairs, TSV files, shards, gzip, gs://.

    python -m tx_jax.main --config=configs/text.py --workdir=runs/mine \
      --config.data.source_lang=en --config.data.target_lang=de \
      --config.data.train='corpus/train-*' --config.data.validation=corpus/dev.tsv \
      --config.data.test=corpus/test
    --config=configs/text.py:debug     seconds (the debug model and schedule of default.py)

Each of data.train, data.validation and data.test is a prefix P, read as P.<source_lang> and
P.<target_lang> (each plain or .gz; a wildcard in P's file name matches shards, paired by
name), or a path ending .tsv or .tsv.gz (source TAB target). Each split is prepared once into
data_dir, keyed by its files' content (tx_jax/data/text_corpus.py; docs/data.md "Your own
corpus"). Model and training are configs/default.py's; every key set here is commented.
"""

import ml_collections

from tx_jax.config import parse_arg, sibling_config


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
    return c
