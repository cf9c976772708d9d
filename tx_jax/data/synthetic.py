"""An embedded synthetic translation corpus: English-like source, invented verb-final target.

No download, learnt in minutes, and translating it needs attention, not copying (its own
lexicon, word order and agreement). Source grammar, with present-tense agreement ("sees"):

    sentence := clause [("and" | "but" | "because") clause] "."
    clause   := np verb [np]                         (verb is transitive iff it takes an object)
    np       := [det] [number] adj{0,2} noun ["that" verb [np]]   (one level of relative clause)
    det      := "the" | "a"/"an" | "this" (singular);  "the" | "these" | nothing (plural)
    number   := "two" .. "five" (plural nouns only; nouns pluralise with "-s")

The target (`TARGET_LEXICON`, drawn with a fixed seed) is SOV, the object marked "ko"; its noun
phrase is mirrored (noun adj2 adj1 number det), a relative clause first ("ke"); determiners and
adjectives agree in gender and number, the verb marks tense and subject number (`TGT_*`);
"A because B" -> "B sen A". For example (vapu dog, gisi bird, revari cats, diriv- chase,
tomek- see, vodar- sing; "dog" and "bird" are gender II):

    the big dog that chases two cats saw an old bird because the bird sings .
    gisi di vodara sen revari esu ko diriva ke vapu noga di gisi sora mi ko tomeki .

Each source has exactly one translation; splits are disjoint (`split_of` hashes the text).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Sequence

import tensorflow_datasets as tfds

from tx_jax.data import text_corpus

# ----------------------------------------------------------------------------- lexicon

NOUNS = (
    "dog", "cat", "bird", "horse", "farmer", "teacher", "girl", "boy", "king", "queen",
    "doctor", "student", "baker", "sailor", "tiger", "rabbit", "friend", "singer", "monkey",
    "robot",
)  # fmt: skip
# Lemma -> (present 3sg, past). The base form is the plural present.
TRANSITIVE = {
    "see": ("sees", "saw"), "chase": ("chases", "chased"), "help": ("helps", "helped"),
    "like": ("likes", "liked"), "find": ("finds", "found"), "follow": ("follows", "followed"),
    "call": ("calls", "called"), "visit": ("visits", "visited"),
    "watch": ("watches", "watched"), "know": ("knows", "knew"),
}  # fmt: skip
INTRANSITIVE = {
    "sleep": ("sleeps", "slept"), "run": ("runs", "ran"), "sing": ("sings", "sang"),
    "laugh": ("laughs", "laughed"), "dance": ("dances", "danced"), "swim": ("swims", "swam"),
    "wait": ("waits", "waited"), "smile": ("smiles", "smiled"),
}  # fmt: skip
VERBS = {**TRANSITIVE, **INTRANSITIVE}
ADJECTIVES = (
    "big", "small", "old", "young", "happy", "sad", "red", "green", "quiet", "brave", "clever",
    "lazy",
)  # fmt: skip
NUMBERS = ("two", "three", "four", "five")
CONJUNCTIONS = ("and", "but", "because")

# Target function words. Determiners agree in gender (I, II) and number (sg, pl).
TGT_DET = {
    ("the", "I", False): "du", ("the", "I", True): "dun",
    ("the", "II", False): "di", ("the", "II", True): "din",
    ("a", "I", False): "mu", ("a", "II", False): "mi",
    ("this", "I", False): "ze", ("these", "I", True): "zen",
    ("this", "II", False): "zi", ("these", "II", True): "zin",
}  # fmt: skip
TGT_ADJ_SUFFIX = {("I", False): "o", ("I", True): "os", ("II", False): "a", ("II", True): "as"}
TGT_VERB_SUFFIX = {(False, False): "a", (False, True): "an", (True, False): "i", (True, True): "in"}
TGT_PLURAL, TGT_OBJECT, TGT_REL = "ri", "ko", "ke"
TGT_CONJ = {"and": "ta", "but": "po", "because": "sen"}
LEXICON_SEED = 1729  # fixed: the language itself never changes, only the sampled corpus


SOURCE_VOCAB = frozenset(
    {*NOUNS, *(n + "s" for n in NOUNS), *ADJECTIVES, *NUMBERS, *CONJUNCTIONS, *VERBS}
    | {f for forms in VERBS.values() for f in forms}
    | {"the", "a", "an", "this", "these", "that", "."}
)


def _make_target_lexicon() -> tuple[dict[str, str], dict[str, str]]:
    """Draws a syllable stem per source lemma; every inflected form is unique and non-English."""
    rng = random.Random(LEXICON_SEED)
    cons, vows = "bdgkmnprstvz", "aeiou"
    taken = set(SOURCE_VOCAB) | set(TGT_DET.values()) | set(TGT_CONJ.values())
    taken |= {TGT_OBJECT, TGT_REL}
    lexicon: dict[str, str] = {}

    def draw(lemma: str, pattern: str, suffixes: Sequence[str]) -> None:
        while True:
            stem = "".join(rng.choice(cons if c == "C" else vows) for c in pattern)
            forms = {stem + s for s in suffixes}
            if len(forms) == len(suffixes) and not forms & taken:
                taken.update(forms)
                lexicon[lemma] = stem
                return

    for noun in NOUNS:
        draw(noun, "CVCV", ("", TGT_PLURAL))
    for adj in ADJECTIVES:
        draw(adj, "CVC", tuple(TGT_ADJ_SUFFIX.values()))
    for verb in VERBS:
        draw(verb, "CVCVC", tuple(TGT_VERB_SUFFIX.values()))
    for num in NUMBERS:
        draw(num, "VCV", ("",))
    genders = ["I", "II"] * (len(NOUNS) // 2)
    rng.shuffle(genders)
    return lexicon, dict(zip(NOUNS, genders))


# TARGET_LEXICON: source lemma -> target stem; NOUN_GENDER: source noun -> "I" | "II".
TARGET_LEXICON, NOUN_GENDER = _make_target_lexicon()

# ----------------------------------------------------------------------------- structure


@dataclasses.dataclass(frozen=True)
class NounPhrase:
    """A noun phrase; `rel` is a subject relative clause ("that chases the cat")."""

    noun: str
    plural: bool
    det: str | None = None  # "the" | "a" | "this" | "these" | None
    num: str | None = None
    adjs: tuple[str, ...] = ()
    rel: Clause | None = None


@dataclasses.dataclass(frozen=True)
class Clause:
    """A clause; `subj` is None inside a relative clause (the gap is the head noun)."""

    subj: NounPhrase | None
    verb: str
    past: bool
    obj: NounPhrase | None = None


@dataclasses.dataclass(frozen=True)
class Sentence:
    """One clause, or two joined by a conjunction."""

    first: Clause
    conj: str | None = None
    second: Clause | None = None


def _sample_np(rng: random.Random, allow_rel: bool) -> NounPhrase:
    plural = rng.random() < 0.4
    if plural:
        det = rng.choices(["the", "these", None], weights=[4, 2, 4])[0]
        num = rng.choice(NUMBERS) if rng.random() < 0.5 else None
    else:
        det, num = rng.choices(["the", "a", "this"], weights=[5, 3, 2])[0], None
    adjs = tuple(rng.sample(ADJECTIVES, rng.choices([0, 1, 2], weights=[5, 4, 1])[0]))
    rel = _sample_clause(rng, with_subj=False) if allow_rel and rng.random() < 0.2 else None
    return NounPhrase(rng.choice(NOUNS), plural, det, num, adjs, rel)


def _sample_clause(rng: random.Random, with_subj: bool) -> Clause:
    subj = _sample_np(rng, allow_rel=True) if with_subj else None
    if rng.random() < 0.6:
        verb = rng.choice(list(TRANSITIVE))
        obj = _sample_np(rng, allow_rel=with_subj)  # relative clauses nest one level only
    else:
        verb, obj = rng.choice(list(INTRANSITIVE)), None
    return Clause(subj, verb, rng.random() < 0.5, obj)


# ----------------------------------------------------------------------------- realization


def _src_verb(verb: str, past: bool, plural: bool) -> str:
    third_sg, past_form = VERBS[verb]
    return past_form if past else (verb if plural else third_sg)


def _src_np(np: NounPhrase) -> list[str]:
    words = [*([np.num] if np.num else []), *np.adjs, np.noun + ("s" if np.plural else "")]
    if np.det == "a" and words[0][0] in "aeiou":
        words.insert(0, "an")
    elif np.det:
        words.insert(0, np.det)
    if np.rel:
        words += ["that", *_src_vp(np.rel, np.plural)]
    return words


def _src_vp(clause: Clause, plural: bool) -> list[str]:
    obj = _src_np(clause.obj) if clause.obj else []
    return [_src_verb(clause.verb, clause.past, plural), *obj]


def _src_clause(clause: Clause) -> list[str]:
    assert clause.subj is not None
    return [*_src_np(clause.subj), *_src_vp(clause, clause.subj.plural)]


def _tgt_np(np: NounPhrase) -> list[str]:
    gender = NOUN_GENDER[np.noun]
    words = _tgt_vp(np.rel, np.plural) + [TGT_REL] if np.rel else []
    words.append(TARGET_LEXICON[np.noun] + (TGT_PLURAL if np.plural else ""))
    suffix = TGT_ADJ_SUFFIX[gender, np.plural]
    words += [TARGET_LEXICON[a] + suffix for a in reversed(np.adjs)]
    if np.num:
        words.append(TARGET_LEXICON[np.num])
    if np.det:
        words.append(TGT_DET[np.det, gender, np.plural])
    return words


def _tgt_vp(clause: Clause, plural: bool) -> list[str]:
    obj = [*_tgt_np(clause.obj), TGT_OBJECT] if clause.obj else []
    return [*obj, TARGET_LEXICON[clause.verb] + TGT_VERB_SUFFIX[clause.past, plural]]


def _tgt_clause(clause: Clause) -> list[str]:
    assert clause.subj is not None
    return [*_tgt_np(clause.subj), *_tgt_vp(clause, clause.subj.plural)]


def realize(sentence: Sentence) -> tuple[str, str]:
    """Realizes a structure as (source, target) strings of space-separated words."""
    src, tgt = _src_clause(sentence.first), _tgt_clause(sentence.first)
    if sentence.second is not None:
        assert sentence.conj is not None
        src2, tgt2 = _src_clause(sentence.second), _tgt_clause(sentence.second)
        src += [sentence.conj, *src2]
        conj = TGT_CONJ[sentence.conj]
        tgt = [*tgt2, conj, *tgt] if sentence.conj == "because" else [*tgt, conj, *tgt2]
    return " ".join([*src, "."]), " ".join([*tgt, "."])


# ----------------------------------------------------------------------------- corpus

MIN_WORDS, MAX_WORDS = 4, 25  # source length bounds, counting the final "."
SPLITS = ("train", "validation", "test")
# Each split's upper bound on sha1(source) % 100: 90% train, 5% validation, 5% test.
_SPLIT_BOUNDS = {"train": 90, "validation": 95, "test": 100}


def split_of(source: str) -> str:
    """The split a source sentence belongs to: a hash of its text, so splits are disjoint."""
    bucket = int.from_bytes(hashlib.sha1(source.encode()).digest()[:8], "big") % 100
    return next(split for split in SPLITS if bucket < _SPLIT_BOUNDS[split])


def generate_pair(rng: random.Random) -> tuple[str, str]:
    """Samples one (source, target) pair with MIN_WORDS..MAX_WORDS source words."""
    while True:
        sentence = Sentence(_sample_clause(rng, with_subj=True))
        if rng.random() < 0.45:
            conj = rng.choice(CONJUNCTIONS)  # before the clause: the corpus stays the same
            sentence = Sentence(sentence.first, conj, _sample_clause(rng, with_subj=True))
        src, tgt = realize(sentence)
        if MIN_WORDS <= src.count(" ") + 1 <= MAX_WORDS:
            return src, tgt


def generate_corpus(
    num_examples: int, seed: int, *, split: str | None = "train"
) -> list[tuple[str, str]]:
    """`num_examples` distinct pairs whose sources hash into `split` (None: any split), each
    split from its own seeded stream, so more training data never changes validation or test."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    rng = random.Random(f"synthetic_translation/{seed}/{split}")
    pairs: dict[str, str] = {}  # source -> target, in drawing order
    for _ in range(100 * num_examples + 10_000):  # bound: the sentence space is finite
        if len(pairs) == num_examples:
            break
        src, tgt = generate_pair(rng)
        if split is None or split_of(src) == split:
            pairs.setdefault(src, tgt)
    if len(pairs) < num_examples:
        raise RuntimeError(f"could not draw {num_examples} distinct sentences for {split!r}")
    return list(pairs.items())


# ----------------------------------------------------------------------------- TFDS builder


@dataclasses.dataclass(eq=False)
class SyntheticTranslationConfig(tfds.core.BuilderConfig):
    """Corpus seed and split sizes; the default config is 50,000 / 1,000 / 1,000 with seed 0."""

    seed: int = 0
    num_train: int = 50_000
    num_validation: int = 1_000
    num_test: int = 1_000


class SyntheticTranslation(tfds.core.GeneratorBasedBuilder):
    """TFDS builder `synthetic_translation`: {'src': Text, 'tgt': Text} in generation order
    (`as_data_source(split)[i]` is `generate_corpus(n, seed, split=split)[i]`)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [
        SyntheticTranslationConfig(name="default", version=VERSION, description="50k/1k/1k")
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return text_corpus.pair_info(
            self,
            ("src", "tgt"),
            "English-like source, invented verb-final target with agreement.",
            supervised_keys=("src", "tgt"),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # the corpus is generated, never downloaded
        return {split: self._generate_examples(split) for split in SPLITS}

    def _generate_examples(self, split: str):
        config = self.builder_config
        num = getattr(config, f"num_{split}")
        for i, (src, tgt) in enumerate(generate_corpus(num, config.seed, split=split)):
            yield i, {"src": src, "tgt": tgt}


def make_config(
    *,
    num_train: int | None = None,
    seed: int | None = None,
    num_validation: int | None = None,
    num_test: int | None = None,
) -> SyntheticTranslationConfig:
    """The default config, or a custom one named after its sizes and seed when any is given."""
    default = SyntheticTranslation.BUILDER_CONFIGS[0]
    if all(v is None for v in (num_train, seed, num_validation, num_test)):
        return default
    given = dict(seed=seed, num_train=num_train, num_validation=num_validation, num_test=num_test)
    values = {k: getattr(default, k) if v is None else v for k, v in given.items()}
    name = "s{seed}_n{num_train}_{num_validation}_{num_test}".format(**values)
    return SyntheticTranslationConfig(name=name, version=SyntheticTranslation.VERSION, **values)


def make_builder(
    name: str, *, source_lang: str, target_lang: str, data_dir: str | None, builder_kwargs: dict
) -> SyntheticTranslation:
    """The table entry 'synthetic': one corpus for both directions, sized by its config."""
    del source_lang, target_lang
    if name != "synthetic":
        raise ValueError(
            f"Dataset {name!r}: the synthetic corpus has no named configs; use 'synthetic' "
            "and set its sizes in data.synthetic."
        )
    return SyntheticTranslation(data_dir=data_dir, **builder_kwargs)


def config_builder_kwargs(data) -> dict:
    """config.data.synthetic's sizes and seed as the builder's config."""
    sizes = {k: data.synthetic[k] for k in ("num_train", "num_validation", "num_test", "seed")}
    return {"config": make_config(**sizes)}
