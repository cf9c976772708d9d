"""The default experiment: the embedded synthetic language pair, sized for a 2-core CPU.

python -m tx_jax.main --config=configs/default.py --workdir=runs/default
--config=configs/default.py:debug      shrinks everything to seconds (tests, smoke runs)
"""

import ml_collections

from tx_jax.config_utils import parse_arg


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg, variant="default")
    c = ml_collections.ConfigDict()
    c.seed = 0  # every random stream (init, dropout, data order) derives from this

    # Model: a small post-LN Transformer (paper defaults, shrunk for the CPU).
    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 1024  # joint SentencePiece vocabulary; set from the tokenizer
    c.model.d_model = 128  # M
    c.model.num_heads = 4  # H
    c.model.d_ff = 512  # FFN inner width
    c.model.num_encoder_layers = 2
    c.model.num_decoder_layers = 2
    c.model.dropout_rate = 0.1  # residual + embedding dropout
    c.model.attention_dropout_rate = 0.0
    c.model.norm_position = "post"  # the paper's post-LN
    c.model.positional = "sinusoidal"
    c.model.share_embeddings = True  # joint vocabulary -> one embedding
    c.model.tie_output = True  # logits = x E^T
    c.model.dtype = "float32"  # compute dtype; 'bfloat16' on accelerators

    if args.variant == "debug":
        c.model.d_model = 32
        c.model.num_heads = 2
        c.model.d_ff = 64
        c.model.num_encoder_layers = 1
        c.model.num_decoder_layers = 1
        c.model.vocab_size = 128
    elif args.variant != "default":
        raise ValueError(f"configs/default.py: unknown variant {args.variant!r} (default, debug)")
    return c
