"""The searches of autoregressive decoding: greedy, beam search and sampling.

Shape letters: B batch, T decode length, V vocabulary, N beams.

Each search sees only a *logits function*

    tokens_to_logits(tokens [B, 1], cache) -> (logits [B, V] float32, new cache)

(decoding.py builds it for the two model families) and is one `lax.while_loop` with static
shapes that stops as soon as every row is finished. Outputs never contain BOS; a sequence
ends with its EOS and holds padding (0) after it; padding is never generated (its
log-probability is -inf).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
Cache = Any
LogitsFn = Callable[[Array, Cache], tuple[Array, Cache]]

PAD_ID = 0
EOS_ID = 3
LENGTH_PENALTIES = ("gnmt", "fairseq")
# Cross-attention keys/values are the same for every beam of an example: never gathered.
_NOT_GATHERED = frozenset({"cross_key", "cross_value", "cross_filled"})


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
