"""Autoregressive decoding: greedy search, beam search and sampling over a KV cache.

Shape letters: B batch, S source length, P prompt length, T decode length, V vocabulary,
N beams.

Everything is written against one abstraction, the *logits function*

    tokens_to_logits(tokens [B, 1], cache) -> (logits [B, V] float32, new cache)

which takes the previous token of every row and returns the scores of the next one.
`encoder_decoder_logits_fn` and `decoder_only_logits_fn` build it, with its initial cache,
for the two model families. With `use_cache=False` they build the no-cache reference
instead: its "cache" is the token prefix, which it runs through the full (non-decode) model
at every step. Benchmarks compare the two for speed and tests check that they agree.

The searches (`greedy_decode`, `beam_search`, `sample_decode`) see only the logits
function; each is one `lax.while_loop` with static shapes that stops as soon as every row
is finished. `translate_greedy`, `translate_beam` and `sample` are the jitted entry points:
a ModelConfig, the 'params' collection and token arrays in, tokens out.

Conventions: outputs never contain BOS. A sequence ends with its EOS and holds padding (0)
after it. Padding is never generated: its log-probability is set to -inf.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from tx_jax.model.config import ModelConfig
from tx_jax.model.transformer import DecoderOnly, EncoderDecoder

Array = jax.Array
Cache = Any
LogitsFn = Callable[[Array, Cache], tuple[Array, Cache]]

PAD_ID = 0
EOS_ID = 3
EXTRA_DECODE_LEN = 50  # section 6.1: maximum output length = input length + 50
LENGTH_PENALTIES = ("gnmt", "fairseq")
# Cross-attention keys/values are the same for every beam of an example: never gathered.
_NOT_GATHERED = frozenset({"cross_key", "cross_value", "cross_filled"})


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


# ------------------------------------------------------------- greedy and sampling


def filter_logits(logits: Array, top_k: int = 0, top_p: float = 1.0) -> Array:
    """[B, V] -> [B, V] with the tokens outside the top-k and the nucleus set to -inf.

    top_k: keep the k highest (0: off). top_p: keep the smallest set of highest tokens whose
    probability reaches top_p (Holtzman et al. 2019; 1.0: off). The best token always stays.
    """
    if top_k:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ranked = -jnp.sort(-logits, axis=-1)  # descending
        probs = jax.nn.softmax(ranked, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(mass_before < top_p, ranked, jnp.inf), -1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def _next_token(
    logits: Array, key: Array, temperature: float | Array, top_k: int, top_p: float
) -> Array:
    """[B, V] -> [B]: argmax at temperature 0, else a sample of softmax(filtered logits / t)."""
    greedy = jnp.argmax(logits, axis=-1)
    if isinstance(temperature, int | float) and temperature == 0:
        return greedy
    t = jnp.asarray(temperature, jnp.float32)
    scaled = filter_logits(logits / jnp.where(t > 0, t, 1.0), top_k, top_p)
    sampled = jax.random.categorical(key, scaled, axis=-1)
    return jnp.where(t > 0, sampled, greedy)


def sample_decode(
    tokens_to_logits: LogitsFn,
    cache: Cache,
    rng: Array,
    *,
    batch_size: int,
    max_decode_len: int,
    bos_id: int,
    eos_id: int = EOS_ID,
    prompt: Array | None = None,
    temperature: float | Array = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Array:
    """Ancestral sampling (greedy at temperature 0) -> tokens [B, T].

    prompt [B, P]: right-padded with 0; row b's first (prompt[b] != 0).sum() tokens are
    forced (they appear in the output) before sampling starts. Step i draws with the key
    fold_in(rng, i). A row ends at its first non-forced EOS; padding follows.
    """
    B, T = batch_size, max_decode_len
    if prompt is None:
        prompt = jnp.zeros((B, 0), jnp.int32)
    prompt_len = (prompt != PAD_ID).sum(axis=1)  # [B]
    forced_tokens = jnp.pad(prompt, ((0, 0), (0, max(T - prompt.shape[1], 0))))[:, :T]

    def body(state):
        i, out, done, cache = state
        prev = jnp.where(i == 0, bos_id, out[:, jnp.maximum(i - 1, 0)])  # [B]
        logits, cache = tokens_to_logits(prev[:, None], cache)
        logits = logits.astype(jnp.float32).at[:, PAD_ID].set(-jnp.inf)
        token = _next_token(logits, jax.random.fold_in(rng, i), temperature, top_k, top_p)
        forced = i < prompt_len
        token = jnp.where(forced, forced_tokens[:, i], token)
        token = jnp.where(done, PAD_ID, token).astype(jnp.int32)
        done = done | (~forced & (token == eos_id))
        return i + 1, out.at[:, i].set(token), done, cache

    def cond(state):
        i, _, done, _ = state
        return (i < T) & ~jnp.all(done)

    init = (jnp.array(0, jnp.int32), jnp.zeros((B, T), jnp.int32), jnp.zeros(B, bool), cache)
    return lax.while_loop(cond, body, init)[1]


def greedy_decode(
    tokens_to_logits: LogitsFn,
    cache: Cache,
    *,
    batch_size: int,
    max_decode_len: int,
    bos_id: int,
    eos_id: int = EOS_ID,
    prompt: Array | None = None,
) -> Array:
    """Greedy search (argmax every step) -> tokens [B, T]; see `sample_decode`."""
    return sample_decode(
        tokens_to_logits,
        cache,
        jax.random.key(0),
        batch_size=batch_size,
        max_decode_len=max_decode_len,
        bos_id=bos_id,
        eos_id=eos_id,
        prompt=prompt,
        temperature=0.0,
    )


# -------------------------------------------------------------------- beam search


def length_penalty(length: int | Array, alpha: float, kind: str = "gnmt") -> Array:
    """Divisor of a hypothesis' log-probability; `length` counts its tokens, EOS included.

    gnmt: ((5 + length) / 6)^alpha (GNMT, Wu et al. 2016, section 7; the paper: alpha 0.6).
    fairseq: length^alpha.
    """
    length = jnp.asarray(length, jnp.float32)
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if kind == "fairseq":
        return length**alpha
    raise ValueError(f"length_penalty={kind!r}; expected one of {LENGTH_PENALTIES}")


class _Beams(NamedTuple):
    i: Array  # the step: position being decoded
    live_seqs: Array  # [B, N, T] unfinished hypotheses
    live_logp: Array  # [B, N] their log-probabilities, descending; -inf: no hypothesis
    fin_seqs: Array  # [B, N, T] finished hypotheses (EOS, or cut at T)
    fin_scores: Array  # [B, N] their penalised scores, descending; -inf: empty slot
    cache: Cache  # rows b * N + n


def _take_beams(x: Array, index: Array) -> Array:
    """x [B, N, ...], index [B, K] -> [B, K, ...]."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def gather_cache(cache: Cache, beam_index: Array) -> Cache:
    """Reorder every [B * N, ...] cache entry by beam_index [B, N] (sources within each
    example). Scalars (cache_index, position) and cross-attention entries stay as they are."""
    B, N = beam_index.shape
    rows = (jnp.arange(B)[:, None] * N + beam_index).reshape(-1)

    def gather(path, x):
        name = getattr(path[-1], "key", None)
        if x.ndim == 0 or name in _NOT_GATHERED:
            return x
        return jnp.take(x, rows, axis=0)

    return jax.tree_util.tree_map_with_path(gather, cache)


def _beam_step(state: _Beams, tokens_to_logits: LogitsFn, bos_id, eos_id, penalty) -> _Beams:
    """Extend every live beam by every token; keep the best N live and N finished."""
    B, N, T = state.live_seqs.shape
    i = state.i
    prev = jnp.where(i == 0, bos_id, state.live_seqs[:, :, jnp.maximum(i - 1, 0)])
    logits, cache = tokens_to_logits(prev.reshape(B * N, 1), state.cache)
    V = logits.shape[-1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32)).at[:, PAD_ID].set(-jnp.inf)
    candidates = (state.live_logp[..., None] + logp.reshape(B, N, V)).reshape(B, N * V)
    # At most N of the best 2N candidates end in EOS, so at least N stay live.
    top_logp, top_index = lax.top_k(candidates, 2 * N)  # [B, 2N]
    source_beam, token = top_index // V, top_index % V
    seqs = _take_beams(state.live_seqs, source_beam)  # [B, 2N, T]
    seqs = lax.dynamic_update_slice(seqs, token[..., None].astype(jnp.int32), (0, 0, i))

    # Finished: ended with EOS, or reached the length limit (scored as they stand).
    ends = (token == eos_id) | (i == T - 1)
    new_scores = jnp.where(ends, top_logp / penalty(i + 1), -jnp.inf)
    fin_scores, k = lax.top_k(jnp.concatenate([state.fin_scores, new_scores], 1), N)
    fin_seqs = _take_beams(jnp.concatenate([state.fin_seqs, seqs], 1), k)

    live_logp, k = lax.top_k(jnp.where(token == eos_id, -jnp.inf, top_logp), N)
    cache = gather_cache(cache, jnp.take_along_axis(source_beam, k, axis=1))
    return _Beams(i + 1, _take_beams(seqs, k), live_logp, fin_seqs, fin_scores, cache)


def beam_search(
    tokens_to_logits: LogitsFn,
    cache: Cache,
    *,
    batch_size: int,
    beam_size: int,
    max_decode_len: int,
    bos_id: int,
    eos_id: int = EOS_ID,
    alpha: float = 0.6,
    length_penalty_kind: str = "gnmt",
) -> tuple[Array, Array]:
    """Beam search (section 6.1) -> tokens [B, N, T] and scores [B, N], best first.

    `tokens_to_logits` and `cache` work on B * N rows (row b * N + n = beam n of example b).
    A hypothesis' score is its log-probability / length_penalty(length, alpha, kind);
    finished hypotheses (EOS, or cut at T) are kept apart from the N live ones. The search
    stops once no live beam can beat the worst of N finished: with alpha >= 0 the penalty
    only grows with length and log-probabilities only fall, so a live beam's score is at
    most log p / penalty(T) (the bound of flax's WMT beam search).
    """
    if alpha < 0:
        raise ValueError(f"alpha={alpha} must be >= 0 (the early-stopping bound needs it)")
    length_penalty(1, alpha, length_penalty_kind)  # validate the kind
    B, N, T = batch_size, beam_size, max_decode_len
    penalty = functools.partial(length_penalty, alpha=alpha, kind=length_penalty_kind)
    best_possible = penalty(T)

    def cond(state: _Beams) -> Array:
        best_live = state.live_logp[:, 0] / best_possible
        worst_finished = state.fin_scores[:, -1]
        hopeless = (worst_finished > best_live) | (best_live == -jnp.inf)
        return (state.i < T) & ~jnp.all(hopeless)

    # All beams start as the same empty hypothesis: only beam 0 is live, or the first
    # step would return N copies of the best token.
    live_logp = jnp.tile(jnp.array([0.0] + [-jnp.inf] * (N - 1)), (B, 1))
    init = _Beams(
        i=jnp.array(0, jnp.int32),
        live_seqs=jnp.zeros((B, N, T), jnp.int32),
        live_logp=live_logp,
        fin_seqs=jnp.zeros((B, N, T), jnp.int32),
        fin_scores=jnp.full((B, N), -jnp.inf),
        cache=cache,
    )
    step = functools.partial(
        _beam_step, tokens_to_logits=tokens_to_logits, bos_id=bos_id, eos_id=eos_id, penalty=penalty
    )
    final = lax.while_loop(cond, step, init)
    return final.fin_seqs, final.fin_scores


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
