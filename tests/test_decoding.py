"""Decoding: cached logits equal the full forward pass; greedy, beam search and sampling."""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.inference import cache as cache_lib
from tx_jax.inference import decoding, search
from tx_jax.model.config import variant
from tx_jax.model.transformer import DecoderOnly, EncoderDecoder, shift_right

V = 11  # pad 0, 1, bos 2, eos 3, 4..10
BOS, EOS = 2, 3


def _cfg(vocab=V, **kw):
    return variant("tiny", vocab_size=vocab, dropout_rate=0.0, **kw)


def _params(model, *args, seed=0):
    return nn.meta.unbox(jax.jit(model.init)(jax.random.key(seed), *args)["params"])


# Source with padding (row 1), so the cross-attention padding mask matters.
SRC = jnp.array([[5, 6, 7, 8, 9], [4, 9, 10, 0, 0]], jnp.int32)
TGT = jnp.array([[5, 6, 7, 8, 9, 4], [4, 9, 10, 1, 5, 6]], jnp.int32)
T_OUT = 8  # one output length for the translation tests: they share compiled functions


@pytest.fixture(scope="module")
def translation():
    cfg = _cfg()
    return cfg, _params(EncoderDecoder(cfg), SRC, TGT)


# The search's own behaviour (limits, padding, compaction, forced prefixes, beams) does not
# depend on depth: those tests decode a one-layer model (half the program to trace and
# compile); the cache tests keep two layers, where a cache mixed up between layers shows.
SHALLOW = dict(num_encoder_layers=1, num_decoder_layers=1)


@pytest.fixture(scope="module")
def shallow():
    cfg = _cfg(**SHALLOW)
    return cfg, _params(EncoderDecoder(cfg), SRC, TGT)


@functools.partial(jax.jit, static_argnums=0)
def _stepwise(build, params, decoder_inputs):
    """Feed decoder_inputs [B, L] one token at a time to the logits function that
    build(params) makes -> logits [B, L, V] and the final cache."""
    fn, cache = build(params)

    def step(cache, tokens):
        logits, cache = fn(tokens[:, None], cache)
        return cache, logits

    cache, logits = jax.lax.scan(step, cache, decoder_inputs.T)
    return logits.transpose(1, 0, 2), cache


# d_v != d_k (12 vs 8; tiny's default is 16 for both), with grouped-query attention.
DV = dict(head_dim=8, value_head_dim=12, num_kv_heads=2)


@pytest.fixture(scope="module")
def translation_dv():
    cfg = _cfg(**DV)
    return cfg, _params(EncoderDecoder(cfg), SRC, TGT)


@pytest.fixture(scope="module")
def language_model():
    cfg = _cfg(positional="learned", norm_position="pre", num_kv_heads=1)
    return cfg, _params(DecoderOnly(cfg), TGT)


def _check_ends(tokens, eos=EOS):
    """Every row: real tokens, then (after its first EOS) only padding. -> rows that ended."""
    ended = 0
    for row in np.asarray(tokens).reshape(-1, tokens.shape[-1]):
        eos_at = np.flatnonzero(row == eos)
        end = eos_at[0] + 1 if eos_at.size else row.size
        assert (row[:end] != 0).all(), row
        assert (row[end:] == 0).all(), row
        ended += bool(eos_at.size) and end < row.size
    return ended


# --------------------------------------------------------------------------- cache


@pytest.mark.parametrize("variant", ["sinusoidal", "rope", "value_head_dim"])
def test_cached_logits_equal_full_forward_encoder_decoder(translation, variant):
    cfg, params = translation
    if variant == "rope":  # with grouped-query attention and pre-LN
        cfg = _cfg(positional="rope", num_kv_heads=2, norm_position="pre")
        params = _params(EncoderDecoder(cfg), SRC, TGT)
    if variant == "value_head_dim":  # d_v != d_k: [.., K, 12] value caches, [.., K, 8] keys
        cfg = _cfg(positional="rope", **DV)
        params = _params(EncoderDecoder(cfg), SRC, TGT)
    model = EncoderDecoder(cfg)
    want = jax.jit(model.apply)({"params": params}, SRC, TGT)  # teacher forcing: [B, L, V]
    for use_cache in (True, False):
        build = lambda p, use_cache=use_cache: decoding.encoder_decoder_logits_fn(
            cfg, p, SRC, max_decode_len=TGT.shape[1], use_cache=use_cache
        )
        got, cache = _stepwise(build, params, shift_right(TGT, BOS))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{use_cache=}")
        if use_cache:
            layer = cache["model"]["decoder"]["layer_0"]
            if variant == "value_head_dim":  # heads-major: keys [B, K, T, Dk], values [B, K, Dv, T]
                for name, kv in (("self", "cached"), ("cross", "cross")):
                    c = layer[f"{name}_attention"]
                    assert c[f"{kv}_key"].shape[1::2] == (2, 8), name
                    assert c[f"{kv}_value"].shape[1:3] == (2, 12), name
            assert int(layer["self_attention"]["cache_index"]) == TGT.shape[1]


def test_cached_logits_equal_full_forward_language_model(language_model):
    cfg, params = language_model
    want = jax.jit(DecoderOnly(cfg).apply)({"params": params}, TGT)
    for use_cache in (True, False):
        build = lambda p, use_cache=use_cache: decoding.decoder_only_logits_fn(
            cfg, p, TGT.shape[0], max_decode_len=TGT.shape[1], use_cache=use_cache
        )
        got, _ = _stepwise(build, params, shift_right(TGT, BOS))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{use_cache=}")


@pytest.mark.parametrize("variant", ["sinusoidal", "rope", "value_head_dim"])
def test_beam_shared_cache_logits_equal_full_forward(translation, variant):
    """Two beams per source, never reordered: the beam-shared cache (every slot attended,
    masked to the hypothesis' own history; grouped cross-attention) gives the model's
    logits for each beam, with grouped-query heads and d_v != d_k too."""
    cfg, params = translation
    if variant == "rope":
        cfg = _cfg(positional="rope", num_kv_heads=2, norm_position="pre")
        params = _params(EncoderDecoder(cfg), SRC, TGT)
    if variant == "value_head_dim":
        cfg = _cfg(positional="rope", **DV)
        params = _params(EncoderDecoder(cfg), SRC, TGT)
    tgt = jnp.stack([TGT, TGT[::-1]], 1).reshape(-1, TGT.shape[1])  # beam 1: another target
    want = jax.jit(EncoderDecoder(cfg).apply)({"params": params}, jnp.repeat(SRC, 2, 0), tgt)
    build = lambda p: decoding.encoder_decoder_logits_fn(
        cfg, p, SRC, max_decode_len=TGT.shape[1], num_beams=2
    )
    got, cache = _stepwise(build, params, shift_right(tgt, BOS))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    layer = cache["model"]["decoder"]["layer_0"]
    np.testing.assert_array_equal(layer["self_attention"]["beam_origin"][0], [[0] * 6, [1] * 6])
    assert layer["cross_attention"]["cross_key"].shape[0] == SRC.shape[0]  # once per source


def test_gather_cache_reorders_beams_but_not_cross_attention():
    B, N = 2, 3
    rows = jnp.arange(B * N, dtype=jnp.float32)
    cache = {
        "self_attention": {"cached_key": rows[:, None] * 10, "cache_index": jnp.array(4)},
        "cross_attention": {"cross_key": rows[:, None]},
    }
    out = cache_lib.gather_beams(cache, jnp.array([[2, 2, 0], [1, 0, 0]]))
    np.testing.assert_array_equal(
        out["self_attention"]["cached_key"][:, 0], [20, 20, 0, 40, 30, 30]
    )
    np.testing.assert_array_equal(out["cross_attention"]["cross_key"][:, 0], rows)
    assert int(out["self_attention"]["cache_index"]) == 4
    # A beam-shared cache: only the origin table [B, N, T] moves, keys stay in their slots.
    shared = {
        "cached_key": rows.reshape(B, N, 1) * 10,
        "beam_origin": jnp.array([[[0, 0], [1, 1], [2, 2]], [[0, 0], [1, 1], [2, 2]]]),
    }
    out = cache_lib.gather_beams({"self_attention": shared}, jnp.array([[2, 2, 0], [1, 0, 0]]))
    np.testing.assert_array_equal(out["self_attention"]["cached_key"], shared["cached_key"])
    np.testing.assert_array_equal(
        out["self_attention"]["beam_origin"][..., 0], [[2, 2, 0], [1, 0, 0]]
    )


# -------------------------------------------------------------------------- greedy


def test_decode_length_is_source_plus_50_capped():
    assert decoding.decode_length(7) == 57
    assert decoding.decode_length(7, 20) == 20
    assert decoding.decode_length(None, 30, _cfg(positional="learned", max_len=16)) == 16
    assert decoding.decode_length(10, max_len_a=1.5, max_len_b=3) == 18
    with pytest.raises(ValueError, match="max_decode_len"):
        decoding.decode_length(None)
    limits = decoding.output_limits(SRC, 55)  # rows of 5 and 3 tokens
    np.testing.assert_array_equal(limits, [55, 53])
    np.testing.assert_array_equal(decoding.output_limits(SRC, 54), [54, 53])
    np.testing.assert_array_equal(
        decoding.output_limits(SRC, 9, max_len_a=0.5, max_len_b=1), [3, 2]
    )
    np.testing.assert_array_equal(decoding.output_limits(jnp.zeros((1, 4), jnp.int32), 9), [0])


def test_outputs_depend_on_each_source_not_on_its_padding_or_batch(shallow):
    """Each row's output limit is its own source's (a * n + b), so padding a batch further,
    or decoding a row with other rows, changes no token; an all-padding row decodes nothing."""
    cfg, params = shallow
    kw = dict(max_len_a=1.0, max_len_b=2)  # limits 7 and 5: a random model runs into them
    padded = jnp.pad(SRC, ((0, 1), (0, 4)))  # [3, 9]: four more padding columns, a padding row
    for way, decode in (
        ("greedy", lambda x: decoding.translate_greedy(cfg, params, x, **kw)),
        ("beam", lambda x: decoding.translate_beam(cfg, params, x, beam_size=3, **kw)[0][:, 0]),
        ("sample", lambda x: decoding.sample(cfg, params, jax.random.key(1), inputs=x, **kw)),
    ):
        want = np.asarray(decode(SRC))  # T = 5 + 2
        lengths = (want != 0).sum(1)
        assert (lengths <= [7, 5]).all() and (lengths == [7, 5]).any()  # cut at its own limit
        got = np.asarray(decode(padded))  # T = 9 + 2
        np.testing.assert_array_equal(got[:2, :7], want)
        assert not got[:2, 7:].any() and not got[2].any()
        # row 1 without row 0 (now padding), in SRC's shape (its compiled search; a sample's
        # random draws depend on the batch's shape and on the row's place in it)
        alone = np.asarray(decode(SRC.at[0].set(0)))
        np.testing.assert_array_equal(alone[1], want[1], err_msg=way)
        assert not alone[0].any(), way


def test_compaction_changes_no_output(shallow):
    """Rows that finish at different steps (their own limits, a padding row), some past the
    first stage's cache: moving the unfinished ones into batches of 8 // c (compact=c) gives
    the same tokens as decoding the whole batch to the end (compact=1), and the same scores
    up to float rounding (XLA sums in another order for another batch size)."""
    cfg, params = shallow
    lengths = [1, 9, 3, 0, 7, 2, 9, 5]  # row 3: all padding
    src = np.zeros((8, 9), np.int32)
    for r, n in enumerate(lengths):
        src[r, :n] = np.arange(n) % 7 + 4  # tokens 4..10
    src = jnp.asarray(src)
    kw = dict(max_len_b=15)  # limits n + 15 = 16..24; the first stage holds 9 + 10 = 19
    greedy = lambda c: np.asarray(decoding.translate_greedy(cfg, params, src, compact=c, **kw))
    beam = lambda c: decoding.translate_beam(cfg, params, src, beam_size=3, compact=c, **kw)
    want, (want_beams, want_scores) = greedy(1), beam(1)
    assert np.isfinite(np.delete(np.asarray(want_scores), 3, 0)).all()
    ends = (want != 0).sum(1)
    assert len(set(ends.tolist())) >= 4 and ends.max() > 19 and ends[3] == 0
    for c in (4, 8):  # batches of 2 rows, and of 1
        np.testing.assert_array_equal(greedy(c), want, err_msg=f"greedy, {c=}")
        beams, scores = beam(c)
        np.testing.assert_array_equal(beams, want_beams, err_msg=f"beam, {c=}")
        np.testing.assert_allclose(scores, want_scores, rtol=1e-6, err_msg=f"beam, {c=}")
    # compact=4 does run a loop over batches of 2 rows ([2, T] tokens in its carry).
    jaxpr = jax.make_jaxpr(lambda x: decoding.translate_greedy(cfg, params, x, compact=4, **kw))
    loops = [e for e in jaxpr(src).jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns]
    shapes = str(loops)
    assert "i32[2,24]" in shapes and "i32[8,24]" in shapes


# One layer (its greedy search is other tests' too); d_v != d_k with two. Caches mixed up
# between layers show in the cache tests above and in the beam tests below.
@pytest.mark.parametrize("fixture", ["shallow", "translation_dv"])
def test_greedy_is_argmax_of_the_full_model(request, fixture):
    cfg, params = request.getfixturevalue(fixture)
    T = T_OUT
    model = EncoderDecoder(cfg)
    full = jax.jit(
        lambda y: model.apply({"params": params}, SRC, y, targets_segmentation=jnp.ones_like(y))
    )
    want = np.zeros((2, T), np.int32)  # argmax (padding excluded), recomputed from scratch
    for t in range(T):
        want[:, t] = np.asarray(full(jnp.asarray(want)))[:, t, 1:].argmax(-1) + 1
    want[:, 1:][np.cumsum(want == EOS, axis=1)[:, :-1] > 0] = 0  # padding after EOS
    got = decoding.translate_greedy(cfg, params, SRC, max_decode_len=T)
    np.testing.assert_array_equal(got, want)
    no_cache = decoding.translate_greedy(cfg, params, SRC, max_decode_len=T, use_cache=False)
    np.testing.assert_array_equal(no_cache, want)


# ---------------------------------------------------------------------------- beam


def test_beam_size_one_is_greedy(shallow):
    """With an all-padding prompt (it forces nothing, in the compiled searches of
    test_beam_forced_prefix_as_greedy_and_compaction_see_it), beam 1 and greedy both give
    the plain greedy output."""
    cfg, params = shallow
    greedy = decoding.translate_greedy(cfg, params, SRC, max_decode_len=T_OUT)
    none = jnp.zeros((SRC.shape[0], 2), jnp.int32)
    np.testing.assert_array_equal(
        decoding.translate_greedy(cfg, params, SRC, prompt=none, max_decode_len=T_OUT), greedy
    )
    beam, scores = decoding.translate_beam(
        cfg, params, SRC, beam_size=1, length_penalty=0.6, prompt=none, max_decode_len=T_OUT
    )
    np.testing.assert_array_equal(beam[:, 0], greedy)
    assert np.isfinite(scores).all()


@pytest.mark.parametrize("fixture", ["translation", "translation_dv"])
def test_beam_search_with_and_without_cache_agree(request, fixture):
    """The no-cache path keeps no model state, so this checks the beam-shared cache (its
    origin table moving with the hypotheses), with grouped-query heads and d_v != d_k too."""
    cfg, params = request.getfixturevalue(fixture)
    kw = dict(beam_size=3, length_penalty=0.6, max_decode_len=T_OUT)
    tokens, scores = decoding.translate_beam(cfg, params, SRC, **kw)
    ref_tokens, ref_scores = decoding.translate_beam(cfg, params, SRC, use_cache=False, **kw)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert (np.diff(np.asarray(scores), axis=1) <= 0).all()  # best first
    assert len({tuple(r) for r in np.asarray(tokens[0])}) == 3  # distinct hypotheses


# A five-token vocabulary: pad 0, bos 2, eos 3 and real tokens 1, 4. With seed 5 the random
# one-layer model's greedy path is not the best sequence, so the search has work to do.
SMALL_V, MAX_LEN = 5, 4
SMALL_SRC = jnp.array([[1, 4, 4], [4, 1, 0], [1, 1, 4], [4, 4, 1]], jnp.int32)


def _all_hypotheses():
    """Every output up to MAX_LEN: ends in EOS, or is cut at MAX_LEN. -> [H, T], lengths [H]."""
    words = [1, 2, 4]  # non-EOS, non-padding tokens (BOS may be generated)
    seqs = [p + (EOS,) for n in range(MAX_LEN) for p in itertools.product(words, repeat=n)]
    seqs += list(itertools.product(words, repeat=MAX_LEN))
    out = np.zeros((len(seqs), MAX_LEN), np.int32)
    for j, s in enumerate(seqs):
        out[j, : len(s)] = s
    return out, np.array([len(s) for s in seqs])


@pytest.fixture(scope="module")
def small():
    """The model, and log p(y | x) of every hypothesis y [H, T] in float64: [B, H]."""
    cfg = _cfg(vocab=SMALL_V, **SHALLOW)
    model = EncoderDecoder(cfg)
    params = _params(model, SMALL_SRC, SMALL_SRC, seed=5)
    hyps, lengths = _all_hypotheses()
    B, H = SMALL_SRC.shape[0], len(hyps)
    logits = jax.jit(model.apply)(
        {"params": params}, jnp.repeat(SMALL_SRC, H, 0), jnp.tile(jnp.asarray(hyps), (B, 1))
    )
    logp = np.asarray(jax.nn.log_softmax(logits), np.float64).reshape(B, H, MAX_LEN, -1)
    token_logp = np.take_along_axis(logp, np.broadcast_to(hyps[..., None], (B, H, MAX_LEN, 1)), -1)
    token_logp = np.where(np.arange(MAX_LEN) < lengths[:, None], token_logp[..., 0], 0.0)
    return cfg, params, (hyps, lengths, token_logp.sum(-1))


def _exhaustive_scores(hypotheses, length_penalty, kind):
    """Every hypothesis' log p(y | x) / penalty(|y|): [B, H], and the hypotheses [H, T]."""
    hyps, lengths, logp = hypotheses
    return logp / np.asarray(search.length_divisor(lengths, length_penalty, kind), np.float64), hyps


def test_beam_as_wide_as_the_vocabulary_finds_the_exhaustive_best(small):
    cfg, params, hypotheses = small
    scores, hyps = _exhaustive_scores(hypotheses, 0.6, "gnmt")
    best = scores.argmax(1)
    tokens, beam_scores = decoding.translate_beam(
        cfg, params, SMALL_SRC, beam_size=SMALL_V, length_penalty=0.6, max_decode_len=MAX_LEN
    )
    np.testing.assert_array_equal(tokens[:, 0], hyps[best])
    np.testing.assert_allclose(beam_scores[:, 0], scores.max(1), rtol=1e-5, atol=1e-5)
    greedy = decoding.translate_greedy(cfg, params, SMALL_SRC, max_decode_len=MAX_LEN)
    assert (np.asarray(greedy) != hyps[best]).any(axis=1).sum() >= 2  # greedy misses them


@pytest.mark.parametrize("length_penalty,kind", [(0.6, "gnmt"), (1.0, "fairseq")])
def test_beam_covering_every_prefix_returns_the_exhaustive_top_n(small, length_penalty, kind):
    """27 = 3^3 beams keep every live prefix, so the N best finished must be exact."""
    cfg, params, hypotheses = small
    N = 27
    scores, hyps = _exhaustive_scores(hypotheses, length_penalty, kind)
    tokens, beam_scores = decoding.translate_beam(
        cfg,
        params,
        SMALL_SRC,
        beam_size=N,
        length_penalty=length_penalty,
        max_decode_len=MAX_LEN,
        length_penalty_kind=kind,
    )
    want = -np.sort(-scores, axis=1)[:, :N]
    np.testing.assert_allclose(beam_scores, want, rtol=1e-5, atol=1e-5)
    index = {tuple(h): j for j, h in enumerate(hyps)}  # each returned hypothesis' own score
    for b in range(SMALL_SRC.shape[0]):
        own = [scores[b, index[tuple(t)]] for t in np.asarray(tokens[b])]
        np.testing.assert_allclose(own, beam_scores[b], rtol=1e-5, atol=1e-5)


def _forced_hypotheses(cfg, params, srcs, prompts, length_penalty):
    """For each source `srcs[b]` [S] and its prompt: every output up to MAX_LEN that starts
    with the prompt (its EOS included), scored as beam search scores a forced prefix: the
    log p of the tokens after it, in float64, / penalty(their count, at least 1) -> a list of
    (scores [H], hypotheses [H, T]). One forward pass of the model for all of them."""
    words, rows = [1, 2, 4], []
    for prompt in prompts:
        free = MAX_LEN - len(prompt)
        ends = [s + (EOS,) for n in range(free) for s in itertools.product(words, repeat=n)]
        rows.append([(*prompt, *s) for s in ends + list(itertools.product(words, repeat=free))])
    seqs = [s for row in rows for s in row]
    hyps = np.zeros((len(seqs), MAX_LEN), np.int32)
    for j, s in enumerate(seqs):
        hyps[j, : len(s)] = s
    lengths = np.array([len(s) for s in seqs])
    starts = np.cumsum([0] + [len(row) for row in rows])
    src = jnp.repeat(jnp.asarray(srcs), np.diff(starts), 0, total_repeat_length=len(seqs))
    logits = jax.jit(EncoderDecoder(cfg).apply)({"params": params}, src, jnp.asarray(hyps))
    logp = np.asarray(jax.nn.log_softmax(logits), np.float64)
    token_logp = np.take_along_axis(logp, hyps[..., None], -1)[..., 0]
    prompt_len = np.repeat([len(p) for p in prompts], np.diff(starts))
    scored = (np.arange(MAX_LEN) >= prompt_len[:, None]) & (np.arange(MAX_LEN) < lengths[:, None])
    penalty = search.length_divisor(np.maximum(lengths - prompt_len, 1), length_penalty)
    scores = np.where(scored, token_logp, 0.0).sum(-1) / np.asarray(penalty, np.float64)
    return [(scores[a:b], hyps[a:b]) for a, b in zip(starts[:-1], starts[1:])]


def test_beam_forced_prefix_comes_first_and_leaves_the_score_alone(small):
    """Beams covering every prefix, each row with its own forced prefix (row 1 a forced EOS,
    row 3 none): every hypothesis starts with its row's prefix, a forced EOS does not end
    it, and the N best are the exhaustive N best of the outputs that start with the prefix,
    scored without the prefix (no log-probability, not counted in the length)."""
    cfg, params, _ = small
    N, length_penalty = 27, 0.6
    prefixes = [(4,), (EOS,), (1, 4), ()]
    prompt = np.zeros((len(prefixes), 3), np.int32)
    for b, p in enumerate(prefixes):
        prompt[b, : len(p)] = p
    tokens, beam_scores = decoding.translate_beam(
        cfg,
        params,
        SMALL_SRC,
        beam_size=N,
        length_penalty=length_penalty,
        max_decode_len=MAX_LEN,
        prompt=prompt,
    )
    tokens, beam_scores = np.asarray(tokens), np.asarray(beam_scores)
    forced = _forced_hypotheses(cfg, params, SMALL_SRC, prefixes, length_penalty)
    for b, (p, (scores, hyps)) in enumerate(zip(prefixes, forced)):
        found = np.isfinite(beam_scores[b])
        assert found.sum() == min(N, len(hyps))
        np.testing.assert_array_equal(tokens[b, found, : len(p)], np.tile(p, (found.sum(), 1)))
        want = -np.sort(-scores)[: found.sum()]
        np.testing.assert_allclose(beam_scores[b, found], want, rtol=1e-5, atol=1e-5)
        index = {tuple(h): j for j, h in enumerate(hyps)}  # each returned hypothesis' own
        own = [scores[index[tuple(t)]] for t in tokens[b, found]]
        np.testing.assert_allclose(own, beam_scores[b, found], rtol=1e-5, atol=1e-5)
    assert (tokens[1, :, 1] != 0).all()  # the forced EOS did not end row 1


def test_beam_forced_prefix_as_greedy_and_compaction_see_it(shallow):
    """An all-padding prompt forces nothing; beam 1 with a prompt is greedy with it; moving
    unfinished rows into smaller batches (compaction) carries each row's prefix with it."""
    cfg, params = shallow
    kw = dict(length_penalty=0.6, max_decode_len=T_OUT)
    prompt = jnp.array([[7, EOS], [5, 0]], jnp.int32)
    plain, plain_scores = decoding.translate_beam(cfg, params, SRC, beam_size=3, **kw)
    none, none_scores = decoding.translate_beam(  # compact=1: forced[1]'s compiled search
        cfg, params, SRC, beam_size=3, prompt=jnp.zeros_like(prompt), compact=1, **kw
    )
    np.testing.assert_array_equal(none, plain)
    np.testing.assert_allclose(none_scores, plain_scores, rtol=1e-6)
    forced = {
        c: decoding.translate_beam(cfg, params, SRC, beam_size=3, prompt=prompt, compact=c, **kw)
        for c in (1, 2)
    }
    np.testing.assert_array_equal(forced[1][0], forced[2][0])
    np.testing.assert_allclose(forced[1][1], forced[2][1], rtol=1e-6)
    tokens = np.asarray(forced[1][0])
    assert (tokens[0, :, :2] == [7, EOS]).all() and (tokens[1, :, 0] == 5).all()
    assert (tokens[0, :, 2] != 0).all()  # the forced EOS did not end row 0
    greedy = decoding.translate_greedy(cfg, params, SRC, prompt=prompt, max_decode_len=T_OUT)
    one, _ = decoding.translate_beam(cfg, params, SRC, beam_size=1, prompt=prompt, **kw)
    np.testing.assert_array_equal(one[:, 0], greedy)


def test_eos_ends_a_sequence_and_padding_follows(small):
    cfg, params, _ = small
    kw = dict(max_decode_len=MAX_LEN)  # greedy: the compiled search of the beam tests above
    greedy = decoding.translate_greedy(cfg, params, SMALL_SRC, **kw)
    beams, _ = decoding.translate_beam(
        cfg, params, SMALL_SRC, beam_size=3, length_penalty=0.6, **kw
    )
    sampled = decoding.sample(cfg, params, jax.random.key(0), inputs=SMALL_SRC, **kw)
    assert _check_ends(beams) >= 3
    assert _check_ends(sampled) >= 1
    _check_ends(greedy)
    with pytest.raises(ValueError, match="length_penalty_kind"):
        decoding.translate_beam(cfg, params, SMALL_SRC, length_penalty_kind="google", **kw)


def test_length_penalty_values():
    np.testing.assert_allclose(search.length_divisor(1, 0.6), 1.0)
    np.testing.assert_allclose(search.length_divisor(7, 0.6), 2.0**0.6, rtol=1e-6)
    np.testing.assert_allclose(search.length_divisor(4, 1.0, "fairseq"), 4.0)
    np.testing.assert_allclose(search.length_divisor(9, 0.0, "fairseq"), 1.0)


# ------------------------------------------------------------------------ sampling


def test_filter_logits_top_k_and_nucleus():
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3]]))
    kept = lambda **kw: np.isfinite(search.filter_logits(logits, **kw))[0].tolist()
    assert kept(top_k=2) == [False, True, False, True]
    assert kept(top_p=0.5) == [False, True, False, False]  # 0.5 alone reaches 0.5
    assert kept(top_p=0.7) == [False, True, False, True]
    assert kept(top_p=0.81) == [False, True, True, True]
    assert kept(top_k=2, top_p=0.81) == [False, True, False, True]


def test_sample_frequencies_follow_the_tempered_distribution():
    """A fixed logits function: 4000 one-step samples per setting against softmax(l / t)."""
    logits = jnp.log(jnp.array([1e-9, 0.1, 0.2, 0.3, 0.4]))  # index 0 (padding) is never drawn
    fn = lambda tokens, cache: (jnp.broadcast_to(logits, (tokens.shape[0], 5)), cache)
    run = jax.jit(
        lambda key, t: search.sample_decode(
            fn, (), key, batch_size=4000, max_decode_len=1, bos_id=BOS, eos_id=99, temperature=t
        )[:, 0]
    )
    for t in (1.0, 0.5):
        freq = np.bincount(np.asarray(run(jax.random.key(0), t)), minlength=5) / 4000
        want = np.asarray(jax.nn.softmax(logits[1:] / t))
        assert freq[0] == 0
        np.testing.assert_allclose(freq[1:], want, atol=0.03)
    assert (np.asarray(run(jax.random.key(0), 0.0)) == 4).all()


def test_language_model_sampling(language_model):
    cfg, params = language_model
    B, T = 3, 12
    prompt = jnp.array([[5, 6, 7], [4, 0, 0], [0, 0, 0]], jnp.int32)
    fn, cache = decoding.decoder_only_logits_fn(cfg, params, B, max_decode_len=T, use_cache=False)
    greedy = jax.jit(
        lambda p: search.greedy_decode(
            fn, cache, batch_size=B, max_decode_len=T, bos_id=BOS, prompt=p
        )
    )(prompt)
    run = lambda key, **kw: decoding.sample(cfg, params, key, prompt=prompt, max_decode_len=T, **kw)
    k0, k1 = jax.random.key(0), jax.random.key(1)
    np.testing.assert_array_equal(run(k0, temperature=0.0), greedy)
    np.testing.assert_array_equal(run(k1, temperature=1e-4), greedy)
    np.testing.assert_array_equal(run(k1, top_k=1, top_p=0.9), greedy)
    first = run(k0)
    np.testing.assert_array_equal(first, run(k0))
    assert (np.asarray(first) != np.asarray(run(k1))).any()
    np.testing.assert_array_equal(first[0, :3], [5, 6, 7])  # the prompt is forced
    assert int(first[1, 0]) == 4
    _check_ends(first)


def test_translation_sampling_at_temperature_zero_is_greedy(shallow):
    cfg, params = shallow
    greedy = decoding.translate_greedy(cfg, params, SRC, max_decode_len=T_OUT)
    sampled = decoding.sample(
        cfg, params, jax.random.key(3), inputs=SRC, max_decode_len=T_OUT, temperature=0.0
    )
    np.testing.assert_array_equal(sampled, greedy)


def test_decoding_loops_carry_the_cross_attention_cache_unchanged(shallow):
    """The cross-attention keys/values are projected when the cache is made, so neither loop
    holds a conditional (XLA:CPU copies a conditional's outputs every step)."""
    cfg, params = shallow
    for lowered in (
        decoding.translate_greedy.lower(cfg, params, SRC, eos_id=EOS),
        decoding.translate_beam.lower(cfg, params, SRC, beam_size=2, eos_id=EOS),
    ):
        text = lowered.as_text()
        assert "while" in text and "stablehlo.case" not in text and "stablehlo.if" not in text


def _markov_search(table, *, beams, length_penalty, kind, length):
    """search.beam_search of one row under a hand-made model: log p(next | last token) =
    log table[last] [V, V] (rows sum to 1; zero: -inf) -> (best tokens [T], its score)."""
    logp = jnp.log(jnp.asarray(table, jnp.float32))

    def tokens_to_logits(tokens, cache):
        _, _, cache = cache_lib.extend_prefix(cache, tokens)
        return logp[tokens[:, 0]], cache

    tokens, scores = search.beam_search(
        tokens_to_logits,
        cache_lib.prefix(beams, length),
        batch_size=1,
        beam_size=beams,
        max_decode_len=length,
        bos_id=BOS,
        eos_id=EOS,
        length_penalty=length_penalty,
        length_penalty_kind=kind,
    )
    return np.asarray(tokens[0, 0]), float(scores[0, 0])


def _markov(rows):
    """{last token: {next: p}} -> [7, 7] table; other rows: a fixed spread (no ties)."""
    table = np.tile([0.0, 0.1, 0.15, 0.2, 0.25, 0.3, 0.0], (7, 1))
    for last, probs in rows.items():
        table[last] = 0.0
        for token, p in probs.items():
            table[last, token] = p
    return table


A, C, D = 4, 5, 6


def test_hf_rules_finish_only_the_best_n_candidates():
    """Transformers (length_penalty_kind='hf') finishes a hypothesis only from the best N of the
    2N candidates of a step; tx_jax's rules keep any EOS among them. Beam 2, length_penalty 0 (score
    = log p): EOS is the third candidate of step 0 (log 0.2 = -1.61) and every 2-token output
    scores below it, so 'fairseq' returns it and 'hf' returns a c (log 0.45 * 0.35)."""
    table = _markov(
        {
            BOS: {A: 0.45, C: 0.3, EOS: 0.2, D: 0.05},
            A: {1: 0.1, A: 0.2, EOS: 0.05, C: 0.35, D: 0.3},
            C: {1: 0.1, A: 0.27, EOS: 0.28, C: 0.2, D: 0.15},
        }
    )
    kw = dict(beams=2, length_penalty=0.0, length=2)
    tokens, score = _markov_search(table, kind="fairseq", **kw)
    np.testing.assert_array_equal(tokens, [EOS, 0])
    np.testing.assert_allclose(score, np.log(0.2), rtol=1e-6)
    for kind in ("hf", "hf_early", "hf_never"):
        tokens, score = _markov_search(table, kind=kind, **kw)
        np.testing.assert_array_equal(tokens, [A, C], kind)
        np.testing.assert_allclose(score, np.log(0.45 * 0.35), rtol=1e-6)


def test_hf_rules_stop_by_transformers_heuristic():
    """Beam 1, length_penalty 1 (score = log p / length), limit 3: EOS first (log 0.6 / 1 = -0.51)
    fills the one finished slot, and the live a (log 0.3 / 1 = -1.20) cannot beat it at
    its length so far, so Transformers' early_stopping False and True close the row ('hf',
    'hf_early'). It is no bound: a c EOS scores log(0.3 * 0.9 * 0.9) / 3 = -0.47, which
    tx_jax's bound (log p / penalty(limit)) and early_stopping="never" go on to find."""
    table = _markov(
        {
            BOS: {EOS: 0.6, A: 0.3, C: 0.06, D: 0.04},
            A: {1: 0.01, EOS: 0.04, C: 0.9, D: 0.05},
            C: {1: 0.02, EOS: 0.9, A: 0.05, D: 0.03},
        }
    )
    kw = dict(beams=1, length_penalty=1.0, length=3)
    for kind in ("fairseq", "hf_never"):
        tokens, score = _markov_search(table, kind=kind, **kw)
        np.testing.assert_array_equal(tokens, [A, C, EOS], kind)
        np.testing.assert_allclose(score, np.log(0.3 * 0.9 * 0.9) / 3, rtol=1e-6)
    for kind in ("hf", "hf_early"):
        tokens, score = _markov_search(table, kind=kind, **kw)
        np.testing.assert_array_equal(tokens, [EOS, 0, 0], kind)
        np.testing.assert_allclose(score, np.log(0.6), rtol=1e-6)


def test_hf_early_closes_a_row_once_its_finished_slots_are_full():
    """Beam 2, length_penalty 1, limit 3: EOS (step 0, -0.80) and a EOS (step 1, log 0.25 / 2 =
    -0.69) fill both finished slots. The live a c (log 0.225 / 2 = -0.75) beats the worst
    of them at its length, so early_stopping=False ('hf') goes on to a c EOS (-0.53), as
    tx_jax's rules do; early_stopping=True ('hf_early') closes the row when they are full."""
    table = _markov(
        {
            BOS: {A: 0.5, EOS: 0.45, C: 0.03, D: 0.02},
            A: {EOS: 0.5, C: 0.45, A: 0.03, D: 0.02},
            C: {1: 0.02, EOS: 0.9, A: 0.05, D: 0.03},
        }
    )
    kw = dict(beams=2, length_penalty=1.0, length=3)
    for kind in ("fairseq", "hf", "hf_never"):
        tokens, score = _markov_search(table, kind=kind, **kw)
        np.testing.assert_array_equal(tokens, [A, C, EOS], kind)
        np.testing.assert_allclose(score, np.log(0.5 * 0.45 * 0.9) / 3, rtol=1e-6)
    tokens, score = _markov_search(table, kind="hf_early", **kw)
    np.testing.assert_array_equal(tokens, [A, EOS, 0])
    np.testing.assert_allclose(score, np.log(0.25) / 2, rtol=1e-6)
