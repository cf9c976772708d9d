"""interop/: a trained checkpoint exported to Transformers (MarianMT) and CTranslate2 computes
the same function: logits within float32 noise, identical greedy translations."""

from __future__ import annotations

import json
import os
import pathlib

import forked
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config

from tx_jax.data import datasets
from tx_jax.data.tokenizer import EOS_ID
from tx_jax.inference import restore
from tx_jax.inference.translation import translate_lines
from tx_jax.interop import ctranslate2 as ct2_export
from tx_jax.interop import huggingface, weights
from tx_jax.model.config import ModelConfig
from tx_jax.model.positional import sinusoidal_table
from tx_jax.runner.loop import train_and_evaluate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ctranslate2 = pytest.importorskip("ctranslate2")

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Not float32 rounding alone: Marian's LayerNorm epsilon is 1e-5, tx_jax's 1e-6.
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, tfds_dir):
    path = tmp_path_factory.mktemp("export") / "run"
    config = tiny_config(
        tfds_dir,
        **{"train.num_steps": 60, "train.warmup_steps": 10, "eval.beam_size": 3},
        # translate_lines truncates sources to max_eval_len (the exports do not): room for
        # every test sentence, so that all three translate the same sources
        **{"data.max_eval_len": 64},
    )
    train_and_evaluate(config, path)
    return restore.load(path)


@pytest.fixture(scope="module")
def hf_dir(loaded, tmp_path_factory):
    return huggingface.export(loaded, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def hf(hf_dir):
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir)).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(hf_dir))


@pytest.fixture(scope="module")
def sources(loaded):
    return [s for s, _ in datasets.load_split(loaded.config.data, "test")]


def _ct2(loaded, path, quantization="float32"):
    ct2_export.export(loaded, path, quantization=quantization)
    return ctranslate2.Translator(str(path), device="cpu", inter_threads=1, intra_threads=2)


def _hf_greedy(hf, loaded, lines, num_beams=1):
    model, tok = hf
    batch = tok(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, num_beams=num_beams, do_sample=False)
    return [loaded.tokenizer.decode(ids[1:].tolist()) for ids in out]  # drop the start token


def _ct2_translate(translator, loaded, lines, beam_size=1, length_penalty=1.0):
    pieces = [[loaded.tokenizer.id_to_piece(i) for i in loaded.tokenizer.encode(s)] for s in lines]
    results = translator.translate_batch(
        pieces,
        beam_size=beam_size,
        length_penalty=length_penalty,
        max_decoding_length=huggingface.max_decode_len(loaded),
    )
    ids = [[loaded.tokenizer.piece_to_id(p) for p in r.hypotheses[0]] for r in results]
    return [loaded.tokenizer.decode(x) for x in ids]


def test_refuses_what_has_no_exact_counterpart_naming_the_field():
    base = ModelConfig(vocab_size=64, d_model=32, num_heads=4, d_ff=64)
    assert weights.problems(base) == []
    cases = {
        "norm_position": "pre",
        "positional": "rope",
        "activation": "swiglu",
        "norm": "rmsnorm",
        "tie_output": False,
        "num_kv_heads": 2,
        "value_head_dim": 16,
    }
    for field, value in cases.items():
        found = weights.problems(base.replace(**{field: value}))
        assert len(found) == 1 and found[0].startswith(f"model.{field}={value!r}"), found
    assert weights.problems(base.replace(num_kv_heads=4)) == []  # K == H: plain multi-head
    assert "config.task='lm'" in weights.problems(base, task="lm")[0]
    with pytest.raises(weights.ExportError, match="norm_position='pre'.*\n.*positional='learned'"):
        weights.check_exportable(base.replace(norm_position="pre", positional="learned"))


def test_residual_order_is_marians_sinusoid_layout(hf):
    table = hf[0].model.encoder.embed_positions.weight.detach().numpy()  # Marian: sin | cos
    ours = sinusoidal_table(table.shape[0], table.shape[1])  # interleaved, the paper's
    order = huggingface.residual_order(table.shape[1])
    np.testing.assert_allclose(ours[:128, order], table[:128], atol=1e-5)
    assert not np.allclose(ours[:128], table[:128], atol=1e-2)  # the layouts do differ


def test_files_and_generation_config(hf_dir, loaded):
    names = {p.name for p in pathlib.Path(hf_dir).iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "source.spm"} <= names
    assert {"target.spm", "vocab.json", "tokenizer_config.json"} <= names
    generation = json.loads((pathlib.Path(hf_dir) / "generation_config.json").read_text())
    assert generation["num_beams"] == 3 and generation["length_penalty"] == 0.6  # the run's
    assert generation["decoder_start_token_id"] == loaded.model_config.bos_id
    vocab = json.loads((pathlib.Path(hf_dir) / "vocab.json").read_text())
    assert len(vocab) == loaded.model_config.vocab_size and vocab["</s>"] == EOS_ID


def test_tokenizer_and_logits_match_on_a_padded_batch(hf, loaded, sources):
    model, tok = hf
    src, tgt = sources[:6], sources[6:12]  # lengths differ: both sides are padded
    batch = tok(src, text_target=tgt, return_tensors="pt", padding=True)
    ids = batch["input_ids"].numpy()
    for row, text in zip(ids, src):
        assert row[row != 0].tolist() == loaded.tokenizer.encode(text) + [EOS_ID]
    labels = np.where(batch["labels"].numpy() == -100, 0, batch["labels"].numpy())
    assert (labels == 0).any() and (ids == 0).any()
    decoder_inputs = np.pad(labels, ((0, 0), (1, 0)), constant_values=loaded.model_config.bos_id)
    with torch.no_grad():
        theirs = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=torch.from_numpy(decoder_inputs[:, :-1]),
        ).logits.numpy()
    # jitted: one compilation instead of one per operation of an eager forward pass
    apply = jax.jit(loaded.model.apply)
    ours = np.asarray(apply({"params": loaded.params}, jnp.asarray(ids), jnp.asarray(labels)))
    valid = labels != 0
    assert np.abs(ours - theirs)[valid].max() < LOGITS_ATOL
    assert np.abs(ours[valid]).max() > 1.0  # not a comparison of zeros


def test_greedy_translations_identical_in_all_three(hf, loaded, sources, tmp_path):
    longest = max(len(loaded.tokenizer.encode(s)) + 1 for s in sources)
    assert longest <= loaded.config.data.max_eval_len  # nothing truncated by tx_jax alone
    ours = translate_lines(loaded, sources, beam_size=1)
    assert len(set(ours)) > 3  # a model that says something different per sentence
    # tx_jax cuts each sentence at its own n + 50 tokens; an export carries one maximum (the
    # longest source's + 50), so only sentences that ended with EOS must be the same.
    tok = loaded.tokenizer
    ended = [len(tok.encode(h)) + 1 < len(tok.encode(s)) + 1 + 50 for s, h in zip(sources, ours)]
    assert sum(ended) >= 0.5 * len(sources)
    same = lambda theirs: (
        [t for t, e in zip(theirs, ended) if e] == [o for o, e in zip(ours, ended) if e]
    )
    assert same(_hf_greedy(hf, loaded, sources))
    assert same(_ct2_translate(_ct2(loaded, tmp_path / "ct2"), loaded, sources))


def test_beam_search_agrees_on_most(hf, loaded, sources, tmp_path):
    """Same beam and length penalty; the searches differ in the penalty's rule (GNMT's
    ((5 + n) / 6)^a in tx_jax, n^a in Transformers and CTranslate2) and in when they stop."""
    ours = translate_lines(loaded, sources, beam_size=4, length_penalty=0.6)
    theirs = _hf_greedy(hf, loaded, sources, num_beams=4)
    ct2 = _ct2_translate(_ct2(loaded, tmp_path / "ct2"), loaded, sources, 4, 0.6)
    same_hf = np.mean([a == b for a, b in zip(ours, theirs)])
    same_ct2 = np.mean([a == b for a, b in zip(ours, ct2)])
    print(f"beam 4 agreement with tx_jax: transformers {same_hf:.3f}, ctranslate2 {same_ct2:.3f}")
    assert same_hf >= 0.75 and same_ct2 >= 0.75


def test_generate_and_pipeline_use_the_runs_search(hf, loaded, sources):
    model, tok = hf
    batch = tok(sources[:4], return_tensors="pt", padding=True)
    with torch.no_grad():  # no search arguments: generation_config.json decides (beam 3)
        default = [loaded.tokenizer.decode(x[1:].tolist()) for x in model.generate(**batch)]
    assert default == _hf_greedy(hf, loaded, sources[:4], num_beams=3)
    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip("transformers 5 removed pipeline('translation'); generate() is the API")
    translate = transformers.pipeline("translation", model=model, tokenizer=tok)
    assert [r["translation_text"] for r in translate(sources[:4])] == default


def test_ct2_int8_is_smaller_and_mostly_agrees(loaded, sources, tmp_path):
    f32, i8 = _ct2(loaded, tmp_path / "f32"), _ct2(loaded, tmp_path / "i8", "int8")
    size = lambda d: (tmp_path / d / "model.bin").stat().st_size
    assert size("i8") < 0.8 * size("f32")  # the float32 position table stays: small model
    a, b = _ct2_translate(f32, loaded, sources), _ct2_translate(i8, loaded, sources)
    # int8 weights move this tiny model's logits by more than its margins between tokens, so
    # whole sentences often differ; the quantized model must still score float32's
    # translations about as the float32 model does (mean log-probability per token)
    pieces = [
        [loaded.tokenizer.id_to_piece(i) for i in loaded.tokenizer.encode(s)] for s in sources
    ]
    targets = [[loaded.tokenizer.id_to_piece(i) for i in loaded.tokenizer.encode(h)] for h in a]
    f, q = (
        np.asarray([r.log_probs for r in m.score_batch(pieces, targets)], dtype=object)
        for m in (f32, i8)
    )
    per_token = lambda scores: np.mean([np.mean(x) for x in scores])  # noqa: E731
    print(
        f"int8 agreement {np.mean([x == y for x, y in zip(a, b)]):.3f}, mean log-prob "
        f"float32 {per_token(f):.4f} int8 {per_token(q):.4f}"
    )
    assert abs(per_token(q) - per_token(f)) < 0.1 * abs(per_token(f))


def test_cli_writes_both_formats(loaded, tmp_path):
    """`tx_jax export` three times, each forked from one interpreter (forked.py)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    commands = [
        (
            "tx_jax",
            ["export", f"--workdir={loaded.workdir}", f"--format={fmt}", f"--out={tmp_path / fmt}"],
        )
        for fmt in ("hf", "ct2")
    ]
    commands.append(("tx_jax", ["export", f"--workdir={loaded.workdir}"]))
    *runs, (code, _, err) = forked.run_modules(commands, cwd=ROOT, env=env, timeout=600)
    for fmt_code, _, fmt_err in runs:
        assert fmt_code == 0, fmt_err
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert (tmp_path / "ct2" / "model.bin").exists()
    assert (tmp_path / "ct2" / "sentencepiece.model").exists()
    assert code != 0 and "give --out" in err


def test_a_run_exported_then_imported_translates_as_the_run(hf_dir, loaded, sources, tmp_path):
    """tx_jax -> MarianMT -> tx_jax: the imported workdir (Marian's sinusoid layout, its
    epsilon 1e-5, its id order with pad 0) translates the test sentences as the run does."""
    from tx_jax.config import load_config
    from tx_jax.interop import importer

    importer.import_model(
        hf_dir, tmp_path / "w", base_config=load_config(str(ROOT / "configs" / "default.py"))
    )
    back = restore.load(tmp_path / "w")
    assert back.model_config.sinusoid_style == "marian" and back.model_config.norm_epsilon == 1e-5
    ours = translate_lines(loaded, sources, beam_size=1)
    theirs = translate_lines(back, sources, beam_size=1)
    same = [a == b for a, b in zip(ours, theirs, strict=True)]
    # Those that end with EOS, as test_greedy_translations_identical_in_all_three: one that
    # runs to its limit may differ once the epsilon moves a near-tie.
    tok = loaded.tokenizer
    ended = [len(tok.encode(h)) + 1 < len(tok.encode(s)) + 1 + 50 for s, h in zip(sources, ours)]
    assert sum(ended) >= 0.5 * len(sources)
    assert all(s for s, e in zip(same, ended, strict=True) if e), [
        (a, b) for a, b, s in zip(ours, theirs, same, strict=True) if not s
    ]


def test_a_byte_fallback_tokenizer_exports_to_both_formats(tmp_path):
    """A tokenizer trained with byte_fallback (data.tokenizer.byte_fallback, configs/text.py)
    is exported as it is: Transformers' Marian tokenizer writes an unseen character as the same
    byte pieces and ids as tx_jax, decodes them back, and its model reads them as tx_jax's;
    CTranslate2's vocabulary holds the byte pieces at their ids and translates from them."""
    from flax import linen as nn

    from tx_jax.data import tokenizer as tk
    from tx_jax.model import init_params, make_model

    words = ["the", "cat", "dog", "sat", "on", "a", "red", "mat", "ein", "Haus", "rot"]
    corpus = [" ".join(words[(i * k) % len(words)] for k in range(1, 6)) for i in range(200)]
    tok = tk.train_tokenizer(corpus, 300, tmp_path / "bf.model", byte_fallback=True)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        d_model=32,
        num_heads=4,
        d_ff=64,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout_rate=0.0,
    )
    params = nn.meta.unbox(init_params(make_model(cfg), jax.random.PRNGKey(0)))
    config = tiny_config(tmp_path / "tfds", **{"data.max_eval_len": 64})
    loaded = restore.Loaded(config, tok, cfg, params, 0, tmp_path / "ckpt", tmp_path)
    text = "the cat ☃ sat on жß 漢字"  # no character of ☃жß漢字 in the corpus
    ids = tok.encode(text)
    snowman = [tok.piece_to_id(p) for p in ("<0xE2>", "<0x98>", "<0x83>")]
    assert tk.UNK_ID not in ids and any(ids[i : i + 3] == snowman for i in range(len(ids)))

    hf_dir = huggingface.export(loaded, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    batch = hf_tok([text], text_target=[text], return_tensors="pt")
    assert batch["input_ids"][0].tolist() == ids + [EOS_ID]
    assert hf_tok.decode(batch["input_ids"][0], skip_special_tokens=True) == text
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir)).eval()
    labels = batch["labels"].numpy()
    decoder_inputs = np.pad(labels, ((0, 0), (1, 0)), constant_values=cfg.bos_id)[:, :-1]
    with torch.no_grad():
        theirs = model(
            input_ids=batch["input_ids"], decoder_input_ids=torch.from_numpy(decoder_inputs)
        ).logits.numpy()
    ours = jax.jit(make_model(cfg).apply)({"params": params}, batch["input_ids"].numpy(), labels)
    assert np.abs(np.asarray(ours) - theirs).max() < LOGITS_ATOL

    ct2_dir = ct2_export.export(loaded, tmp_path / "ct2")
    vocabulary = json.loads((pathlib.Path(ct2_dir) / "shared_vocabulary.json").read_text())
    assert vocabulary == weights.vocabulary(tok, cfg.vocab_size)
    assert [vocabulary[i] for i in snowman] == ["<0xE2>", "<0x98>", "<0x83>"]
    translator = ctranslate2.Translator(str(ct2_dir), device="cpu", intra_threads=1)
    pieces = [tok.id_to_piece(i) for i in ids]
    (result,) = translator.translate_batch([pieces], beam_size=1, max_decoding_length=8)
    assert result.hypotheses[0] and set(result.hypotheses[0]) <= set(vocabulary)
    (scored,) = translator.score_batch([pieces], [pieces])
    assert len(scored.log_probs) == len(pieces) + 1  # every byte piece read as a token, + EOS
