"""`tx_jax import` end to end: a Hugging Face directory built here with transformers'
own classes (tiny random weights, SentencePiece models trained in the test) becomes a
workdir that restore, score, translate and fine-tuning read as any run's."""

import gzip
import json
import pathlib
import shutil

import forked
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

ROOT = pathlib.Path(__file__).resolve().parent.parent


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


@pytest.fixture(scope="module")
def m2m_100(tmp_path_factory):
    root = tmp_path_factory.mktemp("m2m_100")
    model, tok = pf.m2m_100_dir(root / "hf")
    _import(root / "hf", root / "w")
    return model, tok, root


def _multi30k_files(directory, n=48):
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", n), ("val", 8), ("test_2016_flickr", 8)):
        for lang, lines in (("en", pf.EN), ("de", pf.DE)):
            with gzip.open(directory / f"{prefix}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.writelines(lines[i % len(lines)] + "\n" for i in range(count))
    return directory


@pytest.fixture(scope="module")
def multi30k(tmp_path_factory):
    """(raw files, TFDS data dir) of a small Multi30k, prepared once for this file's runs."""
    d = tmp_path_factory.mktemp("multi30k")
    return _multi30k_files(d / "raw"), d / "tfds"


CORPUS = [*pf.EN[:3], "", *pf.EN[3:6]]  # the multilingual corpus test's input (a blank line)


@pytest.fixture(scope="module")
def cli(marian, m2m_100, multi30k, tmp_path_factory):
    """This file's command lines, each `python -m` forked from one interpreter (forked.py),
    in this order -> (the directory of their files, {name: (exit code, stdout, stderr)})."""
    d = tmp_path_factory.mktemp("cli")
    mw, w = marian[2] / "w", m2m_100[2] / "w"
    (d / "src").write_text("\n".join(pf.EN[:3]) + "\n")
    (d / "tgt").write_text("\n".join(pf.DE[:3]) + "\n")
    (d / "en.txt").write_text("".join(x + "\n" for x in CORPUS))
    for name in ("export", "attention"):
        (d / name).mkdir()
    data = {"data.dataset": "multi30k", "data.manual_dir": str(multi30k[0])}
    data["data.data_dir"] = str(multi30k[1])
    data_flags = [f"--config.{k}={v}" for k, v in data.items()]

    def corpus(out, lang):
        return (
            "tx_jax",
            ["translate", f"--workdir={w}", f"--input={d / 'en.txt'}", f"--output_dir={out}"]
            + ["--shard_lines=3", "--beam_size=2", "--scores", "--source_lang=en"]
            + [f"--target_lang={lang}"],
        )

    commands = {
        "score": (
            "tx_jax",
            ["score", "--workdir", str(mw), "--source", str(d / "src")]
            + ["--target", str(d / "tgt")],
        ),
        "export": ("tx_jax", ["export", f"--workdir={mw}", f"--out={d / 'export'}"]),
        "evaluate": (
            "tx_jax",
            [
                "evaluate",
                f"--workdir={mw}",
                "--split=test_2016_flickr",
                "--beam_size=1",
                *data_flags,
            ],
        ),
        "attention": (
            "tx_jax",
            [
                "visualize",
                "attention",
                f"--workdir={mw}",
                f"--source={pf.EN[1]}",
                f"--target={pf.DE[1]}",
            ]
            + [f"--out={d / 'attention'}"],
        ),
        "translate": (
            "tx_jax",
            [
                "translate",
                f"--workdir={w}",
                "--beam_size=1",
                "--source_lang=en",
                "--target_lang=fr",
            ],
            "\n".join(pf.EN) + "\n",
        ),
        "evaluate_xx": ("tx_jax", ["evaluate", f"--workdir={w}", "--target_lang=xx", *data_flags]),
        "corpus_fr": corpus(d / "fr", "fr"),
        "corpus_de": corpus(d / "de", "de"),
        "corpus_fr_again_as_de": corpus(d / "fr", "de"),  # a relaunch: refused
    }
    runs = forked.run_modules(list(commands.values()), cwd=ROOT, timeout=1200)
    return d, dict(zip(commands, runs, strict=True))


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


def test_score_cli_one_line_per_pair(marian, cli):
    model, tok, _ = marian
    code, out, err = cli[1]["score"]
    assert code == 0, err[-3000:]
    out = out.splitlines()
    want, count = _hf_logprobs(model, tok, pf.EN[:3], pf.DE[:3])
    assert len(out) == 3
    for line, w, n in zip(out, want, count, strict=True):
        logprob, tokens = line.split("\t")
        assert float(logprob) == pytest.approx(w, rel=1e-4) and int(tokens) == n


def test_m2m_100_scores_skip_the_forced_language_token(m2m_100):
    model, tok, root = m2m_100
    loaded = restore.load(root / "w")
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


def test_finetuning_an_imported_model_lowers_the_loss(marian, multi30k, tmp_path):
    from tx_jax.runner.loop import train_and_evaluate

    _, _, root = marian
    spec = f"configs/finetune.py:init_from={root / 'w'},debug"
    config = load_config(spec)
    config.data.manual_dir, config.data.data_dir = map(str, multi30k)
    config.train.num_steps = 8
    config.train.peak_lr = 3e-3
    assert config.model.sinusoid_style == "marian" and config.train.init_from == str(root / "w")
    train_and_evaluate(config, str(tmp_path / "ft"))
    records = [json.loads(x) for x in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    nll = [r["nll"] for r in records if r.get("split") == "train"]
    assert len(nll) == 4 and nll[-1] < nll[0]  # steps 2, 4, 6, 8


def test_lora_on_an_imported_model_exports_a_merged_marian(marian, multi30k, tmp_path):
    """LoRA on an imported Marian: the adapters alone train; the merged export is a Marian
    directory whose transformers scores are the adapted run's, only its projections changed,
    and the PEFT export on the original model scores the same."""
    from safetensors.numpy import load_file

    from tx_jax.interop import adapters, huggingface
    from tx_jax.runner.loop import train_and_evaluate

    model, tok, root = marian
    config = load_config(f"configs/finetune.py:init_from={root / 'w'},debug")
    config.data.manual_dir, config.data.data_dir = map(str, multi30k)
    config.train.num_steps = 4
    config.train.peak_lr = 3e-2  # 4 updates of B from 0 must move the scores
    config.train.lora.rank = 4
    train_and_evaluate(config, str(tmp_path / "ft"))
    adapted = restore.load(tmp_path / "ft")
    scores = likelihood.score_pairs(adapted, pf.EN, pf.DE, batch_size=3)
    got = np.array([s.logprob for s in scores])
    out = huggingface.export(
        restore.merged(adapted), tmp_path / "hf", hf_config=adapted.tokenizer.hf_config
    )
    exported = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(out)).eval()
    want, count = _hf_logprobs(exported, tok, pf.EN, pf.DE)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert [s.tokens for s in scores] == count.tolist()
    before, _ = _hf_logprobs(model, tok, pf.EN, pf.DE)
    assert np.abs(got - before).max() > 1e-2  # the adapters are in the export
    source, merged = (
        load_file(root / "hf" / "model.safetensors"),
        load_file(out / "model.safetensors"),
    )
    assert sorted(merged) == sorted(source)
    changed = {k for k in source if not np.array_equal(source[k], merged[k])}
    projections = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight")
    assert changed and all(k.endswith((*projections, "fc1.weight", "fc2.weight")) for k in changed)
    assert all(merged[k].dtype == source[k].dtype for k in source)
    # the adapters alone for PEFT, on the model it was imported from: the same scores
    peft = pytest.importorskip("peft")
    adapters.write_peft(adapted, tmp_path / "peft", adapted.tokenizer.hf_config)
    tuned = peft.PeftModel.from_pretrained(model, str(tmp_path / "peft")).eval()
    np.testing.assert_allclose(_hf_logprobs(tuned, tok, pf.EN, pf.DE)[0], got, rtol=1e-4)


def test_export_of_the_import_gives_back_the_source(marian, cli):
    from safetensors.numpy import load_file

    _, _, root = marian
    code, _, err = cli[1]["export"]
    assert code == 0, err[-3000:]
    tmp_path = cli[0] / "export"
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


def test_evaluate_cli_on_a_dataset_named_by_overrides(cli):
    code, out, err = cli[1]["evaluate"]
    assert code == 0, err[-2000:]
    assert "BLEU" in out + err


def test_m2m_100_translates_into_the_forced_language_as_generate(m2m_100, cli):
    from tx_jax.interop import pretrained

    model, tok, root = m2m_100
    loaded = restore.load(root / "w")
    source, target = languages.prefixes(loaded, "en", "fr")
    assert target == [loaded.tokenizer.language_id("fr")]
    perm = pretrained.vocab_permutation(model.config.to_dict())
    tok.src_lang = "en"
    # One 0-padded batch of the four lines (one compilation): each row's limit is its own.
    rows = [
        [*source, *loaded.tokenizer.encode(line), loaded.tokenizer.eos_id] for line in pf.EN[:4]
    ]
    batch = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for r, ids in enumerate(rows):
        batch[r, : len(ids)] = ids
    decoded = decoding.translate_greedy(
        loaded.model_config,
        loaded.params,
        batch,
        eos_id=loaded.tokenizer.eos_id,
        prompt=np.full((len(rows), 1), target[0], np.int32),
    )
    for line, ids, ours in zip(pf.EN[:4], rows, np.asarray(decoded), strict=True):
        ours = [int(i) for i in ours if i != 0]
        enc = tok([line], return_tensors="pt")
        assert [int(perm[i]) for i in enc["input_ids"][0]] == ids
        limit = len(ids) + 50  # the forced token counts in both limits
        out = model.generate(
            **enc, forced_bos_token_id=tok.get_lang_id("fr"), max_new_tokens=limit + 1
        )
        theirs = [int(perm[i]) for i in out[0, 1:]]  # without the decoder's start token
        assert theirs[0] == target[0]
        assert ours == theirs[: len(ours)] and len(theirs) - len(ours) in (0, 1)  # + forced EOS
    code, out, err = cli[1]["translate"]
    assert code == 0, err[-3000:]
    want = translation.translate_lines(
        loaded, pf.EN, beam_size=1, source_prefix=source, target_prefix=target
    )
    assert out.splitlines() == want and len(want) == len(pf.EN)


def test_attention_maps_of_an_imported_model(cli):
    code, _, err = cli[1]["attention"]
    assert code == 0, err[-3000:]
    tmp_path = cli[0] / "attention"
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs and all((tmp_path / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_evaluate_m2m_100_forces_the_target_language(m2m_100, cli, multi30k, monkeypatch):
    from tx_jax.inference import evaluation

    _, _, root = m2m_100
    w, (raw, data_dir) = root / "w", multi30k
    data = {"data.dataset": "multi30k", "data.manual_dir": str(raw)}
    data["data.data_dir"] = str(data_dir)
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
    code, _, err = cli[1]["evaluate_xx"]  # the same flags, on the command line
    assert code != 0
    assert "error: language 'xx' is not one of this m2m_100 model's 100" in err


def test_finetuning_m2m_100_trains_the_language_tokens_and_lowers_the_loss(
    m2m_100, multi30k, tmp_path
):
    from tx_jax.data import tasks
    from tx_jax.interop import pretrained
    from tx_jax.runner.loop import train_and_evaluate

    _, tok, root = m2m_100
    config = load_config(f"configs/finetune.py:init_from={root / 'w'},debug")
    config.data.manual_dir, config.data.data_dir = map(str, multi30k)
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
    task = tasks.prepare_task(
        config.data, tmp_path / "peek", seed=config.seed, tokenizer=loaded.tokenizer
    )
    # Teacher forcing feeds [EOS, __de__, pieces] for [__de__, pieces, EOS], as transformers
    # shifts its labels right from decoder_start_token_id; decoding starts at the same EOS
    # (the run's model.bos_id is its tokenizer's: runner/setup.py).
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


def test_an_imported_multilingual_model_translates_a_corpus_into_the_forced_language(m2m_100, cli):
    """`tx_jax translate --input --output_dir --target_lang --scores` on an imported M2M100:
    the shards' text equals the stdin mode's translation with the same language tokens (a blank
    line kept), another --target_lang gives other scores (this random model's text barely
    depends on it), and a relaunch into the same directory with another language is refused,
    naming it."""
    _, _, root = m2m_100
    loaded = restore.load(root / "w")
    lines, (tmp_path, runs) = CORPUS, cli
    outputs = {}
    for lang in ("fr", "de"):
        code, _, err = runs[f"corpus_{lang}"]
        assert code == 0, err[-3000:]
        source, target = languages.prefixes(loaded, "en", lang)
        want = translation.translate_lines(
            loaded, lines, beam_size=2, source_prefix=source, target_prefix=target
        )
        rows = [r.split("\t") for r in (tmp_path / lang / "en.txt").read_text().splitlines()]
        assert [r[0] for r in rows] == want and want[3] == "" and rows[3][1:] == ["nan", "0"]
        outputs[lang] = [float(r[1]) for i, r in enumerate(rows) if i != 3]
    assert all(a != b for a, b in zip(outputs["fr"], outputs["de"])), outputs
    code, _, err = runs["corpus_fr_again_as_de"]  # relaunched into fr's directory
    assert code == 1 and "target_lang: 'fr' then, 'de' now" in err, err
