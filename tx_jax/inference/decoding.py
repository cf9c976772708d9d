"""Autoregressive decoding over a KV cache: logits functions and the jitted entry points.

Shape letters: B batch, S source length, P prompt length, T decode length, V vocabulary,
N beams. A *logits function* tokens_to_logits(tokens [B, 1], cache) -> (logits [B, V]
float32, new cache) scores the next token of every row; `encoder_decoder_logits_fn` and
`decoder_only_logits_fn` build it, with its initial cache, for the two model families
(use_cache=False: the no-cache reference, whose "cache" is the prefix run through the full
model every step). The searches (search.py) see only it; `translate_greedy`,
`translate_beam` and `sample` are the jitted entry points. Outputs never contain BOS and
hold padding (0) after their EOS; padding is never generated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from tx_jax.inference import cache as cache_lib
from tx_jax.inference.cache import Cache
from tx_jax.inference.search import EOS_ID, LogitsFn, beam_search, greedy_decode, sample_decode
from tx_jax.model.config import ModelConfig
from tx_jax.model.transformer import DecoderOnly, EncoderDecoder

Array = jax.Array
# Section 6.1: "maximum output length to input length + 50". A source's own length, not its
# padded one, so a sentence's translation does not depend on its batch (fairseq's max_len_a
# and max_len_b generalise it to a * length + b).
MAX_LEN_A = 1.0
MAX_LEN_B = 50


def decode_length(
    source_length: int | None,
    max_decode_len: int | None = None,
    config: ModelConfig | None = None,
    *,
    max_len_a: float = MAX_LEN_A,
    max_len_b: int = MAX_LEN_B,
) -> int:
    """T, the output arrays' length: a * source_length + b, capped by max_decode_len (alone
    for a language model: source_length None) and a learned position table."""
    lengths = [max_decode_len]
    if source_length is not None:
        lengths.append(_limit(source_length, max_len_a, max_len_b))
    if config is not None and config.positional == "learned":
        lengths.append(config.max_len)
    lengths = [n for n in lengths if n is not None]
    if not lengths:
        raise ValueError("a language model needs max_decode_len")
    return max(min(lengths), 1)


def _limit(length, a: float, b: int):
    """a * length + b, rounded down (fairseq's rule); a is a Python float, length int or array."""
    if isinstance(length, int):
        return int(a * length + b)
    return jnp.floor(a * length.astype(jnp.float32) + b).astype(jnp.int32)


def output_limits(
    inputs: Array, length: int, *, max_len_a: float = MAX_LEN_A, max_len_b: int = MAX_LEN_B
) -> Array:
    """[B, S] 0-padded sources -> [B] output limits: a * (the row's tokens, EOS and tags
    included) + b, capped by T = `length`; 0 for an all-padding row (nothing to decode)."""
    n = (inputs != 0).sum(axis=1)
    return jnp.where(n > 0, jnp.minimum(_limit(n, max_len_a, max_len_b), length), 0)


# ------------------------------------------------------------------ logits functions


def _cached_logits_fn(
    model: nn.Module,
    params: Any,
    batch: int,
    length: int,
    *args: Array,
    method: str | None = None,
    beams: int = 1,
) -> tuple[LogitsFn, Cache]:
    """A decode-mode `model.apply(variables, *args, tokens)` as a logits function; a first
    call on a [batch, length] dummy creates the cache. The per-row `args` travel in the cache,
    not the closure, so that a search may move rows between batches (compaction); beams > 1
    share the cache across beams (cache.share_beams, config.decode_beams)."""

    def run(model, variables, inputs, tokens):
        return model.apply(variables, *inputs, tokens, method=method, mutable=["cache"])

    _, init = run(model, {"params": params}, args, jnp.zeros((batch, length), jnp.int32))
    cache = init["cache"]
    if beams > 1:
        cache = cache_lib.share_beams(cache, batch // beams, beams, length)
        model = type(model)(model.config.replace(decode_beams=beams))

    def tokens_to_logits(tokens: Array, cache: Cache) -> tuple[Array, Cache]:
        model_cache, inputs = cache_lib.model_parts(cache)
        logits, updated = run(model, {"params": params, "cache": model_cache}, inputs, tokens)
        return logits[:, -1], cache_lib.of_model(updated["cache"], inputs)

    return tokens_to_logits, cache_lib.of_model(cache, args)


def _prefix_logits_fn(
    full_logits: Callable[[Array], Array], batch: int, length: int
) -> tuple[LogitsFn, Cache]:
    """The no-cache reference: append the token to a [batch, length] prefix and run the full
    model, full_logits(decoder inputs [B, T]) -> [B, T, V], on it every step."""

    def tokens_to_logits(tokens: Array, cache: Cache) -> tuple[Array, Cache]:
        prefix, i, cache = cache_lib.extend_prefix(cache, tokens)
        # Causal attention: the zeros after position i never reach position i's logits.
        logits = lax.dynamic_index_in_dim(full_logits(prefix), i, axis=1, keepdims=False)
        return logits, cache

    return tokens_to_logits, cache_lib.prefix(batch, length)


def encoder_decoder_logits_fn(
    config: ModelConfig,
    params: Any,
    inputs: Array,
    *,
    max_decode_len: int,
    num_beams: int = 1,
    use_cache: bool = True,
) -> tuple[LogitsFn, Cache]:
    """Logits function and initial cache (max_decode_len positions) for translating `inputs`
    [B, S] with EncoderDecoder, the source encoded once; row b * N + n is beam n of example b.
    `params` is the 'params' collection (boxed or not)."""
    params = nn.meta.unbox(params)
    model = EncoderDecoder(config.replace(decode=False))
    encoded = model.apply({"params": params}, inputs, method="encode")  # [B, S, M]
    encoded = jnp.repeat(encoded, num_beams, axis=0)  # [B * N, S, M]
    inputs = jnp.repeat(inputs, num_beams, axis=0)
    batch = inputs.shape[0]
    if use_cache:
        decoder = EncoderDecoder(config.replace(decode=True))
        return _cached_logits_fn(
            decoder,
            params,
            batch,
            max_decode_len,
            encoded,
            inputs,
            method="decode",
            beams=num_beams,
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


_STATIC = ("config", "eos_id", "use_cache", "max_decode_len", "max_len_a", "max_len_b", "compact")
# The searches first run with a cache of S + FIRST_STAGE positions (S: the padded source
# length) and grow it to T only if a row is still unfinished there: attention's cost per step
# follows the cache's length, and translations are rarely much longer than their sources.
FIRST_STAGE = 10
# On CPU a finished row costs as much as a live one: once at most B / COMPACT rows of a batch
# are unfinished, they go on alone (search.py, `compact`). Accelerators run small batches at
# nearly the cost of large ones, so they keep the whole batch.
COMPACT = 4


def _compaction(compact: int | None, use_cache: bool, config: ModelConfig) -> int:
    if not use_cache:  # the no-cache reference closes over its batch's source
        return 1
    if compact is None:  # by the platform the model config was resolved for
        return COMPACT if config.platform == "cpu" else 1
    if compact < 1:
        raise ValueError(f"compact={compact}: expected >= 1 (1: off)")
    return compact


def _translation_setup(
    config: ModelConfig,
    params: Any,
    inputs: Array,
    max_decode_len: int | None,
    max_len_a: float,
    max_len_b: int,
    num_beams: int,
    use_cache: bool,
):
    """-> (logits function, cache of the first stage's length T1, the search's batch_size,
    max_decode_len T, bos_id, each row's limit [B] and grow_at T1 or None)."""
    T = decode_length(
        inputs.shape[1], max_decode_len, config, max_len_a=max_len_a, max_len_b=max_len_b
    )
    limits = output_limits(inputs, T, max_len_a=max_len_a, max_len_b=max_len_b)
    first = min(T, inputs.shape[1] + FIRST_STAGE)
    fn, cache = encoder_decoder_logits_fn(
        config, params, inputs, max_decode_len=first, num_beams=num_beams, use_cache=use_cache
    )
    search = dict(batch_size=inputs.shape[0], max_decode_len=T, bos_id=config.bos_id)
    return fn, cache, dict(search, limits=limits, grow_at=first if first < T else None)


@functools.partial(jax.jit, static_argnames=_STATIC)
def translate_greedy(
    config: ModelConfig,
    params: Any,
    inputs: Array,
    *,
    max_decode_len: int | None = None,
    eos_id: int = EOS_ID,
    prompt: Array | None = None,
    use_cache: bool = True,
    max_len_a: float = MAX_LEN_A,
    max_len_b: int = MAX_LEN_B,
    compact: int | None = None,
) -> Array:
    """Greedy translation of inputs [B, S] (0-padded) -> tokens [B, T]. A row's output limit
    is a * n + b (n: its source tokens, EOS included), capped by max_decode_len; an all-padding
    row decodes nothing. compact=c: once at most B // c rows are unfinished they go on in batches of
    B // c (None: COMPACT on CPU, else off; 1: off). prompt [B, P] (0-padded on the right):
    forced first output tokens, counted by the limit."""
    fn, cache, kw = _translation_setup(
        config, params, inputs, max_decode_len, max_len_a, max_len_b, 1, use_cache
    )
    compact = _compaction(compact, use_cache, config)
    return greedy_decode(fn, cache, eos_id=eos_id, prompt=prompt, compact=compact, **kw)


@functools.partial(
    jax.jit, static_argnames=(*_STATIC, "beam_size", "length_penalty", "length_penalty_kind")
)
def translate_beam(
    config: ModelConfig,
    params: Any,
    inputs: Array,
    *,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_decode_len: int | None = None,
    eos_id: int = EOS_ID,
    length_penalty_kind: str = "gnmt",
    prompt: Array | None = None,
    use_cache: bool = True,
    max_len_a: float = MAX_LEN_A,
    max_len_b: int = MAX_LEN_B,
    compact: int | None = None,
) -> tuple[Array, Array]:
    """Beam-search translation of inputs [B, S] -> tokens [B, N, T], scores [B, N], best
    first; the paper's defaults, limits, prompt and compact as translate_greedy's.
    `length_penalty_kind`: one of search.LENGTH_PENALTIES (search.beam_search)."""
    fn, cache, kw = _translation_setup(
        config, params, inputs, max_decode_len, max_len_a, max_len_b, beam_size, use_cache
    )
    return beam_search(
        fn,
        cache,
        beam_size=beam_size,
        eos_id=eos_id,
        length_penalty=length_penalty,
        length_penalty_kind=length_penalty_kind,
        prompt=prompt,
        compact=_compaction(compact, use_cache, config),
        **kw,
    )


@functools.partial(jax.jit, static_argnames=(*_STATIC, "batch_size", "top_k", "top_p"))
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
    max_len_a: float = MAX_LEN_A,
    max_len_b: int = MAX_LEN_B,
    compact: int = 1,
) -> Array:
    """Sample tokens [B, T] from a language model (inputs=None) or a translation model
    (inputs [B, S]). prompt [B, P] (0-padded on the right) is forced first and is part of the
    output; B comes from inputs, prompt or batch_size. T = max_decode_len (required for a
    language model; translation's limits as translate_greedy's). temperature is traced (0:
    greedy). compact is off by default: a row's random draws follow its place in the batch."""
    if inputs is not None:
        fn, cache, kw = _translation_setup(
            config, params, inputs, max_decode_len, max_len_a, max_len_b, 1, use_cache
        )
    else:
        B = prompt.shape[0] if prompt is not None else batch_size
        if B is None:
            raise ValueError("give prompt [B, P] or batch_size")
        T = decode_length(None, max_decode_len, config)
        fn, cache = decoder_only_logits_fn(config, params, B, max_decode_len=T, use_cache=use_cache)
        kw = dict(batch_size=B, max_decode_len=T, bos_id=config.bos_id)
    return sample_decode(
        fn,
        cache,
        rng,
        eos_id=eos_id,
        prompt=prompt,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        compact=_compaction(compact, use_cache, config),
        **kw,
    )
