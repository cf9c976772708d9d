"""Translation quality of a decoded split: translated, then scored against its references
with sacreBLEU (BLEU and chrF, with signatures); the one path every BLEU of tx_jax takes
(evaluation.py, training's validation BLEU, multilingual.py). Likelihood of given pairs is
likelihood.py's.

    split = quality.Split(task, "validation", limit=100)     pairs and eval batches, read once
    result = quality.measure_split(model_config, params, tokenizer, split, beam_size=4)
    result.bleu, result.chrf, result.signature, result.hypotheses, result.decode_seconds
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import sacrebleu

from tx_jax.data.tokenizer import Tokenizer
from tx_jax.inference import compilation, data_parallel, decoding
from tx_jax.model.config import ModelConfig


@dataclasses.dataclass
class SplitQuality:
    bleu: float
    chrf: float
    signature: str  # sacreBLEU's BLEU signature (tokenizer, smoothing, version)
    chrf_signature: str
    hypotheses: list[str]
    references: list[str]
    sources: list[str]
    decode_seconds: float = 0.0  # wall time of the translation alone


class Split:
    """The first `limit` pairs of a split of a translation task, each part read when first
    asked for and kept: a split decoded several times (a sweep) is read once."""

    def __init__(self, task: Any, name: str, limit: int | None = None):
        self.task, self.name, self.limit = task, name, limit

    @functools.cached_property
    def pairs(self) -> Sequence[tuple[str, str]]:
        return self.task.pairs(self.name, self.limit)

    @property
    def sources(self) -> list[str]:
        return [self.pairs[i][0] for i in range(len(self.pairs))]

    @functools.cached_property
    def references(self) -> list[str]:
        return [self.pairs[i][1] for i in range(len(self.pairs))]

    @property
    def target_prefix(self) -> list[int]:
        """Ids every hypothesis is forced to start with (an M2M100/NLLB target-language token)."""
        return list(getattr(self.task, "target_prefix", ()))

    @functools.cached_property
    def batches(self) -> list[dict[str, np.ndarray]]:
        """Eval batches, each row's place in the corpus in 'example_index'."""
        return list(self.task.eval_batches(self.name, 1, self.limit))


class _OncePerProcess(logging.Filter):
    """Lets each of sacreBLEU's "forgot to detokenize" lines through once per process: the
    synthetic pair's references end in " .", so every evaluation would repeat them."""

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


def bleu_chrf(
    hypotheses: Sequence[str], references: Sequence[str]
) -> tuple[float, float, str, str]:
    """Corpus BLEU and chrF of detokenized text -> (bleu, chrf, bleu_sig, chrf_sig)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(list(hypotheses), [list(references)])
    c = chrf.corpus_score(list(hypotheses), [list(references)])
    return b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature())


def _prompt(inputs: jax.Array, prefix: tuple[int, ...]) -> jax.Array | None:
    """The same forced first tokens for every row (an M2M100/NLLB target-language token)."""
    if not prefix:
        return None
    return jax.numpy.tile(jax.numpy.asarray(prefix, jax.numpy.int32)[None], (inputs.shape[0], 1))


def _greedy(params: Any, inputs: jax.Array, *, config: ModelConfig, prefix=(), **kw: Any):
    return decoding.translate_greedy(config, params, inputs, prompt=_prompt(inputs, prefix), **kw)


def _beam(params: Any, inputs: jax.Array, *, config: ModelConfig, prefix=(), **kw: Any):
    return decoding.translate_beam(config, params, inputs, prompt=_prompt(inputs, prefix), **kw)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Ancestral sampling instead of search (top_k 0 and top_p 1.0: off). A row's draws come
    from fold_in(fold_in(key(seed), line id), sample number): not from its batch or place."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def _sample(params: Any, inputs: jax.Array, *, config: ModelConfig, seed: int, prefix=(), **kw):
    """inputs [B, 2 + S]: each row's line id, sample number, then its source -> tokens [B, T];
    each row sampled alone (vmap) with its own key, search.py's being the whole batch's."""
    base = jax.random.key(seed)

    def one(line: jax.Array, k: jax.Array, source: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.fold_in(base, line), k)
        source = source[None]  # [1, S]
        return decoding.sample(
            config, params, key, inputs=source, prompt=_prompt(source, prefix), **kw
        )[0]

    return jax.vmap(one)(inputs[:, 0], inputs[:, 1], inputs[:, 2:])


def decode_batches(
    model_config: ModelConfig,
    params: Any,
    batches: Iterable[dict[str, np.ndarray]],
    eos_id: int,
    num_examples: int,
    *,
    beam_size: int = 1,
    length_penalty: float = 0.6,
    max_decode_len: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    target_prefix: Sequence[int] = (),
    length_penalty_kind: str = "gnmt",
    nbest: int = 1,
    sampling: Sampling | None = None,
) -> list[tuple[np.ndarray, list[np.ndarray]]]:
    """Decode every batch -> per example, in corpus order: (its source ids [S'], its `nbest`
    outputs [T'] with forced prefix and EOS, best first), padding dropped. Batches carry
    'inputs' [B, S], 'example_index' [B], 'example_mask' [B] (and with `sampling`, 'sample_key'
    [B, 2]: line id, sample number). Greedy when beam_size == 1 and `sampling` is None.
    `target_prefix`: forced first output ids. Parameters on one device are decoded on every
    local device of its platform (`devices`: data_parallel.py), parameters over a mesh on that
    mesh; batch shapes compile concurrently."""
    if nbest > 1 and sampling is None and nbest > beam_size:
        raise ValueError(f"nbest={nbest} needs beam_size >= {nbest} (beam_size={beam_size})")
    out: list = [None] * num_examples
    params = nn.meta.unbox(params)
    devices = data_parallel.devices_for(params) if devices is None else list(devices)
    # The decoding function and its static keyword arguments (the compiled program's key).
    static: dict[str, Any] = dict(config=model_config, max_decode_len=max_decode_len, eos_id=eos_id)
    if sampling is not None:
        fn = _sample
        static.update(
            seed=int(sampling.seed),
            temperature=float(sampling.temperature),
            top_k=int(sampling.top_k),
            top_p=float(sampling.top_p),
        )
        # 'sample_key' [B, 2] goes before the source: group_batches pads on the right.
        batches = [
            {**b, "inputs": np.concatenate([b["sample_key"], b["inputs"]], 1).astype(np.int32)}
            for b in batches
        ]
    elif beam_size > 1:
        fn = _beam
        static.update(beam_size=beam_size, length_penalty=length_penalty)
        if length_penalty_kind != "gnmt":
            static.update(length_penalty_kind=length_penalty_kind)
    else:
        fn = _greedy
    if target_prefix:
        static.update(prefix=tuple(int(i) for i in target_prefix))
    batches, pending = _dispatch(fn, static, params, batches, devices)
    skip = 2 if sampling is not None else 0  # the key columns before the source
    for batch, result in zip(batches, pending):
        # [B, nbest, T] on the host: beam search gives (tokens, scores)
        tokens = np.asarray(jax.device_get(result[0] if fn is _beam else result))
        tokens = tokens[:, :nbest] if fn is _beam else tokens[:, None]
        for row, (index, valid) in enumerate(zip(batch["example_index"], batch["example_mask"])):
            if valid:
                source = batch["inputs"][row, skip:]
                out[int(index)] = (source[source != 0], [t[t != 0] for t in tokens[row]])
    missing = [i for i, h in enumerate(out) if h is None]
    if missing:
        raise RuntimeError(f"{len(missing)} examples were not decoded (first: {missing[:5]})")
    return out


def _dispatch(
    fn: Callable[..., Any],
    static: dict[str, Any],
    params: Any,
    batches: Iterable[dict[str, np.ndarray]],
    devices: list[jax.Device],
) -> tuple[list[dict[str, np.ndarray]], list[Any]]:
    """Every batch's decoding started -> (the batches as decoded, their unfetched results)."""
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
    return batches, pending


def translate_batches(
    model_config: ModelConfig,
    params: Any,
    batches: Iterable[dict[str, np.ndarray]],
    tokenizer: Tokenizer,
    num_examples: int,
    **kwargs: Any,
) -> list[str]:
    """Each example's best hypothesis as text, in corpus order (`decode_batches`' keyword
    arguments; the tokenizer drops a forced target-language token)."""
    decoded = decode_batches(
        model_config, params, batches, tokenizer.eos_id, num_examples, **kwargs
    )
    return [tokenizer.decode(hyps[0].tolist()) for _, hyps in decoded]


Translator = Callable[[list[str]], list[str]]  # sources -> hypotheses, in order


def translate_split(
    model_config: ModelConfig,
    params: Any,
    tokenizer: Tokenizer,
    split: Split,
    *,
    beam_size: int = 1,
    length_penalty: float = 0.6,
    translate: Translator | None = None,
) -> list[str]:
    """The split's hypotheses in corpus order: its eval batches decoded (greedy when
    beam_size == 1), or `translate(sources)` when given (a pivot: multilingual.py)."""
    if translate is not None:
        return translate(split.sources)
    return translate_batches(
        model_config,
        params,
        split.batches,
        tokenizer,
        len(split.references),
        beam_size=beam_size,
        length_penalty=length_penalty,
        target_prefix=split.target_prefix,
    )


def measure_split(
    model_config: ModelConfig, params: Any, tokenizer: Tokenizer, split: Split, **kwargs: Any
) -> SplitQuality:
    """Translate a split (`translate_split`'s keyword arguments) and score it with sacreBLEU."""
    start = time.time()
    hyps = translate_split(model_config, params, tokenizer, split, **kwargs)
    seconds = time.time() - start
    bleu, chrf, sig, chrf_sig = bleu_chrf(hyps, split.references)
    return SplitQuality(bleu, chrf, sig, chrf_sig, hyps, split.references, split.sources, seconds)


def bleu_metrics(
    model_config: ModelConfig,
    params: Any,
    task: Any,
    split: str,
    *,
    limit: int | None = None,
    beam_size: int = 1,
    length_penalty: float = 0.6,
) -> dict[str, Any]:
    """{'bleu', 'chrf', 'bleu_signature'} of a split; for a multilingual task also
    'bleu/en-de', 'chrf/en-de', ... per direction, 'bleu' / 'chrf' being the means over its
    training directions (extra, e.g. zero-shot, directions are reported only)."""

    def result(task: Any) -> SplitQuality:
        data = Split(task, split, limit)
        kw = dict(beam_size=beam_size, length_penalty=length_penalty)
        return measure_split(model_config, params, task.tokenizer, data, **kw)

    if not task.directions:
        r = result(task)
        return {"bleu": r.bleu, "chrf": r.chrf, "bleu_signature": r.signature}
    out: dict[str, Any] = {}
    for name in task.bleu_directions:
        r = result(task.direction(name))
        out.update({f"bleu/{name}": r.bleu, f"chrf/{name}": r.chrf, "bleu_signature": r.signature})
    for metric in ("bleu", "chrf"):
        out[metric] = float(np.mean([out[f"{metric}/{n}"] for n in task.directions]))
    return out
