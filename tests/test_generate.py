"""Language-model sampling from a checkpoint: restore, seeds, greedy, prompts, CLI."""

import io
import json
import sys

import flax.linen as nn
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax.cli import generate
from tx_jax.data import synthetic
from tx_jax.data.tokenizer import train_tokenizer
from tx_jax.inference import decoding, generation, restore, search
from tx_jax.model.config import ModelConfig
from tx_jax.model.transformer import DecoderOnly
from tx_jax.training import optim
from tx_jax.training.checkpoint import Checkpointer
from tx_jax.training.state import TrainState

STEP = 7
PROMPTS = ["the red cat", "three small dogs that"]


def init_lm_state(model: nn.Module, tx, seed: int) -> TrainState:
    """init_state for a DecoderOnly model (it takes one token array, not two)."""
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))
    params = model.init(init_rng, jnp.ones((1, 8), jnp.int32))["params"]
    zero = jnp.zeros((), jnp.int32)
    return TrainState(zero, params, tx.init(params), dropout_rng, zero, zero)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A random-init debug-sized DecoderOnly saved as a task='lm' checkpoint at step 7.
    -> (workdir, model config, unboxed params, tokenizer)."""
    workdir = tmp_path_factory.mktemp("lm")
    texts = [t for pair in synthetic.generate_corpus(300, seed=0) for t in pair]
    tokenizer = train_tokenizer(texts, 160, workdir / "tokenizer.model")
    config = helpers.default_config.get_config("debug")
    config.task = "lm"
    model_config = ModelConfig.of_run(
        config, "cpu", vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id
    )
    tx, _ = optim.make_optimizer(config.train, model_config.d_model)
    model = DecoderOnly(model_config)
    state = jax.jit(lambda: nn.meta.unbox(init_lm_state(model, tx, config.seed)))()
    checkpointer = Checkpointer(workdir / "checkpoints", async_save=False)
    checkpointer.save(
        STEP, state, data_state={}, config=config.to_dict(), tokenizer_bytes=tokenizer.to_bytes()
    )
    checkpointer.close()
    return workdir, model_config, state.params, tokenizer


def test_load_checkpoint_restores_the_saved_lm(lm, tmp_path):
    workdir, model_config, params, tokenizer = lm
    loaded = restore.load(workdir, task="lm")
    assert (loaded.step, loaded.task) == (STEP, "lm")
    assert loaded.model_config == model_config and loaded.tokenizer == tokenizer
    assert loaded.config.model.d_model == 32
    same = jax.tree_util.tree_map(
        lambda a, b: bool((np.asarray(a) == b).all()), loaded.params, params
    )
    assert jax.tree_util.tree_all(same)
    with pytest.raises(restore.CheckpointError, match="'lm' model"):
        restore.load(workdir, task="translation")
    with pytest.raises(restore.CheckpointError, match="step 3"):
        restore.load(workdir, step=3)
    with pytest.raises(restore.CheckpointError, match="no checkpoint"):
        restore.load(tmp_path)


def test_sample_rows_force_the_prompt_and_follow_the_seed(lm):
    _, cfg, params, tok = lm
    ids = [tok.encode(p) for p in PROMPTS]
    run = lambda seed, **kw: generation.sample_rows(
        cfg, params, ids, jax.random.key(seed), num_samples=3, max_new_tokens=10, **kw
    )
    rows = run(0)
    assert rows.shape == (6, 16 + 10)  # prompts padded to 16, then 10 new positions
    for r, row in enumerate(rows):
        prompt = ids[r // 3]
        assert row[: len(prompt)].tolist() == prompt  # the prompt is a prefix
        eos = np.flatnonzero(row == tok.eos_id)
        end = eos[0] + 1 if eos.size else len(row)
        assert (row[:end] != 0).all() and (row[end:] == 0).all()  # padding only after EOS
    np.testing.assert_array_equal(rows, run(0))  # same seed, same samples
    assert (rows != run(1)).any()  # another seed, other samples
    assert len({tuple(r) for r in rows[:3]}) == 3  # a prompt's samples differ from each other


def test_temperature_zero_is_greedy_decoding(lm):
    _, cfg, params, tok = lm
    ids = [tok.encode(p) for p in PROMPTS]
    rows = generation.sample_rows(
        cfg, params, ids, jax.random.key(5), num_samples=2, max_new_tokens=12, temperature=0.0
    )
    prompt = np.zeros((4, 16), np.int32)
    for r in range(4):
        prompt[r, : len(ids[r // 2])] = ids[r // 2]
    B, T = prompt.shape[0], 16 + 12
    # the reference: greedy search over the full (no-cache) model, recomputed every step
    fn, cache = decoding.decoder_only_logits_fn(cfg, params, B, max_decode_len=T, use_cache=False)
    greedy = search.greedy_decode(
        fn,
        cache,
        batch_size=B,
        max_decode_len=T,
        bos_id=cfg.bos_id,
        eos_id=tok.eos_id,
        prompt=jnp.asarray(prompt),
    )
    np.testing.assert_array_equal(rows, greedy)
    assert (rows[0] == rows[1]).all()  # greedy: every sample of a prompt is the same


def test_generate_returns_the_continuation_only(lm):
    _, cfg, params, tok = lm
    samples = generation.generate(
        cfg,
        params,
        tok,
        [*PROMPTS, ""],
        num_samples=2,
        max_new_tokens=5,
        seed=3,
        temperature=1.0,
        top_p=1.0,
    )
    ids = [tok.encode(p) for p in [*PROMPTS, ""]]
    rows = generation.sample_rows(
        cfg, params, ids, jax.random.key(3), num_samples=2, max_new_tokens=5, temperature=1.0
    )
    assert [len(s) for s in samples] == [2, 2, 2]
    for i, per_prompt in enumerate(samples):
        for k, sample in enumerate(per_prompt):
            assert (sample.prompt, sample.sample) == ([*PROMPTS, ""][i], k)
            new = rows[2 * i + k, len(ids[i]) : len(ids[i]) + 5].tolist()
            if sample.finished:
                new = new[: new.index(tok.eos_id)]
            assert sample.tokens == new and len(new) <= 5 and tok.eos_id not in new
            assert sample.text == generation.continuation_text(tok, ids[i], new)


def test_continuation_text_keeps_the_word_boundary(lm):
    tok = lm[3]
    prompt, new = tok.encode("the red cat"), tok.encode("sees a dog")
    assert generation.continuation_text(tok, prompt, new) == " sees a dog"
    assert generation.continuation_text(tok, [], new) == "sees a dog"
    assert generation.continuation_text(tok, prompt, []) == ""


def _cli(argv, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert generate.main(["generate", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_cli_prints_num_samples_lines_per_prompt(lm, capsys, monkeypatch):
    workdir, cfg, params, tok = lm
    common = [f"--workdir={workdir}", "--max_new_tokens=6", "--seed=4"]
    lines = _cli([*common, "--prompt=the red cat", "--num_samples=3"], capsys)
    assert len(lines) == 3
    # the first prompt of a run uses fold_in(key(seed), 0)
    (want,) = generation.generate(
        cfg,
        params,
        tok,
        ["the red cat"],
        rng=jax.random.fold_in(jax.random.key(4), 0),
        num_samples=3,
        max_new_tokens=6,
    )
    assert lines == [" ".join(s.text.split()) for s in want]
    assert _cli([*common, "--prompt=the red cat", "--num_samples=3"], capsys) == lines

    stdin = "the red cat\nthree small dogs that\n"
    records = [
        json.loads(line)
        for line in _cli([*common, "--num_samples=2", "--json"], capsys, stdin, monkeypatch)
    ]
    assert [(r["prompt"], r["sample"]) for r in records] == [
        ("the red cat", 0),
        ("the red cat", 1),
        ("three small dogs that", 0),
        ("three small dogs that", 1),
    ]
    assert records[0]["text"] == want[0].text and records[1]["text"] == want[1].text
    assert all(len(r["tokens"]) <= 6 and isinstance(r["finished"], bool) for r in records)
    assert generate.main(["generate", "--prompt=x"]) == 2  # --workdir is required
