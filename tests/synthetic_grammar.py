"""The synthetic corpus read back (tx_jax/data/synthetic.py): a parser of its source grammar,
so a test can check that every generated target is the one reference translation, and the
corpus's length and vocabulary statistics."""

from __future__ import annotations

from collections.abc import Sequence

from tx_jax.data import synthetic as syn

# Every verb form -> (lemma, is_past); the forms are all distinct, so this is unambiguous.
FORM_TO_VERB = {f: (v, f == forms[1]) for v, forms in syn.VERBS.items() for f in (v, *forms)}


class Parser:
    """Recursive descent over the source grammar (it is unambiguous: transitivity is lexical)."""

    def __init__(self, source: str):
        self.words, self.i = source.split(), 0

    def peek(self) -> str | None:
        return self.words[self.i] if self.i < len(self.words) else None

    def take(self) -> str:
        word = self.peek()
        if word is None:
            raise ValueError("unexpected end of sentence")
        self.i += 1
        return word

    def sentence(self) -> syn.Sentence:
        first = self.clause()
        conj = self.take() if self.peek() in syn.CONJUNCTIONS else None
        second = self.clause() if conj else None
        if self.take() != "." or self.peek() is not None:
            raise ValueError("expected a final '.'")
        return syn.Sentence(first, conj, second)

    def clause(self, subj_allowed: bool = True, allow_rel: bool = True) -> syn.Clause:
        subj = self.np(allow_rel=True) if subj_allowed else None
        form = self.take()
        if form not in FORM_TO_VERB:
            raise ValueError(f"expected a verb, got {form!r}")
        verb, past = FORM_TO_VERB[form]
        obj = self.np(allow_rel=allow_rel) if verb in syn.TRANSITIVE else None
        return syn.Clause(subj, verb, past, obj)

    def np(self, allow_rel: bool) -> syn.NounPhrase:
        det = self.take() if self.peek() in ("the", "a", "an", "this", "these") else None
        num = self.take() if self.peek() in syn.NUMBERS else None
        adjs = []
        while self.peek() in syn.ADJECTIVES:
            adjs.append(self.take())
        word = self.take()
        plural = word.endswith("s") and word[:-1] in syn.NOUNS
        if not plural and word not in syn.NOUNS:
            raise ValueError(f"expected a noun, got {word!r}")
        rel = None
        if allow_rel and self.peek() == "that":
            self.take()
            rel = self.clause(subj_allowed=False, allow_rel=False)
        det = "a" if det == "an" else det
        return syn.NounPhrase(word[:-1] if plural else word, plural, det, num, tuple(adjs), rel)


def parse(source: str) -> syn.Sentence:
    """Parses a source sentence of the grammar back into its structure (ValueError if not)."""
    sentence = Parser(source).sentence()
    if syn.realize(sentence)[0] != " ".join(source.split()):
        raise ValueError(f"not a grammatical sentence (agreement or article): {source!r}")
    return sentence


def translate(source: str) -> str:
    """The one reference translation of a source sentence the grammar produces."""
    return syn.realize(parse(source))[1]


def corpus_stats(pairs: Sequence[tuple[str, str]]) -> dict[str, float]:
    """Vocabulary sizes and mean / max lengths in words (counting the final '.')."""
    src = [s.split() for s, _ in pairs]
    tgt = [t.split() for _, t in pairs]
    return {
        "examples": len(pairs),
        "src_vocab": len({w for s in src for w in s}),
        "tgt_vocab": len({w for t in tgt for w in t}),
        "src_mean_len": sum(map(len, src)) / len(src),
        "tgt_mean_len": sum(map(len, tgt)) / len(tgt),
        "src_max_len": max(map(len, src)),
        "tgt_max_len": max(map(len, tgt)),
    }
