"""Translating a split and scoring it with sacreBLEU (BLEU and chrF, with signatures).

Used by training (validation BLEU) and by the evaluate / translate CLIs. Decoding runs in
one process on that process's default device (or on the mesh the parameters live on).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import sacrebleu

from tx_jax.data.tokenizer import Tokenizer
from tx_jax.inference import compilation, data_parallel, decoding
from tx_jax.model.config import ModelConfig


@dataclasses.dataclass
class BleuResult:
    bleu: float
    chrf: float
    signature: str  # sacreBLEU's BLEU signature (tokenizer, smoothing, version)
    chrf_signature: str
    hypotheses: list[str]
    references: list[str]


class _OncePerProcess(logging.Filter):
    """Lets each of sacreBLEU's "forgot to detokenize" lines through the first time only.

    sacreBLEU logs them (three lines) from every BLEU corpus_score where 100 or more
    hypotheses end in " ."; the synthetic pair's references do, so every evaluation would
    repeat them. Once per process is enough; the scores do not depend on the warning."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.funcName != "_extract_corpus_statistics":
            return True
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


_DETOKENIZE_WARNING_ONCE = _OncePerProcess()
logging.getLogger("sacrebleu").addFilter(_DETOKENIZE_WARNING_ONCE)


def score(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, float, str, str]:
    """Corpus BLEU and chrF of detokenized text -> (bleu, chrf, bleu_sig, chrf_sig)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(list(hypotheses), [list(references)])
    c = chrf.corpus_score(list(hypotheses), [list(references)])
    return b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature())


def _greedy(params: Any, inputs: jax.Array, *, config: ModelConfig, **kw: Any):
    return decoding.translate_greedy(config, params, inputs, **kw)


def _beam(params: Any, inputs: jax.Array, *, config: ModelConfig, **kw: Any):
    return decoding.translate_beam(config, params, inputs, **kw)


def translate_batches(
    model_config: ModelConfig,
    params: Any,
    batches: Iterable[dict[str, np.ndarray]],
    tokenizer: Tokenizer,
    num_examples: int,
    *,
    beam_size: int = 1,
    alpha: float = 0.6,
    max_decode_len: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> list[str]:
    """Decode every batch (greedy when beam_size == 1) -> hypotheses in corpus order.

    Batches carry 'inputs' [B, S], 'example_index' [B] and 'example_mask' [B]. Parameters on
    one device are decoded on every local device of its platform (data_parallel.py:
    `devices`, default all of them; D consecutive batches at a time, batch k on device k);
    parameters spread over a mesh, on that mesh. The programs of different batch shapes
    compile concurrently (compilation.dispatch)."""
    out: list[str | None] = [None] * num_examples
    eos = tokenizer.eos_id
    params = nn.meta.unbox(params)
    devices = data_parallel.devices_for(params) if devices is None else list(devices)
    static = dict(config=model_config, max_decode_len=max_decode_len, eos_id=eos)
    if beam_size > 1:
        static.update(beam_size=beam_size, alpha=alpha)
    fn = _greedy if beam_size == 1 else _beam
    if devices:
        rows = data_parallel.Rows(devices, params)
        batches = data_parallel.group_batches(list(batches), len(devices))

        def call(inputs: np.ndarray):
            return lambda: rows(fn, static, inputs)
    else:  # on the mesh the parameters live on
        batches = list(batches)

        def call(inputs: np.ndarray):
            return lambda: compilation.cached_call(fn, static, params, jax.numpy.asarray(inputs))

    pending = compilation.dispatch(  # all dispatched, then fetched: JAX runs them meanwhile
        [call(b["inputs"]) for b in batches],
        [b["inputs"].shape for b in batches],
        # A mesh's programs hold collectives: every device must see them in one order.
        workers=None if devices else 1,
    )
    for batch, tokens in zip(batches, pending):
        tokens = np.asarray(jax.device_get(tokens[0] if beam_size > 1 else tokens))
        if beam_size > 1:
            tokens = tokens[:, 0]  # best first
        for row, (index, valid) in enumerate(zip(batch["example_index"], batch["example_mask"])):
            if valid:
                out[int(index)] = tokenizer.decode(tokens[row].tolist())
    missing = [i for i, h in enumerate(out) if h is None]
    if missing:
        raise RuntimeError(f"{len(missing)} examples were not decoded (first: {missing[:5]})")
    return out  # type: ignore[return-value]


def _bleu_for_split(
    model_config: ModelConfig, params: Any, task: Any, split: str, kw
) -> BleuResult:
    """Translate the first kw['limit'] examples of `split` of a TranslationTask; score them."""
    pairs = task.pairs(split, kw["limit"])
    batches = task.eval_batches(split, 1, kw["limit"])
    hyps = translate_batches(
        model_config,
        params,
        batches,
        task.tokenizer,
        len(pairs),
        beam_size=kw["beam_size"],
        alpha=kw["alpha"],
    )
    refs = [pairs[i][1] for i in range(len(pairs))]
    bleu, chrf, sig, chrf_sig = score(hyps, refs)
    return BleuResult(bleu, chrf, sig, chrf_sig, hyps, refs)


def bleu_metrics(
    model_config: ModelConfig,
    params: Any,
    task: Any,
    split: str,
    *,
    limit: int | None = None,
    beam_size: int = 1,
    alpha: float = 0.6,
) -> dict[str, Any]:
    """{'bleu', 'chrf', 'bleu_signature'} of a split; for a multilingual task (one with
    `bleu_directions`, data/directions.py) also 'bleu/en-de', 'chrf/en-de', ... per direction
    (the first `limit` pairs of each), and 'bleu' / 'chrf' are the means over its training
    directions (`task.directions`; extra, e.g. zero-shot, directions are reported only)."""
    kw = dict(limit=limit, beam_size=beam_size, alpha=alpha)
    if not hasattr(task, "bleu_directions"):
        r = _bleu_for_split(model_config, params, task, split, kw)
        return {"bleu": r.bleu, "chrf": r.chrf, "bleu_signature": r.signature}
    out: dict[str, Any] = {}
    for name in task.bleu_directions:
        r = _bleu_for_split(model_config, params, task.direction(name), split, kw)
        out.update({f"bleu/{name}": r.bleu, f"chrf/{name}": r.chrf, "bleu_signature": r.signature})
    for metric in ("bleu", "chrf"):
        out[metric] = float(np.mean([out[f"{metric}/{n}"] for n in task.directions]))
    return out
