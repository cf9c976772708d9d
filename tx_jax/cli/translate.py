"""Translate stdin to stdout with a checkpoint: output line i translates input line i.

    tx_jax translate --workdir=runs/default < source.txt > hypotheses.txt
    tx_jax translate --workdir=runs/default --average_last=5 --beam_size=4 \
        --length_penalty=0.6 --batch_size=64 < source.txt
    tx_jax translate --checkpoint=runs/default/averaged/last5/600 < source.txt
    tx_jax translate --workdir=runs/multi --target_lang=fr [--pivot=en] < de.txt
    tx_jax translate --workdir=runs/nllb --source_lang=eng_Latn --target_lang=deu_Latn
    tx_jax translate --workdir=runs/default --input='corpus/*.en.gz,extra.en' \
        --output_dir=out [--shard_lines=2000] [--nbest=4 --scores] [--sampling=topk:10 \
        --temperature=0.8 --seed=1]

Parameters, tokenizer and model config come from the checkpoint (inference/restore.py); no
dataset is read or prepared. Lines are split on '\\n' (a trailing '\\r' is dropped), decoded
as UTF-8 with invalid bytes replaced (U+FFFD), and translated in batches of --batch_size
sources, each padded to the checkpoint's data.max_eval_len tokens as evaluation pads them (so
the same line gets the same translation). An empty or whitespace-only line gives an empty
line; a line longer than that (EOS included) is truncated, with a warning on stderr. Progress
and warnings go to stderr, translations alone to stdout.

With --input (comma-separated files or globs, local or gs://, plain or .gz) the lines are
translated into --output_dir instead, one output file per input (its name without .gz), in
fixed shards of --shard_lines lines that the processes of a multi-host run share and a
relaunch resumes (inference/corpus.py; README: "Translating a corpus").

Output format (both modes): one line per input line; --nbest=N gives N lines per input line
(best first; N samples with --sampling), --scores adds two tab-separated columns,
ln p(output | source) and its token count (as tx_jax score prints them). A blank input line
gives N empty lines (with --scores: <TAB>nan<TAB>0).
"""

from __future__ import annotations

import functools
import sys
import time
from typing import BinaryIO

from absl import app, flags

from tx_jax.cli import common
from tx_jax.data import directions
from tx_jax.inference import corpus, languages, quality, restore, translation
from tx_jax.inference.search import LENGTH_PENALTIES
from tx_jax.inference.translation import translate_lines
from tx_jax.training import parallel


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def read_lines(stream: BinaryIO) -> list[str]:
    """Lines of a byte stream as text: split on b'\\n', '\\r' before it dropped, invalid
    UTF-8 replaced; a final newline does not start another line."""
    return corpus.split_lines(stream.read())


def _sampling(f) -> quality.Sampling | None:
    """--sampling=topk:K | topp:P (with --temperature, --seed) -> Sampling; None: search."""
    if not f.sampling:
        return None
    kind, _, value = f.sampling.partition(":")
    try:
        if kind == "topk" and int(value) >= 0:
            return quality.Sampling(f.temperature, int(value), 1.0, f.seed)
        if kind == "topp" and 0.0 < float(value) <= 1.0:
            return quality.Sampling(f.temperature, 0, float(value), f.seed)
    except ValueError:
        pass
    raise app.UsageError(
        f"--sampling={f.sampling}: expected topk:K (K >= 0, 0: the whole softmax) or topp:P "
        "(0 < P <= 1)"
    )


def _search(f) -> dict:
    """The flags' search, batching and lengths, as translation's decoders take them."""
    buckets = None if f.length_buckets is None else [int(x) for x in f.length_buckets]
    return dict(
        beam_size=f.beam_size,
        length_penalty=f.length_penalty,
        batch_size=f.batch_size,
        max_len=f.max_len,
        length_buckets=buckets,
    )


def _decoder(f, loaded: restore.Loaded, sampling: quality.Sampling | None):
    """decode(lines, line_ids, progress(done), line_name) -> each line's hypotheses, with the
    flags' search, languages and output options (translation.decode_lines)."""
    if f.nbest < 1:
        raise app.UsageError(f"--nbest={f.nbest}: expected >= 1")
    if sampling is None and f.nbest > f.beam_size:
        raise app.UsageError(
            f"--nbest={f.nbest} needs --beam_size >= {f.nbest} (or --sampling: N samples)"
        )
    if sampling is not None and f.temperature < 0:
        raise app.UsageError(f"--temperature={f.temperature}: expected >= 0 (0: greedy)")
    if f.pivot and not directions.is_multilingual(loaded.config.data):
        raise app.UsageError("--pivot is for tx_jax's multilingual runs")
    if f.pivot and not f.target_lang:
        raise app.UsageError("--pivot needs --target_lang (a multilingual checkpoint)")
    kwargs = dict(_search(f), length_penalty_kind=f.length_penalty_kind, sampling=sampling)
    source, target = languages.prefixes(loaded, f.source_lang, f.target_lang)
    pivot = languages.prefixes(loaded, None, f.pivot) if f.pivot else None

    def decode(lines, line_ids, progress, line_name=None):
        report = lambda done, total: progress(done)  # noqa: E731
        if pivot is not None:  # into the pivot language first, its best (or first sample)
            first = translation.decode_lines(
                loaded, lines, source_prefix=pivot[0], line_ids=line_ids, **kwargs
            )
            lines = [h[0].text if h else "" for h in first]
        return translation.decode_lines(
            loaded,
            lines,
            source_prefix=source,
            target_prefix=target,
            line_ids=line_ids,
            nbest=f.nbest,
            scores=f.scores,
            progress=report,
            line_name=line_name,
            **kwargs,
        )

    return decode


def _settings(f, loaded: restore.Loaded, sampling, overrides) -> dict:
    """What decides a corpus job's outputs (corpus.Job.settings): a relaunch must match."""
    return dict(
        checkpoint=str(loaded.path),
        step=int(loaded.step),
        overrides=dict(overrides),
        beam_size=None if sampling else f.beam_size,
        length_penalty=None if sampling else f.length_penalty,
        length_penalty_kind=None if sampling else f.length_penalty_kind,
        sampling=None if sampling is None else [f.sampling, f.temperature, f.seed],
        nbest=f.nbest,
        scores=f.scores,
        max_len=f.max_len,
        source_lang=f.source_lang,
        target_lang=f.target_lang,
        pivot=f.pivot,
    )


def _translate_corpus(f, where: dict, overrides: dict[str, str]) -> None:
    """--input: the files translated into --output_dir, shard by shard (inference/corpus.py),
    this process's share of a multi-host run (jax.distributed, as training starts it)."""
    if not f.output_dir:
        raise app.UsageError("--input needs --output_dir (where the translations go)")
    parallel.maybe_initialize_distributed({})  # JAX_COORDINATOR_ADDRESS & co., before JAX runs
    import jax

    inputs = corpus.expand(f.input)
    loaded = restore.load(f.workdir, **where, overrides=overrides)
    sampling = _sampling(f)
    decode = _decoder(f, loaded, sampling)
    index, count = jax.process_index(), jax.process_count()
    how = f"sampling {f.sampling}" if sampling else f"beam {f.beam_size}"
    _stderr(
        f"translate: {loaded.path} (step {loaded.step}), {how}, {len(inputs)} files -> "
        f"{f.output_dir}, process {index} of {count}"
    )
    job = corpus.Job(inputs, f.output_dir, f.shard_lines, _settings(f, loaded, sampling, overrides))
    written = corpus.run(
        job,
        decode,
        functools.partial(corpus.format_line, nbest=f.nbest, scores=f.scores),
        process_index=index,
        process_count=count,
    )
    for path in written:
        _stderr(f"translate: wrote {path}")


def _main(argv: list[str], overrides: dict[str, str]) -> None:
    f = flags.FLAGS
    if f.input:
        return _translate_corpus(f, common.checkpoint_args(argv, " (sources: --input)"), overrides)
    where = common.checkpoint_args(argv, " (sources come on stdin)")
    start = time.time()
    if f.nbest != 1 or f.scores or f.sampling:  # the corpus mode's outputs, on stdout
        loaded = restore.load(f.workdir, **where, overrides=overrides)
        lines = read_lines(sys.stdin.buffer)
        decode = _decoder(f, loaded, _sampling(f))
        hyps = decode(
            lines,
            list(range(len(lines))),
            lambda done: _stderr(f"translate: {done} lines, {time.time() - start:.1f} s"),
        )
        text = "".join(corpus.format_line(h, f.nbest, f.scores) for h in hyps)
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.flush()
        return
    loaded = restore.load(f.workdir, **where, overrides=overrides)
    _stderr(f"translate: {loaded.path} (step {loaded.step}), beam {f.beam_size}")
    lines = read_lines(sys.stdin.buffer)

    def progress(done: int, total: int) -> None:
        _stderr(f"translate: {done}/{total} lines, {time.time() - start:.1f} s")

    kwargs = dict(_search(f), progress=progress)
    if f.length_penalty_kind != "gnmt":
        kwargs["length_penalty_kind"] = f.length_penalty_kind
    if languages.is_imported(loaded.tokenizer):  # M2M100/NLLB, multi-target OPUS-MT
        if f.pivot:
            raise app.UsageError("--pivot is for tx_jax's multilingual runs")
        source, target = languages.prefixes(loaded, f.source_lang, f.target_lang)
        out = translate_lines(loaded, lines, source_prefix=source, target_prefix=target, **kwargs)
    elif f.target_lang:  # a multilingual model: tag the sources (through a pivot if asked)
        from tx_jax.inference import multilingual

        out = multilingual.translate_to(loaded, lines, f.target_lang, pivot=f.pivot, **kwargs)
    elif f.pivot:
        raise app.UsageError("--pivot needs --target_lang (a multilingual checkpoint)")
    elif directions.is_multilingual(loaded.config.data):
        raise app.UsageError(
            f"{loaded.path} is multilingual: give --target_lang (e.g. "
            f"{loaded.config.data.target_lang})"
        )
    else:
        out = translate_lines(loaded, lines, **kwargs)
    sys.stdout.buffer.write("".join(line + "\n" for line in out).encode("utf-8"))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    common.define_checkpoint_flags(search=True)
    flags.DEFINE_integer(
        "batch_size", None, "Source lines per decoding batch (default: data.eval_batch_size)."
    )
    flags.DEFINE_integer(
        "max_len",
        None,
        "Truncate sources to this many tokens (default: the checkpoint's data.max_eval_len).",
    )
    flags.DEFINE_list(
        "length_buckets",
        None,
        "Pad each batch to the smallest of these lengths that holds it (e.g. 16,32,64; "
        "default: the checkpoint's eval buckets, 16, 24, 40, 64, ... up to "
        "data.max_eval_len). Shapes to compile, not translations: those do not depend on it.",
    )
    flags.DEFINE_string(
        "target_lang",
        None,
        "Multilingual checkpoints: translate into this language (its <2xx> tag goes before "
        "each source); imported M2M100/NLLB (forced first token) and multi-target OPUS-MT "
        "(>>xx<< before the source): the target (default: the tokenizer config's).",
    )
    flags.DEFINE_string(
        "source_lang", None, "Imported M2M100/NLLB: the sources' language (default: its config's)."
    )
    flags.DEFINE_enum(
        "length_penalty_kind",
        "gnmt",
        list(LENGTH_PENALTIES),
        "Beam search divides log p by ((5 + length) / 6)^a (gnmt) or length^a (fairseq: "
        "CTranslate2's), a = --length_penalty; hf / hf_early / hf_never: Transformers' "
        "generate with early_stopping=False / True / 'never', token for token.",
    )
    flags.DEFINE_string(
        "pivot",
        None,
        "With --target_lang: translate into this language first, then from it (e.g. en).",
    )
    flags.DEFINE_string(
        "input",
        None,
        "Translate files instead of stdin: comma-separated files or globs (wildcards in the "
        "file name), local or gs://, plain or .gz; outputs go to --output_dir.",
    )
    flags.DEFINE_string(
        "output_dir", None, "With --input: OUT/<input name without .gz> (and OUT/.shards)."
    )
    flags.DEFINE_integer(
        "shard_lines",
        2000,
        "With --input: lines per shard, the unit processes share and a relaunch redoes; a "
        "relaunch must keep it.",
    )
    flags.DEFINE_integer(
        "nbest", 1, "Outputs per input line, each on its own line (beam: <= --beam_size)."
    )
    flags.DEFINE_bool(
        "scores", False, "Add ln p(output | source) and its token count, tab-separated."
    )
    flags.DEFINE_string(
        "sampling",
        None,
        "Sample instead of beam search: topk:K (K >= 0; 0: the whole softmax) or topp:P. "
        "Line i's samples come from --seed and i (its index over all inputs), so they do not "
        "depend on batching, sharding or the number of processes.",
    )
    flags.DEFINE_float("temperature", 1.0, "With --sampling: softmax temperature (0: greedy).")
    flags.DEFINE_integer("seed", 0, "With --sampling: the seed of every line's samples.")
    common.run_cli(_main, argv)
