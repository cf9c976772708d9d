"""Tests for the synthetic translation corpus and its TFDS builder (tx_jax/data/synthetic.py)."""

import random

import pytest
import synthetic_grammar as grammar

from tx_jax.data import datasets
from tx_jax.data import synthetic as syn

L = syn.TARGET_LEXICON


def _content_lemmas_by_target_form() -> dict[str, str]:
    """Every inflected target content word -> its source lemma."""
    forms = {}
    for noun in syn.NOUNS:
        forms[L[noun]] = forms[L[noun] + syn.TGT_PLURAL] = noun
    for adj in syn.ADJECTIVES:
        forms.update({L[adj] + s: adj for s in syn.TGT_ADJ_SUFFIX.values()})
    for verb in syn.VERBS:
        forms.update({L[verb] + s: verb for s in syn.TGT_VERB_SUFFIX.values()})
    forms.update({L[n]: n for n in syn.NUMBERS})
    return forms


def _source_lemma(word: str) -> str | None:
    if word in syn.VERBS or word in syn.ADJECTIVES or word in syn.NUMBERS or word in syn.NOUNS:
        return word
    if word.endswith("s") and word[:-1] in syn.NOUNS:
        return word[:-1]
    return next((v for v, forms in syn.VERBS.items() if word in forms), None)


@pytest.fixture(scope="module")
def train_pairs():
    return syn.generate_corpus(3000, seed=0)


def test_corpus_is_deterministic_by_seed(train_pairs):
    assert syn.generate_corpus(3000, seed=0) == train_pairs
    other = syn.generate_corpus(3000, seed=1)
    assert other != train_pairs
    assert len(set(other) & set(train_pairs)) < 150  # overlap only among short sentences
    rng_a, rng_b = random.Random(7), random.Random(7)
    assert [syn.generate_pair(rng_a) for _ in range(50)] == [
        syn.generate_pair(rng_b) for _ in range(50)
    ]


def test_splits_are_disjoint_and_distinct(train_pairs):
    valid = syn.generate_corpus(300, seed=0, split="validation")
    test = syn.generate_corpus(300, seed=0, split="test")
    other_seed_test = syn.generate_corpus(300, seed=5, split="test")
    train_src = {s for s, _ in train_pairs}
    assert len(train_src) == len(train_pairs)  # no duplicates inside a split
    assert len({s for s, _ in valid}) == 300 and len({s for s, _ in test}) == 300
    for split, pairs in (("validation", valid), ("test", test), ("test", other_seed_test)):
        assert not train_src & {s for s, _ in pairs}
        assert all(syn.split_of(s) == split for s, _ in pairs)
    assert not {s for s, _ in valid} & {s for s, _ in test}
    assert all(syn.split_of(s) == "train" for s, _ in train_pairs)
    # Asking for more training data leaves the other splits unchanged (independent streams).
    assert syn.generate_corpus(300, seed=0, split="test") == test
    mixed = syn.generate_corpus(4000, seed=0, split=None)
    share = sum(syn.split_of(s) == "train" for s, _ in mixed) / len(mixed)
    assert 0.87 < share < 0.93


def test_translate_reproduces_generated_targets(train_pairs):
    for src, tgt in train_pairs:
        assert grammar.translate(src) == tgt
        assert grammar.parse(src) is not None
    for bad in ("the dog sleep .", "dog the sleeps .", "a old dog sleeps .", "the dog sees ."):
        with pytest.raises(ValueError):
            grammar.translate(bad)


def test_hand_built_translation():
    g = syn.NOUN_GENDER
    src = "the big dog sees two small cats ."
    dog = [
        L["dog"],
        L["big"] + syn.TGT_ADJ_SUFFIX[g["dog"], False],
        syn.TGT_DET["the", g["dog"], False],
    ]
    cats = [L["cat"] + "ri", L["small"] + syn.TGT_ADJ_SUFFIX[g["cat"], True], L["two"]]
    assert grammar.translate(src).split() == [*dog, *cats, "ko", L["see"] + "a", "."]
    # "because" swaps the clauses and marks the reason clause.
    assert grammar.translate("cats sleep because dogs run .").split() == [
        L["dog"] + "ri",
        L["run"] + "an",
        "sen",
        L["cat"] + "ri",
        L["sleep"] + "an",
        ".",
    ]
    # A relative clause precedes its head noun: [object ko] verb ke noun ...
    assert grammar.translate("an old horse that found these birds laughed .").split() == [
        L["bird"] + "ri",
        syn.TGT_DET["these", g["bird"], True],
        "ko",
        L["find"] + "i",
        "ke",
        L["horse"],
        L["old"] + syn.TGT_ADJ_SUFFIX[g["horse"], False],
        syn.TGT_DET["a", g["horse"], False],
        L["laugh"] + "i",
        ".",
    ]


def test_word_order_differs(train_pairs):
    forms = _content_lemmas_by_target_form()
    reordered = 0
    for src, tgt in train_pairs:
        src_lemmas = [lem for w in src.split() if (lem := _source_lemma(w))]
        tgt_lemmas = [forms[w] for w in tgt.split() if w in forms]
        assert sorted(src_lemmas) == sorted(tgt_lemmas)  # same content, one word per word
        reordered += src_lemmas != tgt_lemmas
    assert reordered / len(train_pairs) > 0.75
    # Adjective after the noun; verb last (before "."), after the "ko"-marked object.
    tgt = grammar.translate("the red horse chased a king .").split()
    assert tgt.index(L["red"] + syn.TGT_ADJ_SUFFIX[syn.NOUN_GENDER["horse"], False]) == 1
    assert tgt[-2] == L["chase"] + "i" and tgt[-3] == "ko"


def test_agreement():
    # The verb agrees with subject number, even in the past tense where English shows none.
    for sg, pl in (("the dog sleeps .", "the dogs sleep ."), ("a dog slept .", "two dogs slept .")):
        v_sg, v_pl = grammar.translate(sg).split()[-2], grammar.translate(pl).split()[-2]
        assert v_sg != v_pl and v_sg.startswith(L["sleep"]) and v_pl.startswith(L["sleep"])
        assert v_pl == v_sg + "n"
    # Adjectives agree with the noun's gender and number.
    noun_i = next(n for n in syn.NOUNS if syn.NOUN_GENDER[n] == "I")
    noun_ii = next(n for n in syn.NOUNS if syn.NOUN_GENDER[n] == "II")
    sad = [grammar.translate(f"the sad {n} runs .").split()[1] for n in (noun_i, noun_ii)]
    sad += [grammar.translate(f"the sad {n}s run .").split()[1] for n in (noun_i, noun_ii)]
    assert sad == [L["sad"] + s for s in ("o", "a", "os", "as")]
    # Determiners agree too.
    assert grammar.translate(f"the {noun_i} runs .").split()[1] == "du"
    assert grammar.translate(f"the {noun_ii}s run .").split()[1] == "din"


def test_target_lexicon_shares_no_word_with_source(train_pairs):
    tgt_words = {w for _, t in train_pairs for w in t.split()} - {"."}
    src_words = {w for s, _ in train_pairs for w in s.split()} - {"."}
    assert src_words <= syn.SOURCE_VOCAB
    assert not tgt_words & syn.SOURCE_VOCAB
    assert not set(_content_lemmas_by_target_form()) & syn.SOURCE_VOCAB
    assert len(set(L.values())) == len(L)  # one stem per lemma


def test_corpus_statistics(train_pairs):
    stats = grammar.corpus_stats(train_pairs)
    print(stats)
    assert all(syn.MIN_WORDS <= len(s.split()) <= syn.MAX_WORDS for s, _ in train_pairs)
    assert 9.5 < stats["src_mean_len"] < 12.5
    assert stats["tgt_mean_len"] > stats["src_mean_len"]  # "ko"/"ke" markers
    assert 100 <= stats["src_vocab"] <= 130 and 150 <= stats["tgt_vocab"] <= 200
    content = len(syn.NOUNS) + len(syn.VERBS) + len(syn.ADJECTIVES) + len(syn.NUMBERS)
    assert 40 <= content <= 80


def test_default_config_sizes():
    config = syn.make_config()
    assert (config.name, config.seed) == ("default", 0)
    assert (config.num_train, config.num_validation, config.num_test) == (50_000, 1_000, 1_000)
    assert syn.make_config(num_train=10).name == "s0_n10_1000_1000"


def test_tfds_builder_through_the_dataset_table(tmp_path):
    """The corpus enters as any dataset does: its table entry prepares the builder (without
    TensorFlow) and the split reads back as text pairs, in generation order."""
    sizes = {"train": 200, "validation": 20, "test": 20}
    kwargs = dict(num_train=200, num_validation=20, num_test=20, seed=3)
    for split, size in sizes.items():
        source = datasets.load_translation_split(
            "synthetic",
            split,
            source_lang="src",
            target_lang="tgt",
            data_dir=str(tmp_path),
            builder_kwargs={"config": syn.make_config(**kwargs)},
        )
        assert list(source) == syn.generate_corpus(size, seed=3, split=split)
    builder = syn.SyntheticTranslation(
        data_dir=str(tmp_path), config=syn.make_config(**kwargs), file_format="array_record"
    )
    assert builder.is_prepared()
    assert isinstance(builder.as_data_source("test")[0]["src"], bytes)  # TFDS Text without TF
    assert builder.info.supervised_keys == ("src", "tgt")
    assert {k: v.num_examples for k, v in builder.info.splits.items()} == sizes
