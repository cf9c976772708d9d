"""Translation quality of a decoded split: the split translated, then measured against its
references with sacreBLEU (BLEU and chrF, with signatures); the one path every BLEU of tx_jax
takes. (ln p(target | source) of given pairs, `tx_jax score`, is inference/likelihood.py.)

    split = quality.Split(task, "validation", limit=100)     pairs and eval batches, read once
    result = quality.measure_split(model_config, params, tokenizer, split, beam_size=4)
    result.bleu, result.chrf, result.signature, result.hypotheses, result.decode_seconds

`measure_split` is what evaluation.py (the evaluate CLI, sweeps), training's validation and test
BLEU (`bleu_metrics`, runner/evaluator.py) and multilingual.measure_direction (the
language-similarity study) call: the split's eval batches decoded by `translate_batches`
(or, through a pivot language, the sources translated by a given text-to-text function),
then scored against its references. `translate_batches` also serves translation.py.
Decoding runs in one process on that process's local devices (or on the mesh the
parameters live on).
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
    decode_seconds: float = 0.0  # wall time of the translation alone


class Split:
    """The first `limit` pairs of a split of a translation task (a direction's, for a
    multilingual one: its sources tagged; an imported M2M100/NLLB model's: its language
    tokens, the target's forced), each part read when first asked for and kept:
    a split decoded several times (a sweep) is read once."""

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
        """Ids every hypothesis is forced to start with (an imported M2M100/NLLB model's
        target-language token, as its targets were trained: data/tasks.py); none else."""
        return list(getattr(self.task, "target_prefix", ()))

    @functools.cached_property
    def batches(self) -> list[dict[str, np.ndarray]]:
        """Eval batches: sources as the model reads them, sorted by length and bucketed, each
        row's place in the corpus in 'example_index'."""
        return list(self.task.eval_batches(self.name, 1, self.limit))


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
    prompt = _prompt(inputs, prefix)
    return decoding.translate_greedy(config, params, inputs, prompt=prompt, **kw)


def _beam(params: Any, inputs: jax.Array, *, config: ModelConfig, prefix=(), **kw: Any):
    return decoding.translate_beam(config, params, inputs, prompt=_prompt(inputs, prefix), **kw)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Ancestral sampling instead of search: softmax(filtered logits / temperature), top_k
    (0: off) and top_p (1.0: off) filtered (search.filter_logits). Row r's draws come from
    key fold_in(fold_in(key(seed), line), k) for its line's id and sample number k, so a
    line's samples do not depend on which lines share its batch, or on its place in it."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def _sample(params: Any, inputs: jax.Array, *, config: ModelConfig, seed: int, prefix=(), **kw):
    """inputs [B, 2 + S]: each row's line id, sample number, then its source -> tokens [B, T].

    Each row is sampled alone (vmap over batches of one) with its own key: search.py's
    sampling draws one key per step for the whole batch, so a row's draws would otherwise
    follow its place in the batch."""
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
    """Decode every batch -> per example, in corpus order: (its source ids [S'] as decoded,
    padding dropped; its `nbest` outputs, each token ids [T'] with forced prefix and EOS,
    padding dropped), best first for beam search.

    Greedy when beam_size == 1 and `sampling` is None; beam search keeps its `nbest` best
    (nbest <= beam_size). With `sampling`, batches also carry 'sample_key' [B, 2] (each row's
    line id and sample number, Sampling's key), and every row is one sample. Devices and
    compilation as `translate_batches` says."""
    if nbest > 1 and sampling is None and nbest > beam_size:
        raise ValueError(f"nbest={nbest} needs beam_size >= {nbest} (beam_size={beam_size})")
    out: list = [None] * num_examples
    params = nn.meta.unbox(params)
    devices = data_parallel.devices_for(params) if devices is None else list(devices)
    fn, static = _decoder(
        model_config,
        eos_id,
        max_decode_len,
        beam_size=beam_size,
        length_penalty=length_penalty,
        length_penalty_kind=length_penalty_kind,
        target_prefix=target_prefix,
        sampling=sampling,
    )
    if sampling is not None:
        batches = _with_key_columns(batches)
    batches, pending = _dispatch(fn, static, params, batches, devices)
    for batch, result in zip(batches, pending):
        tokens = _host_outputs(result, beams=fn is _beam, nbest=nbest)
        _store_rows(out, batch, tokens, skip=2 if sampling is not None else 0)  # the key columns
    missing = [i for i, h in enumerate(out) if h is None]
    if missing:
        raise RuntimeError(f"{len(missing)} examples were not decoded (first: {missing[:5]})")
    return out


def _decoder(
    model_config: ModelConfig,
    eos_id: int,
    max_decode_len: int | None,
    *,
    beam_size: int,
    length_penalty: float,
    length_penalty_kind: str,
    target_prefix: Sequence[int],
    sampling: Sampling | None,
) -> tuple[Callable[..., jax.Array], dict[str, Any]]:
    """The decoding function of `decode_batches`' arguments (`_sample`, `_beam` or `_greedy`)
    and its static keyword arguments (the compiled program's key)."""
    static: dict[str, Any] = dict(config=model_config, max_decode_len=max_decode_len, eos_id=eos_id)
    if sampling is not None:
        fn = _sample
        static.update(
            seed=int(sampling.seed),
            temperature=float(sampling.temperature),
            top_k=int(sampling.top_k),
            top_p=float(sampling.top_p),
        )
    elif beam_size > 1:
        fn = _beam
        static.update(beam_size=beam_size, length_penalty=length_penalty)
        if length_penalty_kind != "gnmt":
            static.update(length_penalty_kind=length_penalty_kind)
    else:
        fn = _greedy
    if target_prefix:
        static.update(prefix=tuple(int(i) for i in target_prefix))
    return fn, static


def _with_key_columns(batches: Iterable[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Batches whose 'inputs' [B, S] become [B, 2 + S]: 'sample_key' [B, 2] then the source
    (`_sample`'s inputs)."""
    # The key columns go before the source: group_batches pads sources on the right.
    return [
        {**b, "inputs": np.concatenate([b["sample_key"], b["inputs"]], 1).astype(np.int32)}
        for b in batches
    ]


def _dispatch(
    fn: Callable[..., Any],
    static: dict[str, Any],
    params: Any,
    batches: Iterable[dict[str, np.ndarray]],
    devices: list[jax.Device],
) -> tuple[list[dict[str, np.ndarray]], list[Any]]:
    """Every batch's decoding started -> (the batches as decoded, their unfetched results):
    on `devices` (data_parallel.py, batches grouped D at a time) or, with none, on the mesh
    the parameters live on."""
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


def _host_outputs(result: Any, *, beams: bool, nbest: int) -> np.ndarray:
    """A batch's decoding result (beam search's (tokens, scores), else tokens) -> its `nbest`
    outputs per row on the host: [B, n, T], n = 1 but for beam search's n-best."""
    tokens = np.asarray(jax.device_get(result[0] if beams else result))
    return tokens[:, :nbest] if beams else tokens[:, None]


def _store_rows(out: list, batch: dict[str, np.ndarray], tokens: np.ndarray, *, skip: int) -> None:
    """out[example_index] = (source ids, [output ids, ...]) of each real row of `batch`, padding
    dropped; tokens [B, n, T]; the source is batch['inputs'] after its first `skip` columns."""
    for row, (index, valid) in enumerate(zip(batch["example_index"], batch["example_mask"])):
        if valid:
            source = batch["inputs"][row, skip:]
            out[int(index)] = (source[source != 0], [t[t != 0] for t in tokens[row]])


def translate_batches(
    model_config: ModelConfig,
    params: Any,
    batches: Iterable[dict[str, np.ndarray]],
    tokenizer: Tokenizer,
    num_examples: int,
    *,
    beam_size: int = 1,
    length_penalty: float = 0.6,
    max_decode_len: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    target_prefix: Sequence[int] = (),
    length_penalty_kind: str = "gnmt",
) -> list[str]:
    """Decode every batch (greedy when beam_size == 1) -> hypotheses in corpus order.

    `target_prefix`: ids every output is forced to start with (an M2M100/NLLB target-language
    token; the tokenizer drops it from the text). `length_penalty_kind`: beam search's, 'gnmt' or
    'fairseq' (length^length_penalty, as Transformers and CTranslate2 divide).

    Batches carry 'inputs' [B, S], 'example_index' [B] and 'example_mask' [B]. Parameters on
    one device are decoded on every local device of its platform (data_parallel.py:
    `devices`, default all of them; D consecutive batches at a time, batch k on device k);
    parameters spread over a mesh, on that mesh. The programs of different batch shapes
    compile concurrently (compilation.dispatch)."""
    decoded = decode_batches(
        model_config,
        params,
        batches,
        tokenizer.eos_id,
        num_examples,
        beam_size=beam_size,
        length_penalty=length_penalty,
        max_decode_len=max_decode_len,
        devices=devices,
        target_prefix=target_prefix,
        length_penalty_kind=length_penalty_kind,
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
    """The split's hypotheses in corpus order: its eval batches decoded (`translate_batches`,
    each output forced to start with `split.target_prefix`, which the text leaves out), or
    `translate(sources)` when given (e.g. through a pivot language: multilingual.py)."""
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
    model_config: ModelConfig,
    params: Any,
    tokenizer: Tokenizer,
    split: Split,
    *,
    beam_size: int = 1,
    length_penalty: float = 0.6,
    translate: Translator | None = None,
) -> SplitQuality:
    """Translate a split (`translate_split`: greedy when beam_size == 1) and score it against
    its references with sacreBLEU."""
    start = time.time()
    hyps = translate_split(
        model_config,
        params,
        tokenizer,
        split,
        beam_size=beam_size,
        length_penalty=length_penalty,
        translate=translate,
    )
    seconds = time.time() - start
    bleu, chrf, sig, chrf_sig = bleu_chrf(hyps, split.references)
    return SplitQuality(bleu, chrf, sig, chrf_sig, hyps, split.references, seconds)


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
    """{'bleu', 'chrf', 'bleu_signature'} of a split; for a multilingual task (one with
    `directions`, data/tasks.py) also 'bleu/en-de', 'chrf/en-de', ... per direction
    (the first `limit` pairs of each), and 'bleu' / 'chrf' are the means over its training
    directions (`task.directions`; extra, e.g. zero-shot, directions are reported only)."""

    def result(task: Any) -> SplitQuality:
        data = Split(task, split, limit)
        return measure_split(
            model_config,
            params,
            task.tokenizer,
            data,
            beam_size=beam_size,
            length_penalty=length_penalty,
        )

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
