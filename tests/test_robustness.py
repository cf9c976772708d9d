"""Nothing lost: config validation, unwritable workdirs, SIGTERM/SIGINT, non-finite losses."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zygote
from helpers import ROOT, tiny_config, train_losses

from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.setup import build_run, size_from_data
from tx_jax.training.checkpoint import Checkpointer


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("model.d_model", 33, "model.d_model=33 is not divisible by model.num_heads=2"),
        ("model.norm_position", "middle", "model.norm_position='middle'"),
        ("train.schedule", "exp", "train.schedule='exp'"),
        ("parallel.strategy", "shard", "parallel.strategy='shard'"),
        ("data.tokens_per_batch", 16, "data.tokens_per_batch=16 is smaller than one row"),
        ("train.grad_accum_steps", 32, "train.grad_accum_steps=32"),
        ("checkpoint.best_metric", "bleuu", "checkpoint.best_metric='bleuu'"),
        ("train.num_steps", 0, "train.num_steps=0 must be positive"),
        ("train.cooldown_steps", -1, "train.cooldown_steps=-1 must be in [0, train.num_steps="),
    ],
)
def test_config_errors_name_the_key_before_anything_compiles(tmp_path, key, value, message):
    config = tiny_config(tmp_path / "tfds_never_made", **{key: value})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "tfds_never_made").exists()  # failed before touching data


def test_unknown_config_key_is_named(tmp_path):
    config = tiny_config(tmp_path)
    config.model.d_modle = 3  # an unlocked ConfigDict accepts it; the model config does not
    with pytest.raises(ValueError, match=r"unknown model config key\(s\) \['d_modle'\]"):
        train_and_evaluate(config, tmp_path / "run")
    # the CLI locks the config: an unknown override is refused by name
    cli = zygote.run(
        [
            sys.executable,
            "-m",
            "tx_jax.main",
            "--config=configs/default.py:debug",
            f"--workdir={tmp_path}/w",
            "--config.model.d_modle=4",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert cli.returncode != 0 and "d_modle" in cli.stderr


def test_unwritable_workdir_is_a_clear_error(tmp_path, tfds_dir):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=f"workdir {blocker}/run is not writable"):
        train_and_evaluate(tiny_config(tfds_dir), blocker / "run")


def _overrides(steps: int) -> dict:
    return {"train.num_steps": steps, "checkpoint.every": 1000}


def _launch(workdir, tfds_dir, overrides: dict):
    """A training process (forked from tests/zygote.py's) on the tiny config with `overrides`;
    its output (stdout and stderr) in `.stdout`."""
    code = (
        "import sys; sys.path.insert(0, 'tests');"
        "from helpers import tiny_config; from tx_jax.runner.loop import train_and_evaluate;"
        f"train_and_evaluate(tiny_config({str(tfds_dir)!r}, **{overrides!r}), "
        f"{str(workdir)!r})"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return zygote.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_step(workdir, step, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (workdir / "metrics.jsonl").exists() and max(train_losses(workdir), default=0) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        time.sleep(0.2)
    raise TimeoutError(f"no step {step} after {timeout} s")


def test_signals_save_a_checkpoint_and_exit_zero(tmp_path, tfds_dir):
    """SIGTERM stops a run with a checkpoint and exit 0; the relaunch continues from there and
    SIGINT stops it the same way; a last relaunch (in this process) continues from that one."""
    workdir = tmp_path / "run"
    stops: list[int] = []  # the step each signal stopped at
    for sig in (signal.SIGTERM, signal.SIGINT):
        resumed_at = stops[-1] if stops else 0
        logged = len(_train_records(workdir))
        proc = _launch(workdir, tfds_dir, _overrides(10_000))
        _wait_for_step(workdir, resumed_at + 3, proc)
        sent = time.time()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
        seconds = time.time() - sent
        assert proc.returncode == 0, out
        assert f"{signal.Signals(sig).name} at step" in out
        stopped = max(train_losses(workdir))
        stops.append(stopped)
        # the signals' saves are the only checkpoints (checkpoint.every=1000)
        assert Checkpointer(workdir / "checkpoints", read_only=True).all_steps() == stops
        assert stopped >= resumed_at + 3
        # this launch started from the last stop's checkpoint: its first step is the next one
        assert _steps(workdir, logged) == list(range(resumed_at + 1, stopped + 1))
        print(f"{signal.Signals(sig).name}: exit 0 after {seconds:.1f} s, checkpoint at {stopped}")
    logged = len(_train_records(workdir))
    train_and_evaluate(tiny_config(tfds_dir, **_overrides(stopped + 2)), workdir)
    assert _steps(workdir, logged) == [stopped + 1, stopped + 2]


def test_too_many_nonfinite_steps_stop_with_a_clear_error(tmp_path, tfds_dir, monkeypatch):
    """A NaN loss skips the update; after train.max_nonfinite_steps in a row training stops
    with FloatingPointError (non-zero exit from the CLI), keeping the last good checkpoint."""
    from tx_jax.training import losses

    real = losses.smoothed_cross_entropy

    def poisoned(logits, targets, weights, label_smoothing=0.0):
        loss, w = real(logits, targets, weights, label_smoothing)
        return loss * jnp.nan, w

    config = tiny_config(
        tfds_dir, **{"train.num_steps": 4, "checkpoint.every": 2, "train.max_nonfinite_steps": 3}
    )
    train_and_evaluate(config.copy_and_resolve_references(), tmp_path / "good")
    good_steps = Checkpointer(tmp_path / "good" / "checkpoints", read_only=True).all_steps()
    assert good_steps[-1] == 4
    monkeypatch.setattr(losses, "smoothed_cross_entropy", poisoned)
    config.train.num_steps = 40
    with pytest.raises(FloatingPointError, match="3 consecutive non-finite"):
        train_and_evaluate(config, tmp_path / "good")
    # steps 5-7 were skipped (the check at step 7 stopped the run); the step-6 checkpoint
    # holds exactly the step-4 parameters and counts two skipped updates
    ckpt = Checkpointer(tmp_path / "good" / "checkpoints", read_only=True)
    assert ckpt.latest_step() == 6
    run = build_run(size_from_data(config, tmp_path / "good"))
    abstract = run.strategy.abstract_state(run.init_fn)
    state, _, _ = ckpt.restore(6, abstract)
    before, _, _ = ckpt.restore(4, abstract)
    assert (int(state.nonfinite_total), int(state.nonfinite_run)) == (2, 2)
    for a, b in zip(
        jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(before.params)
    ):
        np.testing.assert_array_equal(a, b)


KILL_STEPS = 16  # the killed run's num_steps (a checkpoint every 2 steps, async saves)


def _frozen(proc) -> None:
    """Wait until every thread of `proc` has stopped (after SIGSTOP): nothing it does can
    touch its workdir any more."""
    deadline = time.time() + 30
    while time.time() < deadline:
        states = []
        for task in pathlib.Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just ended
                continue
        if all(s in "TtZX" for s in states):
            return
        time.sleep(0.001)
    raise TimeoutError(f"process {proc.pid} did not stop")


def _kill_at(proc, moment, what: str, state, timeout: float = 300) -> None:
    """SIGKILL `proc` at the first moment `moment()` holds: polled, then the process is frozen
    (SIGSTOP) and `moment()` checked again, so the kill lands exactly in it (else SIGCONT and
    poll on). `state()` describes the workdir when the moment never comes."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            err = proc.stdout.read()[-4000:]
            raise AssertionError(
                f"the run ended (exit {proc.returncode}) before {what} ({state()}): {err}"
            )
        if moment():
            proc.send_signal(signal.SIGSTOP)
            _frozen(proc)
            if moment():
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    raise TimeoutError(f"no {what} in {timeout} s ({state()})")


def test_kill_9_in_a_save_and_between_saves_loses_nothing_before_the_last_save(tmp_path, tfds_dir):
    """SIGKILL at two chosen moments of one run, each followed by a relaunch: while an async
    save is in flight (its temporary directory exists), and, in the relaunched process, between
    saves, once the newest checkpoint is committed but before its manifest is written (the
    next save writes it). Each relaunch cleans the temporary directories, resumes from the
    newest complete checkpoint and continues bit for bit as the uninterrupted run: nothing
    before the last complete save is lost. (benchmarks/kill_trials.py kills at random
    moments, as many times as asked.)"""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kill_trials

    from tx_jax.training.checkpoint import MANIFEST

    workdir, ckpt_dir = tmp_path / "run", tmp_path / "run" / "checkpoints"
    overrides = {
        "train.num_steps": KILL_STEPS,
        "checkpoint.every": 2,
        "checkpoint.async_save": True,
    }
    train_and_evaluate(tiny_config(tfds_dir, **overrides), tmp_path / "reference")
    reference = train_losses(tmp_path / "reference")

    def logged() -> int:
        return max(train_losses(workdir), default=0) if (workdir / "metrics.jsonl").exists() else 0

    def newest() -> int:
        return max(kill_trials.complete_steps(workdir), default=0)

    def state() -> str:
        listed = sorted(os.listdir(ckpt_dir)) if ckpt_dir.exists() else []
        return f"checkpoints {listed}, logged {logged()}"

    def in_a_save() -> bool:  # a save of step >= 6 in flight: checkpoints 2 and 4 are done
        return any(int(d.split(".")[0]) >= 6 for d in kill_trials.tmp_dirs(workdir))

    def between_saves() -> bool:  # this process saved, committed, and has not sealed; no
        step = newest()  # temporary directory: the one the first kill left was cleaned
        return (
            step >= resumed[-1] + 4
            and not kill_trials.tmp_dirs(workdir)
            and not (ckpt_dir / str(step) / MANIFEST).exists()
        )

    resumed = [0]  # the step each launch started from
    segments = []  # each launch's train records: (step, loss) as logged
    for what, moment in (("a save in flight", in_a_save), ("a step between saves", between_saves)):
        lines = len(_train_records(workdir))
        _kill_at(_launch(workdir, tfds_dir, overrides), moment, what, state)
        lost = logged() - newest()
        left = kill_trials.tmp_dirs(workdir)
        print(f"killed in {what}: logged {logged()}, newest complete {newest()}, tmp dirs {left}")
        assert bool(left) == (moment is in_a_save), left  # the kill landed where it was meant
        # async saves: at most one save is in flight, so at most two save intervals (2 x 2
        # steps) of work are redone; everything up to the newest complete save is kept
        assert 0 <= lost <= 4, (logged(), newest())
        segments.append(_train_records(workdir)[lines:])
        resumed.append(newest())
    # the last relaunch, in this process (a kill needs a process; a resume does not)
    lines = len(_train_records(workdir))
    train_and_evaluate(tiny_config(tfds_dir, **overrides), workdir)
    segments.append(_train_records(workdir)[lines:])
    assert kill_trials.tmp_dirs(workdir) == []
    # each launch started after the newest complete checkpoint its predecessor left, and
    # logged exactly the uninterrupted run's losses; the last one finished
    for start, segment in zip(resumed, segments):
        assert [s for s, _ in segment] == list(range(start + 1, start + 1 + len(segment)))
        assert all(loss == reference[s] for s, loss in segment), (segment, reference)
    assert segments[-1][-1][0] == KILL_STEPS


def _train_records(workdir) -> list[tuple[int, float]]:
    """(step, loss) of metrics.jsonl's train records, in the order they were logged."""
    if not (workdir / "metrics.jsonl").exists():
        return []
    records = map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records if r["split"] == "train"]


def _steps(workdir, skip: int) -> list[int]:
    """The steps of the train records after the first `skip`: what a launch logged."""
    return [step for step, _ in _train_records(workdir)[skip:]]


def test_damaged_checkpoints_are_detected_and_skipped(tmp_path, tfds_dir, capsys):
    """Flipped bytes and truncated files are reported naming step and file; training and
    evaluation fall back to the previous good checkpoint."""
    import random
    import shutil

    from tx_jax.inference import restore
    from tx_jax.training.checkpoint import MANIFEST, CorruptCheckpointError

    workdir = tmp_path / "run"
    config = tiny_config(
        tfds_dir, **{"train.num_steps": 6, "checkpoint.every": 2, "checkpoint.async_save": True}
    )
    train_and_evaluate(config, workdir)
    ckpt = Checkpointer(workdir / "checkpoints", read_only=True)
    assert ckpt.all_steps() == [2, 4, 6] and all(ckpt.verify(s) for s in (2, 4, 6))
    step6 = workdir / "checkpoints" / "6"
    files = sorted(p for p in step6.rglob("*") if p.is_file() and p.name != MANIFEST)
    # 20 random single-byte flips, each on a fresh copy: every one is detected
    rng = random.Random(0)
    detected = 0
    for i in range(20):
        copy = tmp_path / "copies" / str(i) / "checkpoints"
        shutil.copytree(workdir / "checkpoints", copy)
        victim = copy / "6" / rng.choice(files).relative_to(step6)
        data = bytearray(victim.read_bytes())
        data[rng.randrange(len(data))] ^= 0xFF
        victim.write_bytes(bytes(data))
        with pytest.raises(CorruptCheckpointError, match=f"step 6 is damaged: {victim}"):
            Checkpointer(copy, read_only=True).verify(6)
        detected += 1
    print(f"corruptions detected: {detected}/20")
    # damage the real step 6 (biggest state file flipped) and truncate a file of step 4
    biggest = max((p for p in files if "state" in str(p)), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0x01
    biggest.write_bytes(bytes(data))
    with pytest.raises(restore.CheckpointError, match="step 6 is damaged.*checksum mismatch"):
        restore.load(workdir, step=6)
    loaded = restore.load(workdir)  # evaluation: the latest *good* checkpoint
    assert loaded.step == 4
    assert "step 6 is damaged" in capsys.readouterr().err
    # training resumes from step 4 and finishes
    config.train.num_steps = 8
    train_and_evaluate(config, workdir)
    assert "step 6 is damaged" in capsys.readouterr().out
    assert max(train_losses(workdir)) == 8
    assert (tmp_path / "run" / "checkpoints.damaged" / "6-0").is_dir()  # kept, not deleted
    truncated = sorted((workdir / "checkpoints" / "8").rglob("*"), key=lambda p: p.stat().st_size)
    victim = [p for p in truncated if p.is_file() and p.name != MANIFEST][-1]
    victim.write_bytes(victim.read_bytes()[:-7])
    with pytest.raises(CorruptCheckpointError, match="step 8 is damaged.*checksum mismatch"):
        Checkpointer(workdir / "checkpoints", read_only=True).verify(8)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MB tmpfs: a real full disk (needs root; skipped where mounting is not allowed)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_full_disk_is_a_clear_error_and_keeps_complete_checkpoints(tiny_disk, tfds_dir):
    workdir = tiny_disk / "run"
    config = tiny_config(
        tfds_dir,
        **{
            "train.num_steps": 500,
            "checkpoint.every": 1,
            "checkpoint.keep": 1000,
            "checkpoint.async_save": True,
        },
    )
    with pytest.raises(OSError, match=r"No space left on device") as info:
        train_and_evaluate(config, workdir)
    message = str(info.value)
    assert str(workdir) in message and ("checkpoint step" in message or "logs" in message)
    print(f"full disk: {message[:300]}")
    # what was saved completely before the disk filled is intact and verifies
    ckpt = Checkpointer(workdir / "checkpoints", read_only=True)
    steps = ckpt.all_steps()
    assert steps, "no complete checkpoint survived"
    verified = [s for s in steps if (workdir / "checkpoints" / str(s) / "checksums.json").exists()]
    assert verified and all(ckpt.verify(s) for s in verified)


def test_dirty_corpus_trains_with_counts_per_category(tmp_path, caplog):
    """Empty / whitespace-only lines, a 1 MB line, a too-long line and unseen characters in a
    Multi30k-format corpus: skipped or truncated and counted, never a crash (invalid UTF-8 is
    an error naming the line: tests/test_data_multi30k.py)."""
    import gzip
    import json
    import logging as std_logging

    from tx_jax.data import synthetic

    pairs = synthetic.generate_corpus(300, seed=3)
    en = [s.encode() for s, _ in pairs]
    de = [t.encode() for _, t in pairs]
    dirty = {
        5: (b"", b"ein hund ."),  # empty side
        7: (b"  \t ", b"gumesi ke ."),  # whitespace-only side
        11: (b"word " * 200_000, de[11]),  # a 1 MB line
        13: (b" ".join([b"the big dog"] * 30), de[13]),  # too long for max_len, not huge
        15: ("the dog \u72d7 \U0001f415 sees .".encode(), de[15]),  # never-seen characters
    }
    for i, (a, b) in dirty.items():
        en[i], de[i] = a, b
    manual = tmp_path / "raw"
    manual.mkdir()
    for split, n in (("train", 300), ("val", 20), ("test_2016_flickr", 20)):
        for lang, lines in (("en", en), ("de", de)):
            chosen = lines if split == "train" else [s.encode() for s, _ in pairs[:n]]
            if split != "train" and lang == "de":
                chosen = [t.encode() for _, t in pairs[:n]]
            with gzip.open(manual / f"{split}.{lang}.gz", "wb") as f:
                f.write(b"\n".join(chosen) + b"\n")
    config = tiny_config(
        tmp_path / "tfds",
        **{
            "data.dataset": "multi30k",
            "data.source_lang": "en",
            "data.target_lang": "de",
            "data.manual_dir": str(manual),
            "train.num_steps": 4,
            "data.test_split": "test_2016_flickr",
        },
    )
    with caplog.at_level(std_logging.WARNING):
        train_and_evaluate(config, tmp_path / "run")
    logs = caplog.text
    assert "skipped 2 of 300 line pairs with an empty side" in logs
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["split"] == "train"][-1]
    assert last["data_dropped_too_long_chars"] >= 1  # the 1 MB line, never tokenized
    assert last["data_dropped_too_long"] >= 1  # the 90-word line
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
