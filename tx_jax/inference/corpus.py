"""Translating a corpus of files: fixed shards, shared by processes, resumable after a kill.

    job = corpus.Job(inputs=corpus.expand("a.en,b/*.en.gz"), output_dir="out",
                     shard_lines=2000, settings={...})
    corpus.run(job, decode, fmt, process_index=0, process_count=1)

Each input's lines are cut into shards of `shard_lines` lines, numbered across the inputs: the
layout depends on the inputs and shard_lines only, so a relaunch on other processes finds the
same shards. Process p of P takes the shards i with i % P == p; a shard's output is written
whole, then its marker, and a relaunch redoes the shards without one. Once its own shards are
written, every process assembles each input whose markers all exist (the last one to finish
sees them all; two that see them together write the same bytes).

    OUT/<name>                     the translations of input <name>[.gz], line i for line i
    OUT/.shards/job.json           what decides the output: a relaunch with others is refused
    OUT/.shards/<name>/NNNNN.txt   shard NNNNN's lines; NNNNN.done its marker {"lines", "bytes"}

A line's id is its index over all inputs (sampling draws from it), so an output never
depends on the shard or batch it fell in.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from tx_jax import paths
from tx_jax.inference.translation import Hypothesis

STATE = ".shards"  # under the output directory: shard files, markers, job.json

# decode(lines, line ids, progress(lines done), line_name(i) for warnings) -> hypotheses
Decode = Callable[
    [list[str], list[int], Callable[[int], None], Callable[[int], str]], list[list[Hypothesis]]
]


def split_lines(data: bytes) -> list[str]:
    """Lines of a file's bytes as text: split on b'\\n', a '\\r' before it dropped, invalid
    UTF-8 replaced (U+FFFD); a final newline does not start another line."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line.removesuffix(b"\r").decode("utf-8", errors="replace") for line in lines]


def expand(pattern: str) -> list[str]:
    """Comma-separated files or globs (local or gs://) -> the files, in the order given (each
    glob's matches sorted); a glob that matches nothing, or a file named twice, is an error."""
    out: list[str] = []
    for item in (x.strip() for x in pattern.split(",")):
        if not item:
            continue
        found = paths.glob(item)
        if not found or not paths.Path(found[0]).exists():
            raise FileNotFoundError(f"--input: {item} matches no file")
        out += found
    if not out:
        raise ValueError(f"--input={pattern!r} names no file")
    names: dict[str, str] = {}
    for path in out:
        name = output_name(path)
        if name in names:
            raise ValueError(
                f"--input: {names[name]} and {path} would both be written to <output_dir>/{name}"
            )
        names[name] = path
    return out


def output_name(path: str) -> str:
    """The output's file name for an input: its name without '.gz'."""
    return paths.Path(path).name.removesuffix(".gz")


def format_line(hyps: Sequence[Hypothesis], nbest: int = 1, scores: bool = False) -> str:
    """One input line's output text, newline-ended: `nbest` lines (a blank input: empty
    ones), each the hypothesis' text, or with `scores` TEXT<TAB>LOGPROB<TAB>TOKENS (a blank
    input: <TAB>nan<TAB>0; tabs in a text become spaces, keeping the columns)."""
    rows = []
    for k in range(nbest):
        h = hyps[k] if k < len(hyps) else None
        if not scores:
            rows.append(h.text if h else "")
        elif h is None:
            rows.append("\tnan\t0")
        else:
            rows.append(f"{h.text.replace(chr(9), ' ')}\t{h.logprob:.6f}\t{h.tokens}")
    return "".join(r + "\n" for r in rows)


@dataclasses.dataclass(frozen=True)
class Job:
    inputs: Sequence[str]  # files, in order (expand)
    output_dir: str
    shard_lines: int
    settings: dict[str, Any]  # what else decides the outputs (checkpoint, step, search, ...)

    @property
    def state(self) -> paths.Path:
        return paths.Path(self.output_dir) / STATE


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int  # over all inputs: process index % P takes it
    input: int  # which input file
    number: int  # within the file: NNNNN of its files
    start: int  # its lines [start, stop) of the file
    stop: int
    first_id: int  # line id (index over all inputs) of its first line


def layout(line_counts: Sequence[int], shard_lines: int) -> list[Shard]:
    """The shards of inputs with these many lines (a function of these alone)."""
    if shard_lines < 1:
        raise ValueError(f"--shard_lines={shard_lines}: expected >= 1")
    shards, first_id = [], 0
    for f, n in enumerate(line_counts):
        for number, start in enumerate(range(0, n, shard_lines)):
            stop = min(start + shard_lines, n)
            shards.append(Shard(len(shards), f, number, start, stop, first_id + start))
        first_id += n
    return shards


def _renamed(old: dict[str, Any]) -> dict[str, Any]:
    """A job.json written when the length penalty was `alpha` and its rule `length_penalty`,
    under today's names: a relaunch across the rename resumes."""
    if "alpha" not in old:
        return old
    out = {k: v for k, v in old.items() if k not in ("alpha", "length_penalty")}
    return {**out, "length_penalty": old["alpha"], "length_penalty_kind": old["length_penalty"]}


def _check_job(job: Job) -> None:
    """Write job.json, or refuse a relaunch whose settings differ from the first launch's
    (its shards would mix two configurations in one output)."""
    record = {"inputs": list(job.inputs), "shard_lines": job.shard_lines, **job.settings}
    path = job.state / "job.json"
    if path.exists():
        old = _renamed(json.loads(path.read_text()))
        changed = sorted(k for k in set(old) | set(record) if old.get(k) != record.get(k))
        if changed:
            diffs = "; ".join(f"{k}: {old.get(k)!r} then, {record.get(k)!r} now" for k in changed)
            raise ValueError(
                f"{job.output_dir} holds a translation with other settings ({diffs}): give "
                f"another --output_dir, or delete {path.parent} to start over"
            )
        return
    job.state.mkdir(parents=True, exist_ok=True)
    paths.write_atomic(path, json.dumps(record, indent=1, sort_keys=True) + "\n")


def _done(job: Job, name: str) -> set[int]:
    """The shard numbers of input `name` whose marker exists (one listing)."""
    d = job.state / name
    if not d.exists():
        return set()
    return {int(p.name[:-5]) for p in d.iterdir() if p.name.endswith(".done")}


class Progress:
    """'translate: D/N lines (this process), X lines/s, ETA Ts' on stderr, at most every
    `every` seconds (and at the end)."""

    def __init__(self, total: int, every: float = 5.0, out=sys.stderr):
        self.total, self.every, self.out = total, every, out
        self.done, self.start, self.last = 0, time.time(), 0.0

    def report(self, done: int, force: bool = False) -> None:
        self.done = done
        now = time.time()
        if not force and now - self.last < self.every:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        print(
            f"translate: {done}/{self.total} lines (this process), {rate:.1f} lines/s, "
            f"ETA {eta:.0f} s",
            file=self.out,
            flush=True,
        )


def run(
    job: Job,
    decode: Decode,
    fmt: Callable[[Sequence[Hypothesis]], str],
    *,
    process_index: int = 0,
    process_count: int = 1,
    progress_every: float = 5.0,
) -> list[str]:
    """Translate this process's unfinished shards of `job`, then assemble every input whose
    shards are all done -> the output files this process wrote; fmt: `format_line`'s kind."""
    _check_job(job)
    counts = [len(split_lines(paths.read_bytes(p))) for p in job.inputs]
    shards = layout(counts, job.shard_lines)
    names = [output_name(p) for p in job.inputs]
    done = {f: _done(job, names[f]) for f in range(len(job.inputs))}
    mine = [
        s
        for s in shards
        if s.index % process_count == process_index and s.number not in done[s.input]
    ]
    progress = Progress(sum(s.stop - s.start for s in mine), progress_every)
    progress.report(0, force=True)
    finished = 0
    for f in sorted({s.input for s in mine}):  # one input in memory at a time
        lines = split_lines(paths.read_bytes(job.inputs[f]))
        (job.state / names[f]).mkdir(parents=True, exist_ok=True)
        for s in (s for s in mine if s.input == f):
            part = lines[s.start : s.stop]
            ids = list(range(s.first_id, s.first_id + len(part)))
            hyps = decode(
                part,
                ids,
                lambda n, base=finished: progress.report(base + n),
                lambda i, f=f, s=s: f"{job.inputs[f]}:{s.start + i + 1}",
            )
            text = "".join(fmt(h) for h in hyps).encode("utf-8")
            stem = job.state / names[f] / f"{s.number:05d}"
            paths.write_atomic(stem.with_suffix(".txt"), text)
            marker = json.dumps({"lines": len(part), "bytes": len(text)}) + "\n"
            paths.write_atomic(stem.with_suffix(".done"), marker)
            finished += len(part)
            progress.report(finished, force=True)
    return assemble(job, counts)


def assemble(job: Job, counts: Sequence[int]) -> list[str]:
    """Write OUT/<name> for every input whose shards are all done (their files concatenated,
    checked against their markers) -> the paths written."""
    shards = layout(counts, job.shard_lines)
    written = []
    for f, path in enumerate(job.inputs):
        name = output_name(path)
        numbers = [s.number for s in shards if s.input == f]
        if not set(numbers) <= _done(job, name):
            continue
        parts = []
        for n in numbers:
            stem = job.state / name / f"{n:05d}"
            data = stem.with_suffix(".txt").read_bytes()
            marker = json.loads(stem.with_suffix(".done").read_text())
            if len(data) != marker["bytes"]:
                raise ValueError(
                    f"{stem}.txt has {len(data)} bytes but its marker says {marker['bytes']}: "
                    f"delete {stem}.done to translate that shard again"
                )
            parts.append(data)
        out = paths.Path(job.output_dir) / name
        paths.write_atomic(out, b"".join(parts))
        written.append(str(out))
    return written
