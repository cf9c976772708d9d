"""Multilingual training end to end: directions and tags, a shared vocabulary, the tag routes
the output language, zero-shot and pivot evaluation, init_from, max_train_pairs, and the
configs/multilingual.py debug variant, on a Multi30k-shaped fixture written here.

The fixture corpus translates word for word between three invented lexicons with disjoint
words (en, de, fr), so the language of a hypothesis is read off its words. One tiny model is
trained on en<->de and en<->fr for the module; the tests read it or start from it.
"""

import collections
import gzip
import json
import pathlib
import random
import sys

import jax
import numpy as np
import pytest
from helpers import ROOT, train_losses

from tx_jax.data import directions, tasks
from tx_jax.data.tokenizer import Tokenizer, train_tokenizer
from tx_jax.inference import evaluation, multilingual, restore
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.setup import build_run, restore_or_init, size_from_data
from tx_jax.runner.validation import validate_config
from tx_jax.training.checkpoint import Checkpointer

sys.path.insert(0, str(ROOT / "configs"))
import multilingual as multilingual_config  # noqa: E402

REAL_CORPUS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
WORDS = {
    "en": "man woman dog cat house tree car boat red blue green small big runs sits eats",
    "de": "mann frau hund katze haus baum auto boot rot blau gruen klein gross laeuft sitzt isst",
    "fr": "homme femme chien chat maison arbre voiture bateau rouge bleu vert petit grand court "
    "assis mange",
}
LEXICON = {lang: words.split() for lang, words in WORDS.items()}
SPLITS = {"train": 600, "val": 40, "test_2016_flickr": 40}
STEPS = 120


def write_fixture(directory: pathlib.Path) -> pathlib.Path:
    """{split}.{lang}.gz for en/de/fr: line i of every language is the same word indices."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for prefix, n in SPLITS.items():
        sentences = [[rng.randrange(16) for _ in range(rng.randint(3, 6))] for _ in range(n)]
        for lang, words in LEXICON.items():
            with gzip.open(directory / f"{prefix}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.writelines(" ".join(words[i] for i in s) + "\n" for s in sentences)
    return directory


def language_of(text: str) -> str | None:
    """The lexicon most words of `text` come from (None if no word is in any)."""
    votes = collections.Counter(
        lang for word in text.split() for lang, words in LEXICON.items() if word in words
    )
    return votes.most_common(1)[0][0] if votes else None


def debug_config(tfds_dir, raw_dir, arg="debug"):
    """configs/multilingual.py:<arg> reading the fixture."""
    c = multilingual_config.get_config(arg)
    c.data.data_dir, c.data.manual_dir = str(tfds_dir), str(raw_dir)
    return c


def config(tfds_dir, raw_dir, **overrides):
    """The debug config on the fixture, a little wider and with a constant learning rate (it
    learns the fixture in ~100 steps), a whole-word vocabulary, short rows; `overrides`."""
    c = debug_config(tfds_dir, raw_dir)
    c.model.update(d_model=64, d_ff=128)
    c.train.update(schedule="constant", peak_lr=3e-3, warmup_steps=10, num_steps=8, log_every=1)
    c.data.vocab_size = 100  # 48 words, 3 tags, 4 reserved ids, the characters
    c.data.tokenizer_pairs = 600
    c.data.max_train_len = c.data.max_eval_len = 16
    c.data.bucket_boundaries = [16]
    c.data.tokens_per_batch = 512  # 32 packed rows of 16
    c.eval.update(every=1000, bleu_examples=8, score_test=False)
    c.checkpoint.update(every=1000, async_save=False)
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory):
    return write_fixture(tmp_path_factory.mktemp("raw"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, data_dir, raw_dir):
    """The module's model: en<->de and en<->fr, uniform mixture, de-fr decoded as extra."""
    path = tmp_path_factory.mktemp("multilingual") / "run"
    c = config(
        data_dir,
        raw_dir,
        **{"train.num_steps": STEPS, "eval.every": STEPS, "data.extra_eval_directions": "de-fr"},
    )
    train_and_evaluate(c, path)
    return path


@pytest.fixture(scope="module")
def loaded(workdir):
    return restore.load(workdir)


# ---------------------------------------------------------------------- pure pieces


def test_directions_and_tags():
    assert directions.parse_directions("en-de,de-en") == [("en", "de"), ("de", "en")]
    assert directions.parse_directions("en-de+fr-en") == [("en", "de"), ("fr", "en")]
    assert directions.parse_directions(["en-de", " cs-fr "]) == [("en", "de"), ("cs", "fr")]
    assert directions.parse_directions("") == [] and directions.lang_tag("de") == "<2de>"
    for bad, match in [
        ("en-en", "two different"),
        ("ende", "not SRC-TGT"),
        ("en-de,en-de", "appears twice"),
        ("en-de-fr", "not SRC-TGT"),
    ]:
        with pytest.raises(ValueError, match=f"data.directions='{bad}'.*{match}"):
            directions.parse_directions(bad)
    c = multilingual_config.get_config("directions=en-de+de-en,extra=de-fr+en-de")
    assert (c.data.directions, c.data.extra_eval_directions) == ("en-de,de-en", "de-fr,en-de")
    assert directions.extra_directions(c.data) == [("de", "fr")]  # en-de is trained already
    assert directions.tag_languages(c.data) == ["de", "en", "fr"]
    for key, value, match in [
        ("mixture", "zipf", "data.mixture='zipf'"),
        ("temperature", -1.0, "data.temperature=-1"),
        ("max_train_pairs", -5, "data.max_train_pairs=-5"),
        ("directions", "en-de,xx", "'xx' is not SRC-TGT"),
    ]:
        bad = multilingual_config.get_config("debug")
        bad.data[key] = value
        with pytest.raises(ValueError, match=match):
            validate_config(bad)


# ---------------------------------------------------------------------- the trained model


def test_shared_tokenizer_has_the_tags_as_single_pieces(workdir, loaded):
    tok = loaded.tokenizer
    assert [tok.id_to_piece(i) for i in (4, 5, 6)] == ["<2de>", "<2en>", "<2fr>"]
    words = [w for lexicon in LEXICON.values() for w in lexicon]
    assert all(len(tok.encode(w)) == 1 for w in words)  # one vocabulary for every language
    assert Tokenizer.load(workdir / "tokenizer.model") == tok
    # the validation BLEU of every direction, the mean of the trained ones as 'bleu'
    records = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["split"] == "validation"][-1]
    trained = ["en-de", "de-en", "en-fr", "fr-en"]
    assert {f"bleu/{d}" for d in [*trained, "de-fr"]} <= set(val)
    assert val["bleu"] == pytest.approx(np.mean([val[f"bleu/{d}"] for d in trained]))
    assert val["bleu/en-de"] > 40, val  # it learned: word-for-word translation
    train_record = [r for r in records if r["split"] == "train"][-1]
    drawn = [train_record[f"data_kept/{d}"] for d in trained]
    assert sum(drawn) == train_record["data_kept"] and min(drawn) > 0.2 * sum(drawn)


def test_the_tag_routes_the_output_language(loaded):
    """The same English sources, tagged <2de> or <2fr>: German or French words come out."""
    task = tasks.direction_task(loaded.config.data, loaded.tokenizer, 0, "en-de")
    sources = [s for s, _ in task.pairs("test")]
    for lang in ("de", "fr"):
        hyps = multilingual.translate_to(loaded, sources, lang, beam_size=1)
        right = sum(language_of(h) == lang for h in hyps)
        assert right >= 0.9 * len(sources), (lang, right, hyps[:5])


def test_zero_shot_direct_and_through_a_pivot(loaded, workdir):
    """de->fr was never trained: directly (the <2fr> tag on German) and through English."""
    direct = multilingual.measure_direction(loaded, "de-fr", split="test", beam_size=1)
    pivot = multilingual.measure_direction(loaded, "de-fr", split="test", beam_size=1, pivot="en")
    assert len(direct.hypotheses) == len(pivot.hypotheses) == SPLITS["test_2016_flickr"]
    assert direct.sources[0].split()[0] in LEXICON["de"]
    assert direct.references[0].split()[0] in LEXICON["fr"]
    assert pivot.signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")
    french = sum(language_of(h) == "fr" for h in pivot.hypotheses)
    assert french >= 0.9 * len(pivot.hypotheses)  # two supervised legs
    assert 0 <= direct.bleu <= 100 and pivot.bleu > 10, (direct.bleu, pivot.bleu)
    # the evaluate library and CLI path: the same hypotheses, a record per direction
    record = evaluation.evaluate(workdir, direction="de-fr", pivot="en", beam_size=1)
    assert (record["direction"], record["pivot"], record["bleu"]) == ("de-fr", "en", pivot.bleu)
    assert record["hypotheses"].endswith(f"test_de-fr_via-en_step{STEPS}_beam1.txt")
    assert pathlib.Path(record["hypotheses"]).read_text().splitlines() == pivot.hypotheses
    direct_record = evaluation.evaluate(workdir, direction="de-fr", beam_size=1, write=False)
    assert direct_record["bleu"] == pytest.approx(direct.bleu)
    records = evaluation.evaluate_directions(
        workdir, split="validation", beam_size=1, limit=8, write=False
    )
    assert [r["direction"] for r in records] == ["en-de", "de-en", "en-fr", "fr-en"]
    with pytest.raises(restore.CheckpointError, match="is multilingual .*give a direction"):
        evaluation.evaluate(workdir, write=False)
    with pytest.raises(ValueError, match="no piece <2cs>"):
        multilingual.translate_to(loaded, ["mann"], "cs")


# ---------------------------------------------------------------------- transfer


def _params(tree):
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def test_init_from_loads_the_same_parameters(workdir, loaded, data_dir, raw_dir, tmp_path):
    """A low-resource en-fr run starting from the multilingual model: its parameters at step 0
    are the checkpoint's, bit for bit; optimizer fresh; its tokenizer is the checkpoint's."""
    c = config(
        data_dir,
        raw_dir,
        **{
            "data.directions": "en-fr",
            "train.init_from": str(workdir),
            "data.max_train_pairs": 50,
            "train.num_steps": 4,
        },
    )
    run = build_run(size_from_data(c, tmp_path / "ft"))
    assert run.task.tokenizer == loaded.tokenizer  # reused, not trained on de-fr
    assert len(run.task.direction("en-fr").train_pairs()) == 50
    checkpointer = Checkpointer(tmp_path / "ft" / "checkpoints", best_metric=None)
    state, data_state = restore_or_init(run, checkpointer)
    checkpointer.close()
    assert data_state == {} and int(run.strategy.for_checkpoint(state).step) == 0
    want, got = _params(loaded.params), _params(run.strategy.for_checkpoint(state).params)
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    mu = jax.tree_util.tree_leaves(run.strategy.for_checkpoint(state).opt_state)
    assert all(not np.any(np.asarray(x)) for x in mu if np.asarray(x).ndim > 0)  # Adam zeros
    # and it trains from there: the first loss is that of a trained model, not of a fresh one
    final = train_and_evaluate(c, tmp_path / "ft")
    scratch = tmp_path / "scratch"
    fresh = train_and_evaluate(
        config(
            data_dir,
            raw_dir,
            **{
                "data.directions": "en-fr",
                "data.tokenizer_path": str(workdir),
                "train.num_steps": 2,
            },
        ),
        scratch,
    )
    assert (scratch / "tokenizer.model").read_bytes() == (workdir / "tokenizer.model").read_bytes()
    assert train_losses(tmp_path / "ft")[1] < train_losses(scratch)[1] - 1.0
    # and translates en-fr as the model it started from learned to, where two steps from
    # scratch do not
    assert final["bleu"] > 10 and final["bleu"] > fresh["bleu"] + 10, (final, fresh)


def test_init_from_errors_name_the_key(workdir, data_dir, raw_dir, tmp_path):
    c = config(data_dir, raw_dir, **{"train.init_from": str(workdir), "model.d_model": 32})
    with pytest.raises(
        restore.CheckpointError,
        match=r"train.init_from=.*model\.d_model \(64 in the checkpoint, 32 now",
    ):
        train_and_evaluate(c, tmp_path / "wide")
    other = tmp_path / "other.model"  # another vocabulary, with one tag only
    train_tokenizer(["a b c <2de>"] * 10, 40, other, user_defined_symbols=("<2de>",))
    c = config(
        data_dir, raw_dir, **{"train.init_from": str(workdir), "data.tokenizer_path": str(other)}
    )
    with pytest.raises(ValueError, match="data.tokenizer_path=.* and train.init_from name"):
        train_and_evaluate(c, tmp_path / "vocab")
    c = config(data_dir, raw_dir, **{"data.tokenizer_path": str(other)})
    with pytest.raises(ValueError, match=r"has no piece <2en>, <2fr>"):
        train_and_evaluate(c, tmp_path / "untagged")
    with pytest.raises(restore.CheckpointError, match="train.init_from=.*no checkpoint"):
        c = config(data_dir, raw_dir, **{"train.init_from": str(tmp_path / "nothing")})
        train_and_evaluate(c, tmp_path / "missing")


def test_max_train_pairs_keeps_the_first_pairs(data_dir, raw_dir, tmp_path):
    c = config(data_dir, raw_dir, **{"data.max_train_pairs": 30, "data.packing": False})
    task = tasks.prepare_task(c.data, tmp_path, seed=0)
    for name in ("en-de", "de-en", "en-fr", "fr-en"):
        full = task.direction(name).source("train")
        cut = task.direction(name).train_pairs()
        assert len(cut) == 30 and [cut[i] for i in range(30)] == [full[i] for i in range(30)]
    assert {n: s.weight for n, s in task.streams.items()} == {
        n: 0.25 for n in ("en-de", "de-en", "en-fr", "fr-en")
    }
    it = task.train_iterator(1)
    assert it.get_state()["shards"]["0"]["fingerprint"]["mixture"]["sizes"] == [30] * 4
    seen = set()
    for _ in range(20):
        for row in next(it)["targets"]:
            seen.add(task.tokenizer.decode(row))
    first = {t for n in ("en-de", "en-fr") for _, t in task.direction(n).train_pairs()}
    first |= {t for n in ("de-en", "fr-en") for _, t in task.direction(n).train_pairs()}
    assert len(seen - {""}) > 30 and seen - {""} <= first
    # per direction: the high-resource directions keep every pair; the mixture sees the cut
    c.data.update(max_train_pairs="en-fr=20+fr-en=20", mixture="temperature", temperature=1.0)
    task = tasks.prepare_task(c.data, tmp_path, seed=0)
    sizes = {n: len(task.direction(n).train_pairs()) for n in task.directions}
    assert sizes == {"en-de": 600, "de-en": 600, "en-fr": 20, "fr-en": 20}
    assert {n: s.weight for n, s in task.streams.items()} == pytest.approx(
        {n: k / 1240 for n, k in sizes.items()}
    )
    for spec, match in [
        ("de-fr=3", r"names \['de-fr'\], not a trained direction"),
        ("en-fr=many", "SRC-TGT=N per direction"),
        (-1, "must be >= 0"),
    ]:
        c.data.max_train_pairs = spec
        with pytest.raises(ValueError, match=match):
            validate_config(c)


def test_debug_config_trains_and_resumes_exactly(data_dir, raw_dir, tmp_path):
    """configs/multilingual.py:debug end to end; 8 steps == 4 + restart + 4, to the bit."""
    base = {
        "train.num_steps": 8,
        "checkpoint.every": 4,
        "model.dropout_rate": 0.1,
        "data.mixture": "temperature",
        "data.temperature": 2.0,
        "data.max_train_pairs": 200,
        "eval.score_test": True,
    }
    c = debug_config(data_dir, raw_dir)
    for key, value in base.items():
        section, name = key.split(".")
        c[section][name] = value
    c.data.directions = "en-de,fr-en"
    final = train_and_evaluate(c, tmp_path / "straight")
    assert {"bleu/en-de", "bleu/fr-en", "test_bleu/en-de", "test_bleu/fr-en"} <= set(final)
    assert final["test_bleu"] == pytest.approx(
        (final["test_bleu/en-de"] + final["test_bleu/fr-en"]) / 2
    )
    c.eval.update(score_test=False, bleu_examples=0)  # the same batches and losses, no decoding
    half = c.copy_and_resolve_references()
    half.train.num_steps = 4
    train_and_evaluate(half, tmp_path / "resumed")
    train_and_evaluate(c, tmp_path / "resumed")
    a, b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == [2, 4, 6, 8]  # the debug config logs every 2 steps
    assert [a[s] for s in a] == [b[s] for s in a]


@pytest.mark.skipif(not REAL_CORPUS.is_dir(), reason=f"no real Multi30k at {REAL_CORPUS}")
def test_real_corpus_multilingual_task(tmp_path):
    """The real Multi30k read in four directions with one shared, tagged vocabulary."""
    c = multilingual_config.get_config("directions=en-de+de-en+en-fr+fr-cs")
    c.data.update(data_dir=str(tmp_path / "tfds"), vocab_size=1000, tokenizer_pairs=2000)
    task = tasks.prepare_task(c.data, tmp_path / "run", seed=0)
    assert task.direction("de-en").pairs("train")[0] == (
        "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
        "Two young, White males are outside near many bushes.",
    )
    assert len(task.direction("fr-cs").pairs("test")) == 1000
    for lang in ("cs", "de", "en", "fr"):
        assert task.tokenizer.piece_to_id(f"<2{lang}>") not in (0, 1)
    batch = next(task.train_iterator(1))
    tags = {task.tokenizer.piece_to_id(f"<2{x}>") for x in ("de", "en", "fr", "cs")}
    first = batch["inputs"][(batch["inputs_position"] == 0) & (batch["inputs_segmentation"] > 0)]
    assert set(first.tolist()) <= tags and len(set(first.tolist())) >= 3
