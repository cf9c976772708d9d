"""`tx_jax.import_model` end to end: a Hugging Face directory built here with transformers'
own classes (tiny random weights, SentencePiece models trained in the test) becomes a
workdir that restore, score, translate and fine-tuning read as any run's."""

import gzip
import json
import shutil
import subprocess
import sys

import numpy as np
import pretrained_fixtures as pf
import pytest

from tx_jax.config import load_config
from tx_jax.data.imported_tokenizer import ImportedTokenizer
from tx_jax.inference import decoding, languages, likelihood, restore, translation
from tx_jax.interop import importer
from tx_jax.interop.seq2seq_layout import PretrainedError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _import(hf_dir, workdir, **kw):
    base = load_config("configs/default.py")
    return importer.import_model(hf_dir, workdir, base_config=base, **kw)


def _hf_logprobs(model, tok, sources, targets, skip=0):
    """transformers' teacher-forced ln p(target + EOS | source), the first `skip` labels
    (a forced language token) fed but not counted."""
    enc = tok(sources, text_target=targets, return_tensors="pt", padding=True)
    labels = enc["labels"]
    with torch.no_grad():
        logits = model(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels
        ).logits
    logp = torch.log_softmax(logits.double(), -1)
    mask = labels != tok.pad_token_id
    mask[:, :skip] = False
    picked = logp.gather(-1, labels[..., None])[..., 0] * mask
    return picked.sum(1).numpy(), mask.sum(1).numpy()


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    root = tmp_path_factory.mktemp("marian")
    model, tok = pf.marian_dir(root / "hf", eos_bias=0.0, init_std=0.5)
    _import(root / "hf", root / "w")
    return model, tok, root


def test_workdir_is_an_ordinary_run(marian):
    _, _, root = marian
    w = root / "w"
    assert (w / "checkpoints" / "0" / "checksums.json").exists()
    assert json.loads((w / "config.json").read_text())["model"]["sinusoid_style"] == "marian"
    assert restore.load(w).tokenizer.hf_config["model_type"] == "marian"
    loaded = restore.load(w)
    assert isinstance(loaded.tokenizer, ImportedTokenizer)
    assert loaded.step == 0 and loaded.task == "translation"
    assert loaded.model_config.bos_id == 0 and loaded.model_config.logits_bias
    assert loaded.model_config.activation == "silu"
    assert (loaded.config.data.source_lang, loaded.config.data.target_lang) == ("en", "de")


def test_scores_equal_transformers(marian):
    model, tok, root = marian
    loaded = restore.load(root / "w")
    scores = likelihood.score_pairs(loaded, pf.EN, pf.DE, batch_size=3)  # 3 batches, padded
    want, count = _hf_logprobs(model, tok, pf.EN, pf.DE)
    got = np.array([s.logprob for s in scores])
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert [s.tokens for s in scores] == count.tolist()


def test_greedy_translations_equal_transformers_generate(marian):
    model, tok, root = marian
    loaded = restore.load(root / "w")
    ours = translation.translate_lines(loaded, pf.EN, beam_size=1)
    for source, hyp in zip(pf.EN, ours, strict=True):
        enc = tok([source], return_tensors="pt")
        limit = enc["input_ids"].shape[1] + 50  # tx_jax's output limit: a * source + b
        # + 1: at its limit transformers forces EOS (forced_eos_token_id), tx_jax cuts
        out = model.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=limit + 1)
        assert hyp == tok.decode(out[0], skip_special_tokens=True)


def test_score_cli_one_line_per_pair(marian, tmp_path):
    model, tok, root = marian
    (tmp_path / "src").write_text("\n".join(pf.EN[:3]) + "\n")
    (tmp_path / "tgt").write_text("\n".join(pf.DE[:3]) + "\n")
    args = ["--workdir", str(root / "w"), "--source", str(tmp_path / "src")]
    out = subprocess.run(
        [sys.executable, "-m", "tx_jax.score", *args, "--target", str(tmp_path / "tgt")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    want, count = _hf_logprobs(model, tok, pf.EN[:3], pf.DE[:3])
    assert len(out) == 3
    for line, w, n in zip(out, want, count, strict=True):
        logprob, tokens = line.split("\t")
        assert float(logprob) == pytest.approx(w, rel=1e-4) and int(tokens) == n


def test_m2m_100_scores_skip_the_forced_language_token(tmp_path):
    model, tok = pf.m2m_100_dir(tmp_path / "hf")
    _import(tmp_path / "hf", tmp_path / "w")
    loaded = restore.load(tmp_path / "w")
    assert loaded.tokenizer.family == "m2m_100" and loaded.model_config.sinusoid_style == "fairseq"
    tok.src_lang, tok.tgt_lang = "en", "fr"
    scores = likelihood.score_pairs(loaded, pf.EN, pf.DE, source_lang="en", target_lang="fr")
    want, count = _hf_logprobs(model, tok, pf.EN, pf.DE, skip=1)
    np.testing.assert_allclose([s.logprob for s in scores], want, rtol=1e-4)
    assert [s.tokens for s in scores] == count.tolist()
    with pytest.raises(ValueError, match="'xx' is not one of this m2m_100 model's 100"):
        likelihood.score_pairs(loaded, pf.EN, pf.DE, target_lang="xx")


def test_refusals_write_nothing(tmp_path, marian):
    _, _, root = marian
    config = json.loads((root / "hf" / "config.json").read_text())
    bad = tmp_path / "bart"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(dict(config, model_type="bart")))
    with pytest.raises(PretrainedError, match="model_type='bart'"):
        _import(bad, tmp_path / "w1")
    assert not (tmp_path / "w1").exists()
    with pytest.raises(PretrainedError, match="already holds checkpoints"):
        _import(root / "hf", root / "w")
    pickled = tmp_path / "pickled"
    shutil.copytree(root / "hf", pickled)
    (pickled / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, pickled / "pytorch_model.bin")
    with pytest.raises(PretrainedError, match="pytorch_model.bin is a pickle: give --allow_pickle"):
        _import(pickled, tmp_path / "w2")
    assert not (tmp_path / "w2").exists()


def _multi30k_files(directory, n=48):
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", n), ("val", 8), ("test_2016_flickr", 8)):
        for lang, lines in (("en", pf.EN), ("de", pf.DE)):
            with gzip.open(directory / f"{prefix}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.writelines(lines[i % len(lines)] + "\n" for i in range(count))
    return directory


def test_finetuning_an_imported_model_lowers_the_loss(marian, tmp_path):
    from tx_jax.experiment.loop import train_and_evaluate

    _, _, root = marian
    spec = f"configs/finetune.py:init_from={root / 'w'},debug"
    config = load_config(spec)
    config.data.manual_dir = str(_multi30k_files(tmp_path / "raw"))
    config.data.data_dir = str(tmp_path / "tfds")
    config.train.num_steps = 8
    config.train.peak_lr = 3e-3
    assert config.model.sinusoid_style == "marian" and config.train.init_from == str(root / "w")
    train_and_evaluate(config, str(tmp_path / "ft"))
    records = [json.loads(x) for x in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    nll = [r["nll"] for r in records if r.get("split") == "train"]
    assert len(nll) == 4 and nll[-1] < nll[0]  # steps 2, 4, 6, 8


def test_export_of_the_import_gives_back_the_source(marian, tmp_path):
    from safetensors.numpy import load_file

    _, _, root = marian
    subprocess.run(
        [sys.executable, "-m", "tx_jax.export", f"--workdir={root / 'w'}", f"--out={tmp_path}"],
        check=True,
        capture_output=True,
    )
    want, got = (
        load_file(root / "hf" / "model.safetensors"),
        load_file(tmp_path / "model.safetensors"),
    )
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].dtype == x.dtype and np.array_equal(got[name], x), name
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (root / "hf" / name).read_bytes(), name
    back = json.loads((tmp_path / "config.json").read_text())
    source = json.loads((root / "hf" / "config.json").read_text())
    assert {k: back.get(k) for k in source} == source


def test_evaluate_cli_on_a_dataset_named_by_overrides(marian, tmp_path):
    _, _, root = marian
    raw = _multi30k_files(tmp_path / "raw")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tx_jax.evaluate",
            f"--workdir={root / 'w'}",
            "--split=test_2016_flickr",
            "--beam_size=1",
            "--config.data.dataset=multi30k",
            f"--config.data.manual_dir={raw}",
            f"--config.data.data_dir={tmp_path / 'tfds'}",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "BLEU" in proc.stdout + proc.stderr


def test_m2m_100_translates_into_the_forced_language_as_generate(tmp_path):
    from tx_jax.interop import pretrained

    model, tok = pf.m2m_100_dir(tmp_path / "hf")
    _import(tmp_path / "hf", tmp_path / "w")
    loaded = restore.load(tmp_path / "w")
    source, target = languages.prefixes(loaded, "en", "fr")
    assert target == [loaded.tokenizer.language_id("fr")]
    perm = pretrained.vocab_permutation(model.config.to_dict())
    tok.src_lang = "en"
    for line in pf.EN[:4]:
        ids = [*source, *loaded.tokenizer.encode(line), loaded.tokenizer.eos_id]
        ours = decoding.translate_greedy(
            loaded.model_config,
            loaded.params,
            np.asarray([ids]),
            eos_id=loaded.tokenizer.eos_id,
            prompt=np.asarray([target]),
        )
        ours = [int(i) for i in np.asarray(ours)[0] if i != 0]
        enc = tok([line], return_tensors="pt")
        assert [int(perm[i]) for i in enc["input_ids"][0]] == ids
        limit = len(ids) + 50  # the forced token counts in both limits
        out = model.generate(
            **enc, forced_bos_token_id=tok.get_lang_id("fr"), max_new_tokens=limit + 1
        )
        theirs = [int(perm[i]) for i in out[0, 1:]]  # without the decoder's start token
        assert theirs[0] == target[0]
        assert ours == theirs[: len(ours)] and len(theirs) - len(ours) in (0, 1)  # + forced EOS
    cli = subprocess.run(
        [sys.executable, "-m", "tx_jax.translate", f"--workdir={tmp_path / 'w'}", "--beam_size=1"]
        + ["--source_lang=en", "--target_lang=fr"],
        input="\n".join(pf.EN) + "\n",
        capture_output=True,
        text=True,
        check=True,
    )
    want = translation.translate_lines(
        loaded, pf.EN, beam_size=1, source_prefix=source, target_prefix=target
    )
    assert cli.stdout.splitlines() == want and len(want) == len(pf.EN)


def test_attention_maps_of_an_imported_model(marian, tmp_path):
    _, _, root = marian
    subprocess.run(
        [sys.executable, "-m", "tx_jax.visualize", "attention", f"--workdir={root / 'w'}"]
        + [f"--source={pf.EN[1]}", f"--target={pf.DE[1]}", f"--out={tmp_path}"],
        check=True,
        capture_output=True,
    )
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs and all((tmp_path / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


@pytest.fixture(scope="module")
def m2m_100(tmp_path_factory):
    root = tmp_path_factory.mktemp("m2m_100")
    model, tok = pf.m2m_100_dir(root / "hf")
    _import(root / "hf", root / "w")
    return model, tok, root


def test_evaluate_m2m_100_forces_the_target_language(m2m_100, tmp_path, monkeypatch):
    from tx_jax.inference import evaluation

    _, _, root = m2m_100
    w, raw = root / "w", _multi30k_files(tmp_path / "raw")
    data = {"data.dataset": "multi30k", "data.manual_dir": str(raw)}
    data["data.data_dir"] = str(tmp_path / "tfds")
    decoded = []  # every hypothesis's ids, as decoding produced them
    original = ImportedTokenizer.decode

    def decode(self, ids):
        decoded.append([int(i) for i in ids])
        return original(self, ids)

    monkeypatch.setattr(ImportedTokenizer, "decode", decode)
    split = "test_2016_flickr"
    record = evaluation.evaluate(
        w, split=split, beam_size=1, overrides=data, source_lang="en", target_lang="fr"
    )
    monkeypatch.undo()
    loaded = restore.load(w)
    fr = loaded.tokenizer.language_id("fr")
    assert len(decoded) == 8 and all(ids[0] == fr for ids in decoded)
    assert record["languages"] == "en-fr" and record["examples"] == 8
    hyps = (w / "eval" / f"{split}_en-fr_step0_beam1.txt").read_text().splitlines()
    assert record["hypotheses"].endswith(f"{split}_en-fr_step0_beam1.txt")
    # The text leaves the language token out, and equals translate's for en -> fr.
    source, target = languages.prefixes(loaded, "en", "fr")
    want = translation.translate_lines(
        loaded, pf.EN, beam_size=1, source_prefix=source, target_prefix=target
    )
    assert hyps == want and "__fr__" not in "".join(hyps)
    assert sorted(map(loaded.tokenizer.decode, decoded)) == sorted(want)  # length-sorted
    # The default: the data languages (the checkpoint's en -> de).
    de = evaluation.evaluate(w, split=split, beam_size=1, overrides=data, write=False)
    assert de["languages"] is None and de["hypotheses"] is None
    bad = subprocess.run(
        [sys.executable, "-m", "tx_jax.evaluate", f"--workdir={w}", "--target_lang=xx"]
        + [f"--config.{k}={v}" for k, v in data.items()],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0
    assert "error: language 'xx' is not one of this m2m_100 model's 100" in bad.stderr


def test_finetuning_m2m_100_trains_the_language_tokens_and_lowers_the_loss(m2m_100, tmp_path):
    from tx_jax.data import tasks
    from tx_jax.experiment.loop import train_and_evaluate
    from tx_jax.interop import pretrained

    _, tok, root = m2m_100
    config = load_config(f"configs/finetune.py:init_from={root / 'w'},debug")
    config.data.manual_dir = str(_multi30k_files(tmp_path / "raw"))
    config.data.data_dir = str(tmp_path / "tfds")
    config.train.num_steps = 8
    config.train.peak_lr = 3e-3
    loaded = restore.load(root / "w")
    # The batches the run trains on: each packed pair is transformers' encoding of it.
    perm = pretrained.vocab_permutation(json.loads((root / "hf" / "config.json").read_text()))
    tok.src_lang, tok.tgt_lang = "en", "de"  # configs/finetune.py's default pair
    want = set()
    for source, target in zip(pf.EN, pf.DE, strict=True):
        enc = tok(source, text_target=target)
        want.add(tuple(tuple(int(perm[i]) for i in enc[k]) for k in ("input_ids", "labels")))
    task = tasks.prepare_translation_task(
        config.data, tmp_path / "peek", seed=config.seed, tokenizer=loaded.tokenizer
    )
    # Teacher forcing feeds [EOS, __de__, pieces] for [__de__, pieces, EOS], as transformers
    # shifts its labels right from decoder_start_token_id; decoding starts at the same EOS
    # (the run's model.bos_id is its tokenizer's: experiment/setup.py).
    assert task.tokenizer.bos_id == loaded.tokenizer.eos_id == loaded.model_config.bos_id
    batch = next(task.train_iterator(1))
    got = []
    for r in range(batch["inputs"].shape[0]):
        for s in set(batch["inputs_segmentation"][r].tolist()) - {0}:
            got.append(
                tuple(
                    tuple(batch[k][r][batch[f"{k}_segmentation"][r] == s].tolist())
                    for k in ("inputs", "targets")
                )
            )
    assert got and set(got) <= want
    train_and_evaluate(config, str(tmp_path / "ft"))
    records = [json.loads(x) for x in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    nll = [r["nll"] for r in records if r.get("split") == "train"]
    assert len(nll) == 4 and nll[-1] < nll[0]  # steps 2, 4, 6, 8


def test_an_imported_multilingual_model_translates_a_corpus_into_the_forced_language(
    m2m_100, tmp_path
):
    """`tx_jax.translate --input --output_dir --target_lang --scores` on an imported M2M100:
    the shards' text equals the stdin mode's translation with the same language tokens (a blank
    line kept), another --target_lang gives other scores (this random model's text barely
    depends on it), and a relaunch into the same directory with another language is refused,
    naming it."""
    _, _, root = m2m_100
    loaded = restore.load(root / "w")
    lines = [*pf.EN[:3], "", *pf.EN[3:6]]
    (tmp_path / "en.txt").write_text("".join(x + "\n" for x in lines))

    def launch(out, lang):
        return subprocess.run(
            [sys.executable, "-m", "tx_jax.translate", f"--workdir={root / 'w'}"]
            + [f"--input={tmp_path / 'en.txt'}", f"--output_dir={out}", "--shard_lines=3"]
            + ["--beam_size=2", "--scores", "--source_lang=en", f"--target_lang={lang}"],
            capture_output=True,
            text=True,
        )

    outputs = {}
    for lang in ("fr", "de"):
        proc = launch(tmp_path / lang, lang)
        assert proc.returncode == 0, proc.stderr[-3000:]
        source, target = languages.prefixes(loaded, "en", lang)
        want = translation.translate_lines(
            loaded, lines, beam_size=2, source_prefix=source, target_prefix=target
        )
        rows = [r.split("\t") for r in (tmp_path / lang / "en.txt").read_text().splitlines()]
        assert [r[0] for r in rows] == want and want[3] == "" and rows[3][1:] == ["nan", "0"]
        outputs[lang] = [float(r[1]) for i, r in enumerate(rows) if i != 3]
    assert all(a != b for a, b in zip(outputs["fr"], outputs["de"])), outputs
    proc = launch(tmp_path / "fr", "de")
    assert proc.returncode == 1 and "target_lang: 'fr' then, 'de' now" in proc.stderr, proc.stderr
