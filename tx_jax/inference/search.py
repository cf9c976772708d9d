"""The searches of autoregressive decoding: greedy, beam search and sampling.

Shape letters: B batch, T decode length, V vocabulary, N beams. Each search sees only a
logits function (decoding.py) and is one `lax.while_loop` with static shapes over a named
state (`_Sampling`, `_Beams`) that stops once every row is finished; the cache is opaque
(cache.py). `grow_at` = T1 runs a first stage with a cache of T1 positions and grows it to T
only while a row is unfinished: attention's cost per step follows the cache's length.
`compact` = c > 1 moves the rows still unfinished once at most B / c are into batches of
B / c that run on alone (`_staged`). `limits` [B] gives each row its own output limit (<= T;
0: finished before the first step), so a row's output never depends on its batch's T.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tx_jax.inference import cache as cache_lib
from tx_jax.inference.cache import Cache

Array = jax.Array
LogitsFn = Callable[[Array, Cache], tuple[Array, Cache]]

PAD_ID = 0
EOS_ID = 3
LENGTH_PENALTIES = ("gnmt", "fairseq", "hf", "hf_early", "hf_never")
# Transformers' beam search (generate(num_beams=N), the same length_penalty) with its
# early_stopping=False (generate's default), True and "never": `beam_search`.
HF_EARLY_STOPPING = {"hf": False, "hf_early": True, "hf_never": "never"}


# ------------------------------------------------------------- greedy and sampling


def filter_logits(logits: Array, top_k: int = 0, top_p: float = 1.0) -> Array:
    """[B, V] -> [B, V] with the tokens outside the top_k highest (0: off) and the nucleus
    of mass top_p (Holtzman et al. 2019; 1.0: off) set to -inf; the best token always stays."""
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


class _Forced(NamedTuple):
    """Each row's forced first tokens (a prompt): they appear in the output, and a forced EOS
    does not end the row."""

    length: Array  # [B] how many: the prompt's non-padding tokens
    tokens: Array  # [B, T] the prompt, padded or cut to T


def _forced(prompt: Array | None, batch: int, length: int) -> _Forced:
    """prompt [B, P] (right-padded with 0; None: nothing forced) -> _Forced."""
    if prompt is None:
        prompt = jnp.zeros((batch, 0), jnp.int32)
    n = (prompt != PAD_ID).sum(axis=1)
    return _Forced(n, jnp.pad(prompt, ((0, 0), (0, max(length - prompt.shape[1], 0))))[:, :length])


class _Sampling(NamedTuple):
    """The loop state of greedy search and sampling (every entry but the step is per row)."""

    i: Array  # the step: position being decoded
    tokens: Array  # [B, T] the output so far
    done: Array  # [B] finished rows (EOS, or the limit)
    cache: Cache  # rows b: cache.py's
    limits: Array  # [B] each row's output limit
    forced: _Forced  # each row's forced prefix


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
    limits: Array | None = None,
    grow_at: int | None = None,
    compact: int = 1,
) -> Array:
    """Ancestral sampling (greedy at temperature 0) -> tokens [B, T]. prompt [B, P]
    (right-padded with 0): forced first tokens, in the output. Step i draws with the key
    fold_in(rng, i). A row ends at its first non-forced EOS or at its limit."""
    B, T = batch_size, max_decode_len

    def step(s: _Sampling) -> _Sampling:
        prev = jnp.where(s.i == 0, bos_id, s.tokens[:, jnp.maximum(s.i - 1, 0)])  # [B]
        logits, cache = tokens_to_logits(prev[:, None], s.cache)
        logits = logits.astype(jnp.float32).at[:, PAD_ID].set(-jnp.inf)
        token = _next_token(logits, jax.random.fold_in(rng, s.i), temperature, top_k, top_p)
        forced = s.i < s.forced.length
        token = jnp.where(forced, s.forced.tokens[:, s.i], token)
        token = jnp.where(s.done, PAD_ID, token).astype(jnp.int32)
        done = s.done | (~forced & (token == eos_id)) | (s.i + 1 >= s.limits)
        return s._replace(i=s.i + 1, tokens=s.tokens.at[:, s.i].set(token), done=done, cache=cache)

    limits = _row_limits(limits, B, T)
    init = _Sampling(
        i=jnp.array(0, jnp.int32),
        tokens=jnp.zeros((B, T), jnp.int32),
        done=limits <= 0,
        cache=cache,
        limits=limits,
        forced=_forced(prompt, B, T),
    )
    going = lambda s: ~s.done  # noqa: E731
    outputs = lambda s: s.tokens  # noqa: E731
    return _staged(init, step, going, outputs, T=T, grow_at=grow_at, compact=compact, beams=1)


def _staged(init, step, going, outputs, *, T: int, grow_at: int | None, compact: int, beams: int):
    """lax.while_loop over `step` from the state `init` (the step `i`, the `cache`, per-row
    [B, ...] entries) until step T or until no row is going (going(state) -> [B]), in the
    stages of `grow_at` and `compact` (module docstring) -> outputs(state), every row's. A
    row's result depends on it alone, not on its stage or batch-mates."""
    # The barriers keep XLA from sinking loop-invariant entries' producers (the transposes
    # that lay out the cross-attention cache) into a loop body, to run every step.
    init = lax.optimization_barrier(init)
    first = T if grow_at is None else min(grow_at, T)
    B = going(init).shape[0]
    small = max(1, B // compact) if compact > 1 else B

    def cond(stop: int, most: int):
        def go(state):
            return (state.i < stop) & (jnp.sum(going(state)) > most)

        return go

    def finish(state):  # the steps from the state's to T, growing its cache first if needed
        if first < T:
            state = state._replace(cache=cache_lib.grow(state.cache, old=first, new=T))
        return lax.while_loop(cond(T, 0), step, lax.optimization_barrier(state))

    if small >= B:  # no compaction: the two stages at the full batch
        state = lax.while_loop(cond(first, 0), step, init)
        return outputs(finish(state) if first < T else state)

    state = lax.while_loop(cond(first, small), step, init)
    rows = going(state)
    order = jnp.argsort(~rows, stable=True)  # rows still going first
    groups = (jnp.sum(rows) + small - 1) // small

    def group(carry):
        k, out = carry
        # The last group may overlap the one before (clamped start): a row decoded twice
        # gives the same result twice.
        idx = lax.dynamic_slice_in_dim(order, jnp.minimum(k * small, B - small), small)
        done = outputs(finish(_take_rows(state, idx, B, beams)))
        keep = rows[idx]

        def put(full, part):
            mask = keep.reshape(-1, *([1] * (part.ndim - 1)))
            return full.at[idx].set(jnp.where(mask, part, full[idx]))

        return k + 1, jax.tree.map(put, out, done)

    return lax.while_loop(lambda c: c[0] < groups, group, (jnp.array(0), outputs(state)))[1]


def _take_rows(state: Any, idx: Array, batch: int, beams: int) -> Any:
    """The rows idx [b] of a search state: the step is every row's, the cache's rows are
    cache.py's to take, every other entry is [batch, ...]."""

    def take(x: Array) -> Array:
        return jnp.take(x, idx, axis=0)

    rows = {
        name: jax.tree.map(take, x)
        for name, x in state._asdict().items()
        if name not in ("i", "cache")
    }
    return state._replace(**rows, cache=cache_lib.take_rows(state.cache, idx, batch, beams))


def _row_limits(limits: Array | None, batch: int, length: int) -> Array:
    """limits [B] (None: T for every row) capped at T, as int32."""
    if limits is None:
        return jnp.full((batch,), length, jnp.int32)
    return jnp.minimum(jnp.asarray(limits, jnp.int32), length)


def greedy_decode(tokens_to_logits: LogitsFn, cache: Cache, **kwargs: Any) -> Array:
    """Greedy search (argmax every step) -> tokens [B, T]; `sample_decode`'s keyword arguments."""
    return sample_decode(tokens_to_logits, cache, jax.random.key(0), temperature=0.0, **kwargs)


# -------------------------------------------------------------------- beam search


def length_divisor(length: int | Array, length_penalty: float, kind: str = "gnmt") -> Array:
    """Divisor of a hypothesis' log-probability (`length`: its tokens, EOS included); gnmt:
    ((5 + length) / 6)^a (Wu et al. 2016), fairseq and Transformers' rules: length^a."""
    length = jnp.asarray(length, jnp.float32)
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** length_penalty
    if kind == "fairseq" or kind in HF_EARLY_STOPPING:
        return length**length_penalty
    raise ValueError(f"length_penalty_kind={kind!r}; expected one of {LENGTH_PENALTIES}")


class _Beams(NamedTuple):
    """Beam search's loop state (every entry but the step is per row)."""

    i: Array  # the step: position being decoded
    live_seqs: Array  # [B, N, T] unfinished hypotheses
    live_logp: Array  # [B, N] their log-probabilities, descending; -inf: no hypothesis
    fin_seqs: Array  # [B, N, T] finished hypotheses (EOS, or cut at the limit)
    fin_scores: Array  # [B, N] their penalised scores, descending; -inf: empty slot
    cache: Cache  # rows b * N + n: cache.py's
    limits: Array  # [B] each row's output limit
    best_possible: Array  # [B] penalty(longest scored length): a live beam scores <= logp / it
    forced: _Forced | None  # each row's forced prefix (None: no prompt)
    stopped: Array | None = None  # [B] Transformers' rules: rows whose finished are final


def _forcing(
    state: _Beams, logp: Array, count_forced: bool = False
) -> tuple[Array, Array | None, Array]:
    """logp [B, N, V] -> (logp with a forced row's forced token at 0 and every other -inf,
    forced [B] or None, the length the penalty counts after this step: tokens after the
    forced prefix, or all with count_forced, as Transformers counts forced_bos_token_id)."""
    if state.forced is None:
        return logp, None, state.i + 1
    forced = state.i < state.forced.length  # [B]
    token = state.forced.tokens[:, state.i]  # [B]
    only = jnp.where(jnp.arange(logp.shape[-1]) == token[:, None], 0.0, -jnp.inf)  # [B, V]
    logp = jnp.where(forced[:, None, None], only[:, None, :], logp)
    if count_forced:
        return logp, forced, state.i + 1
    length = jnp.maximum(state.i + 1 - state.forced.length, 1)[:, None]  # [B, 1]
    return logp, forced, length


def _beam_step(
    state: _Beams, tokens_to_logits: LogitsFn, bos_id, eos_id, penalty, hf=None, length_penalty=0.0
) -> _Beams:
    """Extend every live beam by every token; keep the best N live and N finished. hf: None,
    or Transformers' early_stopping (False, True or "never") for its rules."""
    B, N, T = state.live_seqs.shape
    i = state.i
    prev = jnp.where(i == 0, bos_id, state.live_seqs[:, :, jnp.maximum(i - 1, 0)])
    logits, cache = tokens_to_logits(prev.reshape(B * N, 1), state.cache)
    V = logits.shape[-1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32)).at[:, PAD_ID].set(-jnp.inf)
    logp, forced, length = _forcing(state, logp.reshape(B, N, V), count_forced=hf is not None)
    candidates = (state.live_logp[..., None] + logp).reshape(B, N * V)
    # At most N of the best 2N candidates end in EOS, so at least N stay live.
    top_logp, top_index = lax.top_k(candidates, 2 * N)  # [B, 2N]
    source_beam, token = top_index // V, top_index % V
    seqs = cache_lib.take_beams(state.live_seqs, source_beam)  # [B, 2N, T]
    seqs = lax.dynamic_update_slice(seqs, token[..., None].astype(jnp.int32), (0, 0, i))

    # Finished: ended with EOS (not a forced one), or reached the row's length limit (scored
    # as they stand).
    eos = token == eos_id
    if forced is not None:
        eos = eos & ~forced[:, None]
    last = (i + 1 >= state.limits)[:, None]  # [B, 1]
    ended = eos | last
    if hf is not None:
        # Transformers finishes only the best N candidates (the other N are spares that keep
        # N beams live) and adds nothing to a row its stopping rule has closed.
        ended = ended & (jnp.arange(2 * N) < N) & ~state.stopped[:, None]
    new_scores = jnp.where(ended, top_logp / penalty(length), -jnp.inf)
    fin_scores, k = lax.top_k(jnp.concatenate([state.fin_scores, new_scores], 1), N)
    fin_seqs = cache_lib.take_beams(jnp.concatenate([state.fin_seqs, seqs], 1), k)

    live_logp, k = lax.top_k(jnp.where(eos, -jnp.inf, top_logp), N)
    live_logp = jnp.where(last, -jnp.inf, live_logp)  # nothing may grow past the limit
    cache = cache_lib.gather_beams(cache, jnp.take_along_axis(source_beam, k, axis=1))
    state = state._replace(
        i=i + 1,
        live_seqs=cache_lib.take_beams(seqs, k),
        live_logp=live_logp,
        fin_seqs=fin_seqs,
        fin_scores=fin_scores,
        cache=cache,
    )
    return state if hf is None else _hf_stop(state, penalty, hf, length_penalty)


def _hf_stop(state: _Beams, penalty, early_stopping, length_penalty: float) -> _Beams:
    """Transformers' stopping rule after a step (`_check_early_stop_heuristic`): a row closes
    for good once its N finished slots are full and its best live log p / penalty(L) is no
    more than the worst of them; L is the length so far (a heuristic: why 'hf' can differ
    from 'fairseq'), or with "never" and length_penalty > 0 the row's limit. early_stopping
    True also closes a row as soon as its N slots are full."""
    bound = early_stopping == "never" and length_penalty > 0
    divisor = state.best_possible if bound else penalty(state.i)
    best_live = state.live_logp[:, 0] / divisor
    worst_finished = state.fin_scores[:, -1]
    stopped = state.stopped | ~(best_live > worst_finished)
    if early_stopping is True:
        stopped = stopped | (worst_finished > -jnp.inf)
    return state._replace(stopped=stopped)


def beam_search(
    tokens_to_logits: LogitsFn,
    cache: Cache,
    *,
    batch_size: int,
    beam_size: int,
    max_decode_len: int,
    bos_id: int,
    eos_id: int = EOS_ID,
    length_penalty: float = 0.6,
    length_penalty_kind: str = "gnmt",
    prompt: Array | None = None,
    limits: Array | None = None,
    grow_at: int | None = None,
    compact: int = 1,
) -> tuple[Array, Array]:
    """Beam search (section 6.1) -> tokens [B, N, T] and scores [B, N], best first.

    `tokens_to_logits` and `cache` work on B * N rows (row b * N + n = beam n of example b).
    A hypothesis' score is its log-probability / length_divisor(length, ...); finished ones
    (EOS, or cut at the row's limit) are kept apart from the N live ones. A row stops once no
    live beam can beat its worst finished one: with length_penalty >= 0 a live beam scores
    at most log p / penalty(limit) (flax WMT's bound, with the row's own limit).

    prompt [B, P], as sample_decode's, is forced in every beam; it adds no log-probability
    and the length the penalty counts starts after it (as likelihood.py scores a forced
    prefix), while the row's limit counts it.

    length_penalty_kind 'hf', 'hf_early', 'hf_never': Transformers' beam search token for
    token (generate(num_beams=N, early_stopping=False, True, "never")): the divisor
    length^length_penalty in float64, only EOS among the best N of a step's 2N candidates
    finishes a hypothesis, a row closes by `_hf_stop`, a forced token counts in the length,
    and any length_penalty is allowed.
    """
    length_divisor(1, length_penalty, length_penalty_kind)  # validate the kind
    hf = HF_EARLY_STOPPING.get(length_penalty_kind)
    if length_penalty < 0 and hf is None:
        raise ValueError(
            f"length_penalty={length_penalty} must be >= 0 (the early-stopping bound needs it)"
        )
    B, N, T = batch_size, beam_size, max_decode_len
    penalty = _penalty_of_length(length_penalty, length_penalty_kind, T)
    limits = _row_limits(limits, B, T)
    forced = None if prompt is None else _forced(prompt, B, T)

    def going(state: _Beams) -> Array:
        if hf is not None:
            return ~state.stopped
        best_live = state.live_logp[:, 0] / state.best_possible
        worst_finished = state.fin_scores[:, -1]
        return ~((worst_finished > best_live) | (best_live == -jnp.inf))

    init = _initial_beams(cache, limits, forced, penalty, shape=(B, N, T), hf=hf)

    def step(state: _Beams) -> _Beams:
        return _beam_step(state, tokens_to_logits, bos_id, eos_id, penalty, hf, length_penalty)

    outputs = lambda s: (s.fin_seqs, s.fin_scores)  # noqa: E731
    return _staged(init, step, going, outputs, T=T, grow_at=grow_at, compact=compact, beams=N)


def _penalty_of_length(length_penalty: float, kind: str, length: int) -> Callable[[Array], Array]:
    """lengths [...] (each <= `length`) -> length_divisor(lengths, length_penalty, kind)."""
    if kind not in HF_EARLY_STOPPING:
        return functools.partial(length_divisor, length_penalty=length_penalty, kind=kind)
    # Transformers divides by the Python float length ** length_penalty (float64), cast to
    # float32; XLA's float32 power can differ in the last bit, which can swap near-ties.
    table = np.maximum(np.arange(length + 1), 1) ** float(length_penalty)
    return jnp.asarray(table.astype(np.float32)).__getitem__


def _initial_beams(
    cache: Cache,
    limits: Array,
    forced: _Forced | None,
    penalty: Callable[[Array], Array],
    *,
    shape: tuple[int, int, int],
    hf: bool | str | None,
) -> _Beams:
    """Beam search's state before its first step: one live empty hypothesis per row (none
    where limits [B] is 0), none finished."""
    B, N, T = shape
    # The most tokens a score counts ('hf' counts a forced prefix).
    longest = limits if forced is None or hf is not None else limits - forced.length
    # All beams start as the same empty hypothesis: only beam 0 is live, or the first
    # step would return N copies of the best token. Rows with limit 0 have none.
    live_logp = jnp.tile(jnp.array([0.0] + [-jnp.inf] * (N - 1)), (B, 1))
    live_logp = jnp.where((limits > 0)[:, None], live_logp, -jnp.inf)
    return _Beams(
        i=jnp.array(0, jnp.int32),
        live_seqs=jnp.zeros((B, N, T), jnp.int32),
        live_logp=live_logp,
        fin_seqs=jnp.zeros((B, N, T), jnp.int32),
        fin_scores=jnp.full((B, N), -jnp.inf),
        cache=cache,
        limits=limits,
        best_possible=penalty(jnp.maximum(longest, 1)),
        forced=forced,
        stopped=None if hf is None else limits <= 0,
    )
