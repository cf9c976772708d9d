"""Autoregressive decoding over a KV cache: logits functions and the jitted entry points.

Shape letters: B batch, S source length, P prompt length, T decode length, V vocabulary,
N beams.

Everything is written against one abstraction, the *logits function*

    tokens_to_logits(tokens [B, 1], cache) -> (logits [B, V] float32, new cache)

which takes the previous token of every row and returns the scores of the next one.
`encoder_decoder_logits_fn` and `decoder_only_logits_fn` build it, with its initial cache,
for the two model families. With `use_cache=False` they build the no-cache reference
instead: its "cache" is the token prefix, which it runs through the full (non-decode) model
at every step. Benchmarks compare the two for speed and tests check that they agree.

The searches (search.py: `greedy_decode`, `beam_search`, `sample_decode`) see only the
logits function; each is one `lax.while_loop` with static shapes that stops as soon as every
row is finished. `translate_greedy`, `translate_beam` and `sample` are the jitted entry points:
a ModelConfig, the 'params' collection and token arrays in, tokens out.

Conventions: outputs never contain BOS. A sequence ends with its EOS and holds padding (0)
after it. Padding is never generated: its log-probability is set to -inf.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from tx_jax.inference.search import (
    EOS_ID,
    Cache,
    LogitsFn,
    beam_search,
    greedy_decode,
    sample_decode,
)
from tx_jax.model.config import ModelConfig
from tx_jax.model.transformer import DecoderOnly, EncoderDecoder

Array = jax.Array
EXTRA_DECODE_LEN = 50  # section 6.1: maximum output length = input length + 50


def decode_length(
    source_length: int | None, max_decode_len: int | None = None, config: ModelConfig | None = None
) -> int:
    """T: the paper's output limit, source length + 50 (section 6.1), capped by max_decode_len
    (alone when source_length is None: language models) and, for learned positions, by the
    position table (config.max_len)."""
    lengths = [max_decode_len]
    if source_length is not None:
        lengths.append(source_length + EXTRA_DECODE_LEN)
    if config is not None and config.positional == "learned":
        lengths.append(config.max_len)
    lengths = [n for n in lengths if n is not None]
    if not lengths:
        raise ValueError("a language model needs max_decode_len")
    return min(lengths)


# ------------------------------------------------------------------ logits functions


def _cached_logits_fn(
    model: nn.Module, params: Any, batch: int, length: int, *args: Array, method: str | None = None
) -> tuple[LogitsFn, Cache]:
    """A decode-mode `model.apply(variables, *args, tokens)` as a logits function.

    The first call, without a cache, creates it; its [batch, length] dummy input fixes the
    cache length. Inside jit only the (all-zero) cache survives, the rest is dead code.
    """

    def run(variables, tokens):
        return model.apply(variables, *args, tokens, method=method, mutable=["cache"])

    _, init = run({"params": params}, jnp.zeros((batch, length), jnp.int32))

    def tokens_to_logits(tokens: Array, cache: Cache) -> tuple[Array, Cache]:
        logits, updated = run({"params": params, "cache": cache}, tokens)
        return logits[:, -1], updated["cache"]

    return tokens_to_logits, init["cache"]


def _prefix_logits_fn(
    full_logits: Callable[[Array], Array], batch: int, length: int
) -> tuple[LogitsFn, Cache]:
    """The no-cache reference: append the token to a [batch, length] prefix and run the full
    model, full_logits(decoder inputs [B, T]) -> [B, T, V], on it every step."""

    def tokens_to_logits(tokens: Array, state: Cache) -> tuple[Array, Cache]:
        i = state["index"]
        prefix = lax.dynamic_update_slice(state["tokens"], tokens.astype(jnp.int32), (0, i))
        # Causal attention: the zeros after position i never reach position i's logits.
        logits = lax.dynamic_index_in_dim(full_logits(prefix), i, axis=1, keepdims=False)
        return logits, {"tokens": prefix, "index": i + 1}

    state = {"tokens": jnp.zeros((batch, length), jnp.int32), "index": jnp.array(0, jnp.int32)}
    return tokens_to_logits, state


def encoder_decoder_logits_fn(
    config: ModelConfig,
    params: Any,
    inputs: Array,
    *,
    max_decode_len: int,
    num_beams: int = 1,
    use_cache: bool = True,
) -> tuple[LogitsFn, Cache]:
    """Logits function and initial cache for translating `inputs` [B, S] with EncoderDecoder.

    The source is encoded once; the encoder output and source tokens (for the padding mask)
    are closed over. Row b * N + n of the logits function's batch [B * N] is beam n of
    example b. The cache holds max_decode_len positions; cross-attention keys/values enter
    it on the first step. `params` is the 'params' collection (boxed or not).
    """
    params = nn.meta.unbox(params)
    model = EncoderDecoder(config.replace(decode=False))
    encoded = model.apply({"params": params}, inputs, method="encode")  # [B, S, M]
    encoded = jnp.repeat(encoded, num_beams, axis=0)  # [B * N, S, M]
    inputs = jnp.repeat(inputs, num_beams, axis=0)
    batch = inputs.shape[0]
    if use_cache:
        decoder = EncoderDecoder(config.replace(decode=True))
        return _cached_logits_fn(
            decoder, params, batch, max_decode_len, encoded, inputs, method="decode"
        )

    def full_logits(prefix: Array) -> Array:
        return model.apply(
            {"params": params},
            encoded,
            inputs,
            prefix,
            targets_segmentation=jnp.ones_like(prefix),
            method="decode",
        )

    return _prefix_logits_fn(full_logits, batch, max_decode_len)


def decoder_only_logits_fn(
    config: ModelConfig,
    params: Any,
    batch_size: int,
    *,
    max_decode_len: int,
    use_cache: bool = True,
) -> tuple[LogitsFn, Cache]:
    """Logits function and initial cache for a DecoderOnly language model, batch [B]."""
    params = nn.meta.unbox(params)
    if use_cache:
        model = DecoderOnly(config.replace(decode=True))
        return _cached_logits_fn(model, params, batch_size, max_decode_len)
    model = DecoderOnly(config.replace(decode=False))

    def full_logits(prefix: Array) -> Array:
        # The decoder itself, fed decoder inputs (BOS first) as is; every position is real.
        seg = jnp.ones_like(prefix)
        return model.apply(
            {"params": params}, method=lambda m: m.decoder(prefix, None, segment_ids=seg)
        )

    return _prefix_logits_fn(full_logits, batch_size, max_decode_len)


# ------------------------------------------------------------------- entry points


@functools.partial(jax.jit, static_argnames=("config", "max_decode_len", "eos_id", "use_cache"))
def translate_greedy(
    config: ModelConfig,
    params: Any,
    inputs: Array,
    *,
    max_decode_len: int | None = None,
    eos_id: int = EOS_ID,
    use_cache: bool = True,
) -> Array:
    """Greedy translation of inputs [B, S] (0-padded) -> tokens [B, T].

    T = decode_length(S, max_decode_len, config): S + 50, capped by max_decode_len.
    use_cache=False recomputes the whole prefix each step (the reference, for benchmarks).
    """
    B, S = inputs.shape
    T = decode_length(S, max_decode_len, config)
    fn, cache = encoder_decoder_logits_fn(
        config, params, inputs, max_decode_len=T, use_cache=use_cache
    )
    return greedy_decode(
        fn, cache, batch_size=B, max_decode_len=T, bos_id=config.bos_id, eos_id=eos_id
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "beam_size",
        "alpha",
        "max_decode_len",
        "eos_id",
        "length_penalty",
        "use_cache",
    ),
)
def translate_beam(
    config: ModelConfig,
    params: Any,
    inputs: Array,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_decode_len: int | None = None,
    eos_id: int = EOS_ID,
    length_penalty: str = "gnmt",
    use_cache: bool = True,
) -> tuple[Array, Array]:
    """Beam-search translation of inputs [B, S] -> tokens [B, N, T], scores [B, N], best
    first. Defaults are the paper's (beam 4, alpha 0.6, T = S + 50); `length_penalty` is
    'gnmt' or 'fairseq' (see `length_penalty` and `beam_search`)."""
    B, S = inputs.shape
    T = decode_length(S, max_decode_len, config)
    fn, cache = encoder_decoder_logits_fn(
        config, params, inputs, max_decode_len=T, num_beams=beam_size, use_cache=use_cache
    )
    return beam_search(
        fn,
        cache,
        batch_size=B,
        beam_size=beam_size,
        max_decode_len=T,
        bos_id=config.bos_id,
        eos_id=eos_id,
        alpha=alpha,
        length_penalty_kind=length_penalty,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "config",
        "max_decode_len",
        "batch_size",
        "top_k",
        "top_p",
        "eos_id",
        "use_cache",
    ),
)
def sample(
    config: ModelConfig,
    params: Any,
    rng: Array,
    *,
    max_decode_len: int | None = None,
    prompt: Array | None = None,
    inputs: Array | None = None,
    batch_size: int | None = None,
    temperature: float | Array = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int = EOS_ID,
    use_cache: bool = True,
) -> Array:
    """Sample tokens [B, T] from a language model (inputs=None: DecoderOnly) or a
    translation model (inputs [B, S]: EncoderDecoder).

    prompt [B, P] (0-padded on the right) is forced first and is part of the output; B comes
    from inputs, prompt or batch_size. T = max_decode_len (required for a language model;
    for translation it defaults to S + 50). temperature is traced (0: greedy); top_k and
    top_p are static. The same rng gives the same samples.
    """
    if inputs is not None:
        B, S = inputs.shape
        T = decode_length(S, max_decode_len, config)
        fn, cache = encoder_decoder_logits_fn(
            config, params, inputs, max_decode_len=T, use_cache=use_cache
        )
    else:
        B = prompt.shape[0] if prompt is not None else batch_size
        if B is None:
            raise ValueError("give prompt [B, P] or batch_size")
        T = decode_length(None, max_decode_len, config)
        fn, cache = decoder_only_logits_fn(config, params, B, max_decode_len=T, use_cache=use_cache)
    return sample_decode(
        fn,
        cache,
        rng,
        batch_size=B,
        max_decode_len=T,
        bos_id=config.bos_id,
        eos_id=eos_id,
        prompt=prompt,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
