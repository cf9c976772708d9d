"""`tx_jax translate --input=... --output_dir=...` (inference/corpus.py): a corpus
translated in fixed shards equals the stdin mode's translation line for line, whatever kills,
relaunches, process counts, devices, shard sizes or storage (gs://) it went through.

One tiny run is trained for the module; the CLI runs in subprocesses where a process must be
killed or several must run (jax.distributed on 127.0.0.1), in this process elsewhere.
"""

import gzip
import json
import os
import pathlib
import random
import subprocess
import sys
import time
import types

import portpicker
import pytest
import zygote
from helpers import ROOT, forced_devices, tiny_config

from tx_jax import paths
from tx_jax.cli import translate as cli
from tx_jax.data import datasets
from tx_jax.inference import corpus, restore, translation
from tx_jax.runner.loop import train_and_evaluate

# the module's trained run is shared by its tests: one xdist worker runs them all (launch.sh's
# --dist loadfile; this mark does the same under --dist loadgroup), so it is trained once
pytestmark = pytest.mark.xdist_group("translate_corpus")

BEAM = ("--beam_size=2", "--batch_size=8")
SAMPLE = ("--sampling=topk:5", "--temperature=1.0", "--nbest=2", "--batch_size=8")
# the same, with --seed=3 --scores, for the corpus mode in this process (_run_here)
SAMPLED = dict(sampling="topk:5", seed=3, nbest=2, scores=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tfds_dir):
    """The workdir, the corpus (a.txt plain, b.txt.gz with an empty line) and the reference:
    the stdin mode's translation (translate_lines) of each file, beam 2."""
    root = tmp_path_factory.mktemp("corpus")
    config = tiny_config(tfds_dir, **{"train.num_steps": 40, "train.warmup_steps": 10})
    train_and_evaluate(config, root / "run")
    loaded = restore.load(root / "run")
    sources = [s for s, _ in datasets.load_split(loaded.config.data, "validation")]
    files = {"a.txt": sources[:23], "b.txt": sources[23:30] + ["", "  "] + sources[30:36]}
    (root / "in").mkdir()
    (root / "in" / "a.txt").write_text("".join(x + "\n" for x in files["a.txt"]))
    with gzip.open(root / "in" / "b.txt.gz", "wt") as f:
        f.write("".join(x + "\n" for x in files["b.txt"]))
    reference = {
        name: translation.translate_lines(loaded, lines, beam_size=2, batch_size=8)
        for name, lines in files.items()
    }
    return types.SimpleNamespace(
        root=root, workdir=root / "run", loaded=loaded, files=files, reference=reference
    )


def _inputs(run) -> str:
    return f"{run.root}/in/a.txt,{run.root}/in/*.gz"


def _env(**extra) -> dict:
    return dict(
        os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra
    )


def _launch(run, out, *flags, env=None, log=None) -> subprocess.Popen:
    args = [f"--workdir={run.workdir}", f"--input={_inputs(run)}", f"--output_dir={out}", *flags]
    return zygote.Popen(
        [sys.executable, "-m", "tx_jax", "translate", *args],
        cwd=ROOT,
        env=env or _env(),
        stdout=subprocess.DEVNULL,
        stderr=log or subprocess.PIPE,
    )


def _finish(proc: subprocess.Popen, timeout: int = 240) -> str:
    _, err = proc.communicate(timeout=timeout)
    err = err.decode() if err else ""
    assert proc.returncode == 0, err[-4000:]
    return err


def _outputs(out) -> dict[str, bytes]:
    return {name: (pathlib.Path(out) / name).read_bytes() for name in ("a.txt", "b.txt")}


def _expected(run) -> dict[str, bytes]:
    return {k: "".join(x + "\n" for x in v).encode() for k, v in run.reference.items()}


def _flags(**kw) -> types.SimpleNamespace:
    """The CLI's flag values, for its decoder in this process."""
    base = dict(
        beam_size=2,
        length_penalty=0.6,
        batch_size=8,
        max_len=None,
        length_penalty_kind="gnmt",
        length_buckets=None,
        nbest=1,
        scores=False,
        sampling=None,
        temperature=1.0,
        seed=0,
        source_lang=None,
        target_lang=None,
        pivot=None,
    )
    return types.SimpleNamespace(**{**base, **kw})


def _run_here(run, out, shard_lines, inputs=None, **kw) -> dict[str, bytes]:
    """The corpus mode in this process (1 process, 1 device) -> output name -> bytes."""
    f = _flags(**kw)
    sampling = cli._sampling(f)
    job = corpus.Job(
        inputs or corpus.expand(_inputs(run)),
        str(out),
        shard_lines,
        cli._settings(f, run.loaded, sampling, {}),
    )
    fmt = lambda h: corpus.format_line(h, f.nbest, f.scores)  # noqa: E731
    corpus.run(job, cli._decoder(f, run.loaded, sampling), fmt)
    return {name: (paths.Path(out) / name).read_bytes() for name in ("a.txt", "b.txt")}


def test_sharded_job_killed_and_relaunched_equals_stdin_mode_line_for_line(run, tmp_path):
    """kill -9 of the CLI after a random number of finished shards; the relaunch translates
    only the unfinished shards and gives the stdin mode's translation line for line; one more
    finds everything done; one with other settings is refused."""
    rng = random.Random(0)
    out = tmp_path / "out"
    proc = _launch(run, out, *BEAM, "--shard_lines=3")
    wanted, deadline = rng.randint(1, 8), time.time() + 240
    while len(list(out.glob(".shards/*/*.done"))) < wanted and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    done = list(out.glob(".shards/*/*.done"))
    assert len(done) >= 1  # 13 shards of 3 lines in all
    kept = sum(len(p.with_suffix(".txt").read_text().splitlines()) for p in done)
    err = _finish(_launch(run, out, *BEAM, "--shard_lines=3"))
    assert _outputs(out) == _expected(run)
    assert run.reference["b.txt"][7:9] == ["", ""] and len(run.reference["b.txt"]) == 15
    redone = int(err.split(" lines (this process)")[0].rsplit("/", 1)[1])
    # only the unfinished shards, every line of them: with the kept ones, the 38 lines
    assert redone < 38 and redone + kept == 38, (redone, kept)
    assert f"{redone}/{redone} lines (this process)" in err and "lines/s, ETA" in err
    # the shards (a write the kill interrupted may have left a hidden .NAME.tmpPID)
    state = out / ".shards"
    assert sorted(p.name for p in (state / "a.txt").iterdir() if p.name[0] != ".") == [
        f"0000{k}.{x}" for k in range(8) for x in ("done", "txt")
    ]  # 23 lines: 7 shards of 3, then 2
    assert len(list((state / "b.txt").glob("*.done"))) == 5  # 15 lines
    # a relaunch (in this process: the same job's settings) finds everything done, decodes
    # no line and writes the same files, also when the first launch named the length penalty
    # `alpha` and its rule `length_penalty`
    job = json.loads((state / "job.json").read_text())
    named_then = {k: v for k, v in job.items() if not k.startswith("length_penalty")}
    named_then.update(alpha=job["length_penalty"], length_penalty=job["length_penalty_kind"])
    (state / "job.json").write_text(json.dumps(named_then))
    real, decoded = cli._decoder, []

    def counting(*args):
        def decode(lines, *rest, **kw):
            decoded.append(len(lines))
            return inner(lines, *rest, **kw)

        inner = real(*args)
        return decode

    with pytest.MonkeyPatch.context() as m:
        m.setattr(cli, "_decoder", counting)
        assert _run_here(run, out, 3) == _expected(run)
    assert sum(decoded) == 0
    # ... and one with other settings is refused, naming them (a ValueError: the command
    # line's one-line error, common.run_cli)
    with pytest.raises(ValueError, match="beam_size: 2 then, 3 now"):
        _run_here(run, out, 3, beam_size=3)


def test_a_crash_after_any_shard_or_before_its_marker_relaunches_to_the_same_files(run, tmp_path):
    """In this process, sampling: a crash after k of the 10 shards (a shard's lines written,
    not its marker), or while assembling a.txt or b.txt (k = 10, 11): the relaunch gives the
    uninterrupted run's bytes. (The decoding settings are those of the 2-process test's
    reference: the same programs.)"""
    reference = _run_here(run, tmp_path / "whole", 4, **SAMPLED)
    real = paths.write_atomic
    for k in [0, 3, 10, 11]:
        target = tmp_path / f"crash{k}"
        calls = {"n": 0}

        def crashing(path, data, k=k, calls=calls):
            if str(path).endswith(".done") or "/.shards/" not in str(path):
                calls["n"] += 1
                if calls["n"] > k:
                    raise KeyboardInterrupt("killed")
            return real(path, data)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(paths, "write_atomic", crashing)
            with pytest.raises(KeyboardInterrupt):
                _run_here(run, target, 4, **SAMPLED)
        assert len(list(target.glob(".shards/*/*.done"))) == min(k, 10)
        assert _run_here(run, target, 4, **SAMPLED) == reference


def test_two_processes_with_four_devices_give_one_process_files(run, tmp_path):
    """2 processes x 4 forced CPU devices (jax.distributed on 127.0.0.1), sampling 2 per line
    with scores, give the files of this one-process, one-device run: each took its shards."""
    reference = _run_here(run, tmp_path / "one", 5, **SAMPLED)
    port = portpicker.pick_unused_port()
    procs = []
    for i in range(2):
        env = _env(
            XLA_FLAGS=forced_devices(4),
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(i),
        )
        with open(tmp_path / f"process{i}.log", "wb") as log:  # the child keeps a copy
            procs.append(
                _launch(
                    run,
                    tmp_path / "two",
                    *SAMPLE,
                    "--seed=3",
                    "--scores",
                    "--shard_lines=5",
                    env=env,
                    log=log,
                )
            )
    for p in procs:
        p.wait(timeout=300)
    text = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(t[-3000:] for t in text)
    assert _outputs(tmp_path / "two") == reference
    assert "process 1 of 2" in text[1]
    # shards of 5: a.txt's 0-4 (the last of 3 lines), b.txt's 5-7; even ones to process 0
    counts = [int(t.split(" lines (this process)")[-2].rsplit("/", 1)[1]) for t in text]
    assert counts == [5 + 5 + 3 + 5, 5 + 5 + 5 + 5]
    lines = reference["a.txt"].decode().split("\n")[:-1]
    assert len(lines) == 2 * 23 and all(len(x.split("\t")) == 3 for x in lines)


def test_sampling_is_reproducible_per_seed_whatever_the_shards(run, tmp_path):
    one = _run_here(run, tmp_path / "s5", 5, sampling="topp:0.9", seed=7, nbest=2)
    assert _run_here(run, tmp_path / "s13", 13, sampling="topp:0.9", seed=7, nbest=2) == one
    other = _run_here(run, tmp_path / "seed8", 5, sampling="topp:0.9", seed=8, nbest=2)
    a, b = (x["a.txt"].decode().split("\n") for x in (one, other))
    assert sum(x != y for x, y in zip(a, b)) > len(a) // 2  # another seed: other samples
    samples = one["a.txt"].decode().split("\n")
    assert sum(samples[2 * i] != samples[2 * i + 1] for i in range(23)) > 10  # 2 per line
    blank = one["b.txt"].decode().split("\n")
    assert blank[14:18] == ["", "", "", ""]  # lines 8 and 9 of b: empty, 2 lines each
    # the stdin mode's sampling, all lines in one batch of 40, draws the same samples
    lines = run.files["a.txt"] + run.files["b.txt"]
    f = _flags(sampling="topp:0.9", seed=7, nbest=2, batch_size=40)
    hyps = cli._decoder(f, run.loaded, cli._sampling(f))(lines, list(range(38)), lambda n: None)
    text = "".join(corpus.format_line(h, 2) for h in hyps).encode()
    assert text == one["a.txt"] + one["b.txt"]


def test_gcs_input_and_output(run, gcs):
    bucket = "gs://tx-jax-test/corpus"
    for name in ("a.txt", "b.txt.gz"):
        (paths.Path(bucket) / "in" / name).write_bytes((run.root / "in" / name).read_bytes())
    inputs = corpus.expand(f"{bucket}/in/a.txt,{bucket}/in/*.gz")
    assert inputs == [f"{bucket}/in/a.txt", f"{bucket}/in/b.txt.gz"]
    got = _run_here(run, f"{bucket}/out", 7, inputs=inputs)
    assert got == _expected(run)
    assert len(paths.glob(f"{bucket}/out/.shards/a.txt/*.done")) == 4


def test_clear_errors(run, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.txt matches no file"):
        corpus.expand(f"{run.root}/in/a.txt,{run.root}/in/nothing.txt")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "a.txt").write_text("x\n")
    with pytest.raises(ValueError, match="would both be written to <output_dir>/a.txt"):
        corpus.expand(f"{run.root}/in/a.txt,{tmp_path}/x/a.txt")
    with pytest.raises(ValueError, match="wildcards may only be in the file name"):
        paths.glob(f"{run.root}/*/a.txt")
    with pytest.raises(Exception, match="--nbest=3 needs --beam_size >= 3"):
        cli._decoder(_flags(nbest=3), run.loaded, None)
    with pytest.raises(Exception, match="--sampling=top5: expected topk:K"):
        cli._sampling(_flags(sampling="top5"))
