"""A plain-text parallel corpus (tx_jax/data/text_corpus.py, configs/text.py): the file layouts,
preparation keyed by content, cleaning (exact duplicates too), errors, a tokenizer that learns
from every shard, and a run on it from `tx_jax prepare` to a changed test set's score and a
fine-tuning run from it."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pathlib
import random

import numpy as np
import pytest
from forked import run_modules
from helpers import ROOT

from tx_jax.config import apply_overrides, load_config
from tx_jax.data import datasets, streams, tasks, text_corpus
from tx_jax.data import tokenizer as tk
from tx_jax.inference import evaluation, restore, translation
from tx_jax.interop import huggingface
from tx_jax.runner.loop import train_and_evaluate

PAIRS = [(f"s{i} ü “{i % 7}”", f"t{i} ß {i % 5}") for i in range(12)]


def write(path: pathlib.Path, lines: list[str], *, gz: bool = False) -> None:
    """Lines, each ending in a newline, as UTF-8 (gzip when `gz`)."""
    data = "".join(line + "\n" for line in lines).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)


def write_prefix(prefix: pathlib.Path, pairs, langs=("en", "de"), gz=(False, False)) -> None:
    for side, (lang, zipped) in enumerate(zip(langs, gz, strict=True)):
        name = f"{prefix.name}.{lang}" + (".gz" if zipped else "")
        write(prefix.with_name(name), [p[side] for p in pairs], gz=zipped)


def text_data(tmp_path: pathlib.Path, langs=("en", "de"), **splits):
    """configs/text.py:debug's data section reading `splits` (data.train=..., ...), prepared
    in tmp_path/tfds."""
    config = load_config("configs/text.py:debug")
    config.data.source_lang, config.data.target_lang = langs
    config.data.data_dir = str(tmp_path / "tfds")
    for split, spec in splits.items():
        config.data[split] = str(spec)
    return config.data


def read(data, split="train") -> list[tuple[str, str]]:
    return list(datasets.load_split(data, split))


def test_prefixes_shards_gzip_and_tsv_read_the_same_pairs_for_any_language_codes(tmp_path):
    langs = ("x1", "pt_BR")  # codes no list knows: they only name files and features
    write_prefix(tmp_path / "plain" / "train", PAIRS, langs)
    write_prefix(tmp_path / "gz" / "train", PAIRS, langs, gz=(True, False))
    # shards, listed out of order, one gzipped: read sorted by name, paired by name
    write_prefix(tmp_path / "shards" / "part-1", PAIRS[5:], langs, gz=(True, True))
    write_prefix(tmp_path / "shards" / "part-0", PAIRS[:5], langs)
    write(tmp_path / "all.tsv", [f"{a}\t{b}" for a, b in PAIRS])
    bom = tmp_path / "all.tsv"  # Windows' way: a byte order mark and CRLF line ends
    bom.with_name("bom.tsv").write_bytes(b"\xef\xbb\xbf" + bom.read_bytes().replace(b"\n", b"\r\n"))
    write(tmp_path / "all.tsv.gz", [f"{a}\t{b}" for a, b in PAIRS], gz=True)
    specs = [
        tmp_path / "plain" / "train",
        tmp_path / "gz" / "train",
        f"{tmp_path}/shards/part-*",
        tmp_path / "all.tsv",
        tmp_path / "all.tsv.gz",
        tmp_path / "bom.tsv",
    ]
    for spec in specs:
        assert read(text_data(tmp_path, langs, train=spec)) == PAIRS, spec
    shards = text_corpus.resolve(f"{tmp_path}/shards/part-*", "data.train", langs)
    assert [pathlib.Path(s[0]).name for s in shards] == ["part-0.x1", "part-1.x1.gz"]
    assert [pathlib.Path(s[1]).name for s in shards] == ["part-0.pt_BR", "part-1.pt_BR.gz"]


def test_prepared_once_per_content_and_again_when_a_file_changes(tmp_path):
    write_prefix(tmp_path / "c" / "test", PAIRS)
    data = text_data(tmp_path, test=tmp_path / "c" / "test")
    first = datasets.load_split(data, "test")
    root = tmp_path / "tfds" / "text_translation"
    assert [p.name.split("-")[0] for p in root.iterdir()] == ["test"]
    info = next(root.glob("*/1.0.0/dataset_info.json"))
    stamp = info.stat().st_mtime_ns
    assert list(datasets.load_split(data, "test")) == list(first) == PAIRS
    assert len(list(root.iterdir())) == 1 and info.stat().st_mtime_ns == stamp  # reused
    # the same size, one byte different: a new key, prepared anew, the new text read
    changed = [PAIRS[0][0], *[p[0] for p in PAIRS[1:]]]
    changed[3] = changed[3].replace("s3", "S3")
    write(tmp_path / "c" / "test.en", changed)
    again = list(datasets.load_split(data, "test"))
    assert again[3] == ("S3" + PAIRS[3][0][2:], PAIRS[3][1]) and again[:3] == PAIRS[:3]
    assert len(list(root.iterdir())) == 2
    assert datasets.unprepared_bytes(data, "test") == 0


def test_cleaning_drops_empty_pairs_everywhere_and_long_or_skewed_train_pairs(tmp_path, capsys):
    pairs = [
        ("a short one", "ein kurzer"),
        ("   ", "leer"),  # an empty side (whitespace only): dropped in every split
        ("x" * 40, "y" * 40),  # longer than max_chars=30: dropped from train only
        ("one", "one two three four five six"),  # ratio 9 > 3: dropped from train only
        ("kept", ""),
        ("last", "letzte"),
    ]
    write_prefix(tmp_path / "c" / "train", pairs)
    write_prefix(tmp_path / "c" / "dev", pairs)
    data = text_data(tmp_path, train=tmp_path / "c" / "train", validation=tmp_path / "c" / "dev")
    data.clean.max_chars, data.clean.max_ratio = 30, 3.0
    assert read(data) == [pairs[0], pairs[5]]
    assert read(data, "validation") == [pairs[0], pairs[2], pairs[3], pairs[5]]
    out = capsys.readouterr().out
    assert (
        "text corpus data.train (1 shard(s)): 6 pairs read, 2 with an empty side dropped, "
        "1 longer than 30 characters dropped, 1 with a length ratio over 3 dropped, 2 kept"
    ) in out
    assert "data.validation (1 shard(s)): 6 pairs read, 2 with an empty side dropped, 4 kept" in out
    # the counts are kept with the data: a run that reuses it logs them too
    builder = text_corpus.make_builder(
        "text",
        source_lang="en",
        target_lang="de",
        data_dir=data.data_dir,
        builder_kwargs={**text_corpus.config_builder_kwargs(data), "split": "train"},
    )
    assert builder.info.metadata["counts"] == {
        "read": 6,
        "empty": 2,
        "too_long": 1,
        "ratio": 1,
        "kept": 2,
    }


def _builder(data, split: str) -> text_corpus.TextTranslation:
    return text_corpus.make_builder(
        "text",
        source_lang=data.source_lang,
        target_lang=data.target_lang,
        data_dir=data.data_dir,
        builder_kwargs={**text_corpus.config_builder_kwargs(data), "split": split},
    )


def test_dedup_drops_repeated_train_pairs_only_and_counts_them(tmp_path, capsys):
    first = [
        ("a cat", "eine Katze"),
        ("a cat", "eine Katze"),  # a duplicate
        ("a cat", "die Katze"),  # the same source, another target: kept
        ("  ", "leer"),  # an empty side: dropped as empty
        ("  ", "leer"),  # ... and again as empty, not as a duplicate
    ]
    second = [("a dog", "ein Hund"), ("a cat", "eine Katze")]  # a duplicate across shards
    write_prefix(tmp_path / "c" / "part-0", first)
    write_prefix(tmp_path / "c" / "part-1", second)
    write_prefix(tmp_path / "c" / "dev", first + second)
    spec = f"{tmp_path}/c/part-*"
    data = text_data(tmp_path, train=spec, validation=tmp_path / "c" / "dev")
    assert data.clean.dedup is False  # configs/text.py: off unless asked for
    data.clean.dedup = True
    assert read(data) == [first[0], first[2], second[0]]
    assert read(data, "validation") == [*first[:3], *second]  # evaluation splits: every pair
    out = capsys.readouterr().out
    assert (
        "text corpus data.train (2 shard(s)): 7 pairs read, 2 with an empty side dropped, "
        "2 duplicates dropped, 3 kept"
    ) in out
    assert "data.validation (1 shard(s)): 7 pairs read, 2 with an empty side dropped, 5 kept" in out
    assert _builder(data, "train").info.metadata["counts"] == {
        "read": 7,
        "empty": 2,
        "too_long": 0,
        "ratio": 0,
        "duplicate": 2,
        "kept": 3,
    }
    assert "duplicate" not in _builder(data, "validation").info.metadata["counts"]
    assert text_corpus.pair_hash("a", "b\tc") != text_corpus.pair_hash("a\tb", "c")


def test_dedup_off_keeps_every_prepared_corpus_digest(tmp_path):
    """The split's name (its digest) is what it was before dedup existed unless dedup is on,
    so corpora prepared before are reused."""
    write_prefix(tmp_path / "c" / "train", PAIRS)
    langs, spec = ("en", "de"), str(tmp_path / "c" / "train")
    ids = [(os.path.basename(f), *text_corpus.content_id(f)) for f in (f"{spec}.en", f"{spec}.de")]
    fingerprint = {
        "split": "train",
        "languages": langs,
        "files": ids,
        "filters": {"max_chars": 0, "max_ratio": 0.0},
    }
    before = "train-" + hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    name = {
        str(clean): text_corpus.split_config("train", spec, langs, clean).name
        for clean in ({}, {"max_chars": 0, "max_ratio": 0.0, "dedup": False}, {"dedup": True})
    }
    assert list(name.values())[:2] == [before[:22]] * 2
    assert name[str({"dedup": True})] != before[:22]
    assert text_corpus.split_config("train", spec, langs, {"dedup": True}).dedup is True
    valid = text_corpus.split_config("validation", spec, langs, {"dedup": True})
    assert not valid.dedup
    assert valid.name == text_corpus.split_config("validation", spec, langs, {}).name
    m30k = load_config("configs/multi30k.py:reader=text").data.clean
    assert m30k.to_dict() == {"max_chars": 0, "max_ratio": 0.0, "dedup": False}


def test_the_tokenizer_learns_from_every_shard_not_the_head(tmp_path):
    """A corpus of four shards whose last alone has 'ж': with data.tokenizer_pairs a sixth of
    it, the tokenizer (a sample over all shards) encodes 'ж' without <unk>; the first
    tokenizer_pairs pairs (the rule before) lack it, and a tokenizer of them gives <unk>."""
    rng = random.Random(0)
    english = ["a", "the", "cat", "dog", "sat", "on", "red", "blue", "house", "tree"]
    german = ["ein", "der", "Katze", "Hund", "sass", "auf", "rot", "blau", "Haus", "Baum"]

    def pair(last: bool) -> tuple[str, str]:
        k = [rng.randrange(10) for _ in range(rng.randint(2, 6))]
        target = " ".join(german[i] for i in k)
        return " ".join(english[i] for i in k), target + (" жар" if last else "")

    for shard in range(4):
        pairs = [pair(shard == 3) for _ in range(300)]
        write_prefix(tmp_path / "c" / f"part-{shard}", pairs, gz=(shard % 2 == 1, False))
    write_prefix(tmp_path / "c" / "dev", [pair(False) for _ in range(8)])
    data = text_data(tmp_path, train=f"{tmp_path}/c/part-*", validation=tmp_path / "c" / "dev")
    data.tokenizer_pairs = 200
    assert data.tokenizer.byte_fallback is False  # the debug variant: 'ж' is a piece or <unk>
    task = tasks.prepare_task(data, tmp_path / "run", seed=0)
    train = task.splits["train"]
    assert len(train) == 1200
    head = list(train)[:200]  # what the tokenizer learnt from before: shard 0's pairs
    assert not any("ж" in s + t for s, t in head)
    drawn = streams.Sample(train, 200, seed=0).indices
    assert (np.bincount(drawn // 300, minlength=4) > 20).all()  # ~50 from every shard
    sentence = "ein жар Haus"
    ids = task.tokenizer.encode(sentence)
    assert tk.UNK_ID not in ids and task.tokenizer.decode(ids) == sentence
    assert any("ж" in task.tokenizer.id_to_piece(i) for i in ids)
    old = tk.train_tokenizer(tk.iter_pair_texts(head), data.vocab_size, tmp_path / "old.model")
    assert tk.UNK_ID in old.encode(sentence)


def bad_corpora(tmp_path: pathlib.Path) -> dict[str, tuple[dict, str]]:
    """name -> (the splits' specs, the message expected)."""
    c = tmp_path / "bad"
    write_prefix(c / "short", PAIRS)
    write(c / "short.de", [p[1] for p in PAIRS[:-2]])
    write(c / "tabs.tsv", ["a\tb", "c\td", "e\tf\tg"])
    write(c / "none.tsv", ["a\tb", "no tab here"])
    write_prefix(c / "latin1", PAIRS[:3])
    (c / "latin1.en").write_bytes(b"ok\nbad \xe9t\xe9\nok\n")
    write_prefix(c / "half-0", PAIRS[:3])
    write(c / "half-1.en", ["alone"])
    return {
        "counts": (
            {"train": c / "short"},
            f"data.train: line counts differ: {c}/short.en has 12 lines but {c}/short.de has 10",
        ),
        "tabs": ({"train": c / "tabs.tsv"}, f"{c}/tabs.tsv line 3: 2 tabs"),
        "no tab": ({"validation": c / "none.tsv"}, f"{c}/none.tsv line 2: 0 tabs"),
        "utf-8": ({"train": c / "latin1"}, f"{c}/latin1.en line 2: not UTF-8 (byte 0xe9"),
        "missing": (
            {"train": c / "nowhere"},
            f"data.train='{c}/nowhere': no file {c}/nowhere.en[.gz] or {c}/nowhere.de[.gz]",
        ),
        "partner": (
            {"train": f"{c}/half-*"},
            f"{c}/half-1.en has no partner {c}/half-1.de[.gz]",
        ),
    }


def test_bad_input_names_the_file_line_and_key_and_leaves_nothing_prepared(tmp_path):
    for name, (splits, message) in bad_corpora(tmp_path).items():
        data = text_data(tmp_path, **splits)
        split = next(iter(splits))
        with pytest.raises(text_corpus.CorpusError) as e:
            datasets.load_split(data, split)
        assert message in str(e.value), name
        assert f"data.{split}" in str(e.value), name
    # a run without a validation split is refused before anything is prepared
    config = load_config("configs/text.py:debug")
    config.data.train = str(tmp_path / "bad" / "tabs.tsv")
    with pytest.raises(text_corpus.CorpusError, match=r"data.validation is not set: give"):
        train_and_evaluate(config, tmp_path / "refused")
    # nothing a rerun would take for prepared data, not even a partial directory
    assert not list((tmp_path / "tfds").rglob("dataset_info.json"))
    assert not [p for p in (tmp_path / "tfds").rglob("*") if p.is_file()]
    data = text_data(tmp_path, train=tmp_path / "bad" / "tabs.tsv")
    write(tmp_path / "bad" / "tabs.tsv", ["a\tb", "c\td", "e\tf"])  # mended: prepared now
    assert read(data) == [("a", "b"), ("c", "d"), ("e", "f")]


def test_the_commands_say_bad_input_in_one_line_and_exit_1(tmp_path):
    corpora = bad_corpora(tmp_path)
    commands, names = [], ["counts", "utf-8"]
    good = tmp_path / "good.tsv"
    write(good, [f"{a}\t{b}" for a, b in PAIRS])
    for verb, name in zip(("train", "prepare"), names, strict=True):
        ((split, spec),) = corpora[name][0].items()
        commands.append(
            (
                "tx_jax",
                [
                    verb,
                    "--config=configs/text.py:debug",
                    f"--workdir={tmp_path / name}",
                    f"--config.data.{split}={spec}",
                    f"--config.data.validation={good}",
                    f"--config.data.data_dir={tmp_path / 'tfds'}",
                ],
            )
        )
    for (code, out, err), name in zip(run_modules(commands, cwd=ROOT), names, strict=True):
        assert code == 1, (out, err)
        assert "Traceback" not in err, err
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and corpora[name][1] in errors[0], err


def test_prepare_then_train_evaluate_a_changed_test_set_and_fine_tune(tmp_path, capsys):
    """`tx_jax prepare` makes the data and the tokenizer; the run then prepares nothing; its
    test score follows the test files (a changed file is read anew); translate and export read
    it; train.init_from starts a second run from it."""
    corpus = tmp_path / "corpus"
    words = ["red", "blue", "cat", "dog", "big", "small", "house", "tree"]
    german = ["rot", "blau", "Katze", "Hund", "gross", "klein", "Haus", "Baum"]
    pairs = [
        (
            " ".join(words[(i * k) % 8] for k in range(1, 4)),
            " ".join(german[(i * k) % 8] for k in range(1, 4)),
        )
        for i in range(64)
    ]
    write_prefix(corpus / "train", pairs, gz=(True, True))
    write(corpus / "dev.tsv", [f"{a}\t{b}" for a, b in pairs[:16]])
    write_prefix(corpus / "test", pairs[16:32])
    workdir = tmp_path / "run"
    flags = {
        "data.train": str(corpus / "train"),
        "data.validation": str(corpus / "dev.tsv"),
        "data.test": str(corpus / "test"),
        "data.data_dir": str(tmp_path / "tfds"),
        "data.vocab_size": 40,
        "eval.bleu_examples": 16,
        "eval.score_test": True,
        "train.num_steps": 4,
        "eval.every": 4,
    }
    ((code, out, err),) = run_modules(
        [
            (
                "tx_jax",
                ["prepare", "--config=configs/text.py:debug", f"--workdir={workdir}"]
                + [f"--config.{k}={v}" for k, v in flags.items()],
            )
        ],
        cwd=ROOT,
    )
    assert code == 0, err
    assert f"data: text train: 64 pairs in {tmp_path / 'tfds'}" in out
    assert "data: text validation: 16 pairs" in out and "data: text test: 16 pairs" in out
    assert f"tokenizer: {workdir / 'tokenizer.model'} (40 pieces)" in out
    prepared = sorted(p.name for p in (tmp_path / "tfds" / "text_translation").iterdir())
    assert [p.split("-")[0] for p in prepared] == ["test", "train", "validation"]

    config = load_config("configs/text.py:debug")
    apply_overrides(config, flags)
    train_and_evaluate(config, workdir)
    again = sorted(p.name for p in (tmp_path / "tfds" / "text_translation").iterdir())
    assert again == prepared  # the run found everything prepared
    out = capsys.readouterr().out
    assert "text corpus data.train (1 shard(s)): 64 pairs read" in out  # logged on reuse too
    assert "test_bleu: " in out

    before = evaluation.evaluate(workdir, split="test", beam_size=1, write=False)
    write(corpus / "test.de", ["völlig anders"] * 16)  # new references: a new score
    after = evaluation.evaluate(workdir, split="test", beam_size=1, write=False)
    assert (after["bleu"], after["chrf"]) != (before["bleu"], before["chrf"]), (before, after)
    assert len(list((tmp_path / "tfds" / "text_translation").iterdir())) == 4

    # translation and export read the run as any other: its tokenizer and checkpoint
    hypotheses = translation.translate(["red cat", "big house"], workdir, beam_size=1)
    assert len(hypotheses) == 2 and all(isinstance(h, str) for h in hypotheses)
    huggingface.export(restore.load(workdir), tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()

    tuned = load_config("configs/text.py:debug")  # and without a test split: no test score
    rest = {k: v for k, v in flags.items() if k != "data.test"}
    apply_overrides(tuned, {**rest, "train.init_from": str(workdir), "train.num_steps": 2})
    capsys.readouterr()
    train_and_evaluate(tuned, tmp_path / "tuned")
    out = capsys.readouterr().out
    assert "no test score: the data names no files for the test split 'test'" in out
    assert "test_bleu" not in out
    assert (tmp_path / "tuned" / "tokenizer.model").read_bytes() == (
        workdir / "tokenizer.model"
    ).read_bytes()
