"""inference/quality.py's sacreBLEU call: the "forgot to detokenize" warning once per process,
the same scores."""

import logging

import pytest
import sacrebleu

from tx_jax.inference import quality

# Like the synthetic pair: every line ends in a separated period, more than 100 lines.
REFERENCES = [f"the {n} cats sat on {m} mats ." for n in range(12) for m in range(10)]
HYPOTHESES = [r if i % 3 else r.replace("cats", "dogs") for i, r in enumerate(REFERENCES)]


def test_detokenize_warning_is_shown_once_and_scores_are_sacrebleus(caplog, monkeypatch):
    monkeypatch.setattr(quality._DETOKENIZE_WARNING_ONCE, "seen", set())  # as in a new process
    with caplog.at_level(logging.WARNING, logger="sacrebleu"):
        first = quality.bleu_chrf(HYPOTHESES, REFERENCES)
        second = quality.bleu_chrf(HYPOTHESES, REFERENCES)
    messages = [r.getMessage() for r in caplog.records if r.name == "sacrebleu"]
    assert len(messages) == 3 and len(set(messages)) == 3
    assert any("forgot to detokenize" in m for m in messages)

    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(HYPOTHESES, [REFERENCES]).score
    c = chrf.corpus_score(HYPOTHESES, [REFERENCES]).score
    assert first == second == (b, c, str(bleu.get_signature()), str(chrf.get_signature()))
    assert 0 < b < 100


def test_other_sacrebleu_warnings_are_not_filtered(caplog):
    with caplog.at_level(logging.WARNING, logger="sacrebleu"):
        for _ in range(2):
            logging.getLogger("sacrebleu").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"] * 2


def test_bleu_chrf_rejects_unequal_lengths():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        quality.bleu_chrf(["a .", "b ."], ["a ."])
