"""Adapting a trained model: LoRA adapters and frozen layers (tx_jax/model/lora.py,
tx_jax/training/freezing.py), their checkpoints (the trainable part and a digest of the base),
resume, inference and the merged export.

One base run (the module fixture) is adapted twice: with LoRA, and with the decoder alone
trainable."""

import json
import shutil

import flax.linen as nn
import forked
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import traverse_util
from helpers import ROOT, tiny_config, train_losses

from tx_jax.inference import restore
from tx_jax.inference.locate import CheckpointError
from tx_jax.model import lora as lora_lib
from tx_jax.model import make_model
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.validation import validate_config
from tx_jax.training.checkpoint import Checkpointer

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": lora_lib.DEFAULT_TARGETS}
STEPS = 6


def adapted_config(tfds_dir, base, *, lora=None, trainable="", **overrides):
    """tiny_config with train.init_from=`base` and the adaptation keys configs/finetune.py has."""
    c = tiny_config(tfds_dir, **{"train.num_steps": STEPS, "checkpoint.every": 3, **overrides})
    c.train.init_from = str(base)
    c.train.lora = ml_collections.ConfigDict({**LORA, "rank": 0, **(lora or {})})
    c.train.trainable = trainable
    c.train.frozen_dtype = ""
    return c


def flat(params) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(params, sep="/").items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tfds_dir):
    root = tmp_path_factory.mktemp("adapt")
    train_and_evaluate(tiny_config(tfds_dir, **{"train.num_steps": 4, "seed": 2}), root / "base")
    train_and_evaluate(adapted_config(tfds_dir, root / "base", lora=LORA), root / "lora")
    decoder = adapted_config(tfds_dir, root / "base", trainable="^decoder/")
    train_and_evaluate(decoder, root / "decoder")
    return root


def test_adapters_change_the_outputs_and_nothing_else_trains(runs, capsys):
    base, adapted = restore.load(runs / "base"), restore.load(runs / "lora")
    before, after = flat(base.params), flat(adapted.params)
    adapters = {k for k in after if lora_lib.ADAPTER.search(k)}
    # every projection of attention and FFN got A and B: (4 + 2) an encoder layer, (8 + 2) a
    # decoder layer
    cfg = adapted.model_config
    assert len(adapters) == 2 * (6 * cfg.num_encoder_layers + 10 * cfg.num_decoder_layers)
    assert set(after) - adapters == set(before)
    for key in before:  # the base's parameters, bit for bit
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)
    assert all(np.abs(after[k]).max() > 0 for k in adapters if k.endswith("_lora_b"))
    # the checkpoint holds the adapters and their moments alone, and the base's digest
    ckpt = Checkpointer(runs / "lora" / "checkpoints", read_only=True)
    stored = ckpt.state_metadata(STEPS)
    assert set(traverse_util.flatten_dict(stored["params"], sep="/")) == adapters
    moments = [
        "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        for path, _ in jax.tree_util.tree_leaves_with_path(stored["opt_state"])
    ]
    assert moments and all(lora_lib.ADAPTER.search(m) or "count" in m for m in moments)
    meta = ckpt.restore_meta(STEPS)["base"]
    assert meta["path"] == str(runs / "base" / "checkpoints" / "4") and meta["step"] == 4
    assert meta["digest"] == restore.params_digest(base.params)
    # the adapted model's outputs differ from the base's
    src = jnp.array([[5, 6, 7, 8, 9, 3]], jnp.int32)
    logits = [
        make_model(x.model_config).apply({"params": x.params}, src, src) for x in (base, adapted)
    ]
    assert np.abs(np.asarray(logits[0]) - np.asarray(logits[1])).max() > 1e-3


def test_a_run_starts_from_its_base_holding_the_model_once(runs):
    """The state an adapted run starts from is built around the base's buffers (donated and
    aliased); only the adapters and their moments are made, and the initialisers of the
    weights the base holds are dead code: XLA's temporaries stay below one model's bytes."""
    from tx_jax.training import optim, state
    from tx_jax.training.freezing import Trainable

    adapted = restore.load(runs / "lora")
    model = make_model(adapted.model_config)
    tx, _ = optim.make_optimizer(adapted.config.train, adapted.model_config.d_model)
    base = restore.load(runs / "base").params
    want = flat(base)
    init = jax.jit(
        lambda b: nn.meta.unbox(state.init_state(model, tx, 0, Trainable(adapters=True), b)),
        donate_argnums=0,
    )
    memory = init.lower(base).compile().memory_analysis()
    got = init(base)
    size = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    assert memory.alias_size_in_bytes == size(want)  # every base buffer is the state's
    made = size(got) - size(want)  # the adapters, their moments, the step and the key
    # new buffers: those, padded for alignment (1 KB here), nothing model-sized
    assert made <= memory.output_size_in_bytes - memory.alias_size_in_bytes < made + 4096
    assert memory.temp_size_in_bytes < size(want)
    params = flat(got.params)
    for key, value in want.items():
        np.testing.assert_array_equal(params[key], value, err_msg=key)
    adapters = {k: v for k, v in params.items() if lora_lib.ADAPTER.search(k)}
    assert adapters and all(not v.any() for k, v in adapters.items() if k.endswith("_lora_b"))


def test_trainable_pattern_trains_the_decoder_alone(runs):
    base, adapted = (
        flat(restore.load(runs / "base").params),
        flat(restore.load(runs / "decoder").params),
    )
    assert set(adapted) == set(base)
    for key in base:
        if key.startswith("decoder/"):
            assert not np.array_equal(adapted[key], base[key]), key
        else:  # the encoder and the shared embedding
            np.testing.assert_array_equal(adapted[key], base[key], err_msg=key)
    stored = Checkpointer(runs / "decoder" / "checkpoints", read_only=True).state_metadata(STEPS)
    assert set(stored["params"]) == {"decoder"}


def test_resume_is_exact(runs, tfds_dir, tmp_path):
    """The LoRA run restarted from its step-3 checkpoint (a copy): the same losses and the same
    adapters at the end, the base read again from train.init_from."""
    copy = tmp_path / "lora"
    shutil.copytree(runs / "lora", copy)
    shutil.rmtree(copy / "checkpoints" / str(STEPS))
    train_and_evaluate(adapted_config(tfds_dir, runs / "base", lora=LORA), copy)
    ours, theirs = train_losses(copy), train_losses(runs / "lora")
    assert [ours[s] for s in range(4, STEPS + 1)] == [theirs[s] for s in range(4, STEPS + 1)]
    a, b = flat(restore.load(copy).params), flat(restore.load(runs / "lora").params)
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_a_changed_or_missing_base_is_one_line(runs, tfds_dir, tmp_path):
    other = tmp_path / "other"
    train_and_evaluate(tiny_config(tfds_dir, **{"train.num_steps": 4, "seed": 1}), other)
    step4 = runs / "base" / "checkpoints" / "4"
    saved = tmp_path / "saved"
    shutil.move(step4, saved)
    try:
        with pytest.raises(CheckpointError, match="the base of .* is missing: ") as missing:
            restore.load(runs / "lora")
        shutil.copytree(other / "checkpoints" / "4", step4)
        with pytest.raises(
            CheckpointError, match=r"the base of .* changed: .* now holds other parameters \(digest"
        ) as changed:
            restore.load(runs / "lora")
        with pytest.raises(CheckpointError, match=r"changed"):  # a resume refuses it too
            train_and_evaluate(
                adapted_config(tfds_dir, runs / "base", lora=LORA, **{"train.num_steps": 8}),
                runs / "lora",
            )
    finally:
        shutil.rmtree(step4, ignore_errors=True)
        shutil.move(saved, step4)
    for e in (missing, changed):
        assert "\n" not in str(e.value)


def test_merged_adapters_compute_what_base_and_adapters_compute(runs):
    adapted = restore.load(runs / "lora")
    lora = adapted.model_config.lora
    merged = lora_lib.merge(adapted.params, lora)
    assert not lora_lib.adapters(merged)
    plain = adapted.model_config.replace(lora_rank=0)
    src = jnp.array([[5, 6, 7, 8, 9, 3], [4, 9, 10, 3, 0, 0]], jnp.int32)
    want = make_model(adapted.model_config).apply({"params": adapted.params}, src, src)
    got = make_model(plain).apply({"params": merged}, src, src)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    # the merged tree is exactly the base's structure
    base = restore.load(runs / "base").params
    assert jax.tree_util.tree_structure(nn.meta.unbox(base)) == jax.tree_util.tree_structure(merged)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"train.init_from": ""}, r"train.lora.rank freezes parameters, which come from"),
        ({"eval.average_last": 2}, r"eval.average_last=2 with train.lora.rank"),
        ({"train.lora.dropout": 1.0}, r"train.lora.dropout=1.0 must be in \[0, 1\)"),
        ({"train.trainable": "(("}, r"train.trainable='\(\(' is not a pattern"),
    ],
)
def test_bad_adaptation_keys_are_named(tfds_dir, changes, message):
    c = adapted_config(tfds_dir, "base", lora=LORA)
    for key, value in changes.items():
        section, *rest = key.split(".")
        target = c[section]
        for name in rest[:-1]:
            target = target[name]
        target[rest[-1]] = value
    with pytest.raises(ValueError, match=message):
        validate_config(c)


def test_averaging_an_adapted_run_is_refused(runs):
    with pytest.raises(CheckpointError, match="trained a part of its model"):
        restore.load(runs / "lora", average_last=2)


def test_targets_that_match_nothing_are_refused(runs, tfds_dir, tmp_path):
    config = adapted_config(tfds_dir, runs / "base", lora={**LORA, "targets": "nothing_here$"})
    with pytest.raises(ValueError, match="train.lora.targets matches no projection"):
        train_and_evaluate(config, tmp_path / "run")


def test_the_merged_export_translates_as_the_adapted_run(runs, tmp_path):
    """Transformers' greedy translations of the merged export equal tx_jax's of base +
    adapters; --format=peft's adapters on the base's export compute the merged logits;
    --adapters_only writes the adapters and their base."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    from tx_jax.data import datasets
    from tx_jax.inference.translation import translate_lines
    from tx_jax.interop import adapters, huggingface

    loaded = restore.load(runs / "lora")
    tok = loaded.tokenizer
    sources = [s for s, _ in datasets.load_split(loaded.config.data, "test")]
    sources = [s for s in sources if len(tok.encode(s)) + 1 <= loaded.config.data.max_eval_len]
    ours = translate_lines(loaded, sources, beam_size=1)
    out = huggingface.export(restore.merged(loaded), tmp_path / "hf")
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(out)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    batch = hf_tok(sources, return_tensors="pt", padding=True)
    # the logits of a padded batch, teacher-forced: base + adapters' to float32 noise
    src, tgt = sources[:6], sources[6:12]
    pair = hf_tok(src, text_target=tgt, return_tensors="pt", padding=True)
    labels = np.where(pair["labels"].numpy() == -100, 0, pair["labels"].numpy())
    starts = np.pad(labels, ((0, 0), (1, 0)), constant_values=loaded.model_config.bos_id)

    def teacher_forced(m) -> np.ndarray:
        with torch.no_grad():
            return m(
                input_ids=pair["input_ids"],
                attention_mask=pair["attention_mask"],
                decoder_input_ids=torch.from_numpy(starts[:, :-1]),
            ).logits.numpy()

    hf_logits = teacher_forced(model)
    inputs = (jnp.asarray(pair["input_ids"].numpy()), jnp.asarray(labels))
    ours_logits, base_logits = (
        np.asarray(jax.jit(x.model.apply)({"params": x.params}, *inputs))
        for x in (loaded, restore.load(runs / "base"))
    )
    valid = labels != 0
    assert np.abs(ours_logits - hf_logits)[valid].max() < 1e-4
    assert np.abs(base_logits - hf_logits)[valid].max() > 1e-2  # the adapters are in it
    # `tx_jax export --format=peft`: the adapters alone, which PEFT puts on the base's export
    peft = pytest.importorskip("peft")
    base_dir = huggingface.export(restore.load(runs / "base"), tmp_path / "base_hf")
    args = [f"--workdir={runs / 'lora'}", "--format=peft", f"--out={tmp_path / 'peft'}"]
    [(code, _, err)] = forked.run_modules([("tx_jax", ["export", *args])], cwd=ROOT, timeout=600)
    assert code == 0, err[-3000:]
    base_model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(base_dir)).eval()
    tuned = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "peft")).eval()
    assert np.abs(teacher_forced(tuned) - hf_logits)[valid].max() < 1e-4
    with pytest.raises(ValueError, match="has no adapters"):
        adapters.write_peft(restore.load(runs / "base"), tmp_path / "none")
    with torch.no_grad():
        ids = model.generate(**batch, num_beams=1, do_sample=False)
    theirs = [tok.decode(x[1:].tolist()) for x in ids]
    # the two cut an unfinished sentence at different lengths (tx_jax at its source's n + 50
    # tokens, the export at the longest source's): greedy search makes the shorter of the two
    # a prefix of the longer
    assert len(set(ours)) > 1 and max(len(tok.encode(h)) for h in ours) > 20
    # and CTranslate2's, from the same merged weights
    ctranslate2 = pytest.importorskip("ctranslate2")
    from tx_jax.interop import ctranslate2 as ct2_export

    ct2_dir = ct2_export.export(restore.merged(loaded), tmp_path / "ct2")
    translator = ctranslate2.Translator(str(ct2_dir), device="cpu")
    results = translator.translate_batch(
        [[tok.id_to_piece(i) for i in tok.encode(s)] for s in sources],
        beam_size=1,
        max_decoding_length=huggingface.max_decode_len(loaded),
    )
    ct2 = [tok.decode([tok.piece_to_id(p) for p in r.hypotheses[0]]) for r in results]
    for a, *others in zip(ours, theirs, ct2):
        for b in others:
            short, long = sorted((a, b), key=len)
            assert long.startswith(short.rstrip()), (a, b)
    # the adapters alone, with what they were trained on
    written = adapters.write(loaded, tmp_path / "adapters")
    tensors = load_file(str(written / "adapters.safetensors"))
    assert set(tensors) == set(lora_lib.adapters(loaded.params))
    config = json.loads((written / "adapter_config.json").read_text())
    assert (config["rank"], config["alpha"]) == (4, 8.0) and config["base"]["step"] == 4


def test_finetune_config_adapts_on_a_text_corpus(runs, tmp_path, capsys):
    """configs/finetune.py with data=text: a plain-text corpus of one's own, LoRA on."""
    from tx_jax.config import apply_overrides, load_config

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    pairs = [
        ("the red house", "das rote Haus"),
        ("a cat sees the dog", "eine Katze sieht den Hund"),
    ]
    (corpus / "train.en").write_text("".join(f"{a}\n" for a, _ in pairs * 20))
    (corpus / "train.de").write_text("".join(f"{b}\n" for _, b in pairs * 20))
    (corpus / "dev.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in pairs))
    spec = f"configs/finetune.py:init_from={runs / 'base'},data=text,lora=2"
    lora, plain = load_config(spec), load_config(spec.replace(",lora=2", ""))
    assert (lora.train.lora.rank, lora.train.peak_lr) == (2, 1e-3)  # the rate LoRA ran at
    assert (plain.train.lora.rank, plain.train.peak_lr) == (0, 5e-5)
    config = load_config(spec + ",variant=debug")
    apply_overrides(
        config,
        {
            "data.train": str(corpus / "train"),
            "data.validation": str(corpus / "dev.tsv"),
            "data.data_dir": str(tmp_path / "tfds"),
        },
    )
    train_and_evaluate(config, tmp_path / "run")
    out = capsys.readouterr().out
    assert "text corpus data.train (1 shard(s)): 40 pairs read" in out
    assert "trainable: " in out and "LoRA rank 2 (alpha 32); the rest frozen" in out
    assert max(train_losses(tmp_path / "run")) == config.train.num_steps
    stored = Checkpointer(tmp_path / "run" / "checkpoints", read_only=True)
    params = stored.state_metadata(config.train.num_steps)["params"]
    assert all(lora_lib.ADAPTER.search(k) for k in traverse_util.flatten_dict(params, sep="/"))
