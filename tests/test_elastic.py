"""Elastic resume: a run stopped by SIGTERM continues on another topology with the same batches.

The data stream is kept in global terms (input shards, data/input_shards.py) and the train
state restores into whatever mesh the new run builds, so a run stopped on 8 devices resumes on
4 or on 1, and one stopped as 2 processes resumes as 1; the losses after the resume are the
uninterrupted run's, and the stream continues where it stopped (its example count goes on).

Tolerance: other device counts sum the gradients in another order, so the losses differ by
float32 rounding (measured: BENCHMARKS.md "Elastic resume"); RTOL bounds that.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import portpicker
import pytest
from helpers import ROOT, forced_devices, run_python, train_losses

from tx_jax.training.checkpoint import Checkpointer

STEPS, STOP_AT = 6, 3
OVERRIDES = {
    "parallel.strategy": "mesh",
    "data.packing": True,
    "data.input_shards": 2,
    "checkpoint.every": 1000,  # only the SIGTERM save and the last one
    "train.num_steps": STEPS,
}
RTOL = 1e-5
TIMEOUT = 300


def _code(tfds_dir, workdir, stop_at: int | None = None, **overrides) -> str:
    """Trains tiny_config(OVERRIDES, overrides) in `workdir`; with `stop_at`, the process
    sends itself SIGTERM once step `stop_at` is logged (the loop saves and stops at the next
    step boundary: a preemption at a known step)."""
    config = {**OVERRIDES, **overrides}
    lines = [
        "import os, signal, time",
        "from helpers import tiny_config",
        "from tx_jax.experiment.loop import train_and_evaluate",
        "from tx_jax.training import logs",
    ]
    if stop_at is not None:
        lines += [
            "write = logs.MetricLogger.write",
            "def signalling_write(self, step, split, scalars):",
            "    write(self, step, split, scalars)",
            f"    if split == 'train' and step == {stop_at}:",
            "        os.kill(os.getpid(), signal.SIGTERM)",
            # the coordination service needs a moment to agree on the step to stop at; with
            # the steps served from the compilation cache the run could end before it did
            "        time.sleep(1.0)",
            "logs.MetricLogger.write = signalling_write",
        ]
    lines.append(
        f"print(train_and_evaluate(tiny_config({str(tfds_dir)!r}, **{config!r}), {str(workdir)!r}))"
    )
    return "\n".join(lines)


def _train_records(workdir) -> dict[int, dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == "train"}


@pytest.fixture(scope="module")
def reference(tfds_dir, tmp_path_factory):
    """The uninterrupted run: 1 process, 8 devices."""
    workdir = tmp_path_factory.mktemp("elastic") / "reference"
    run_python(_code(tfds_dir, workdir), devices=8, timeout=TIMEOUT)
    return _train_records(workdir)


def _check_resumed(workdir, reference: dict, stopped_at: int, label: str) -> float:
    """Steps after `stopped_at` match the reference; the stream continued. Returns the
    largest relative loss difference."""
    got = _train_records(workdir)
    assert sorted(got) == list(range(1, STEPS + 1)), label
    steps = range(stopped_at + 1, STEPS + 1)
    want_loss = [reference[s]["loss"] for s in steps]
    got_loss = [got[s]["loss"] for s in steps]
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL, err_msg=label)
    # no restart: the examples read go on from the checkpoint, exactly as without the stop
    for s in steps:
        assert got[s]["data_examples"] == reference[s]["data_examples"], (label, s)
    assert got[stopped_at + 1]["data_examples"] > got[stopped_at]["data_examples"]
    diff = max(abs(g / w - 1) for g, w in zip(got_loss, want_loss))
    print(f"{label}: steps {list(steps)} max relative loss difference {diff:.2e}")
    return diff


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["mesh", "pmap"])
def test_sigterm_on_8_devices_resumes_on_4_and_on_1(tmp_path, tfds_dir, reference, strategy):
    """The state restores into the new run's mesh (sharded) or replicas (pmap); the reference
    is the mesh run (pmap computes the same sums in another order: within RTOL)."""
    stopped = tmp_path / "stopped"
    code = _code(tfds_dir, stopped, stop_at=STOP_AT, **{"parallel.strategy": strategy})
    out = run_python(code, devices=8, timeout=TIMEOUT)
    assert f"'stopped_at': {float(STOP_AT)}" in out, out
    assert Checkpointer(stopped / "checkpoints", read_only=True).all_steps() == [STOP_AT]
    before = _train_records(stopped)
    np.testing.assert_allclose(
        [before[s]["loss"] for s in range(1, STOP_AT + 1)],
        [reference[s]["loss"] for s in range(1, STOP_AT + 1)],
        rtol=RTOL,
    )
    for devices in (4, 1):
        workdir = tmp_path / f"on{devices}"
        shutil.copytree(stopped, workdir)
        code = _code(tfds_dir, workdir, **{"parallel.strategy": strategy})
        run_python(code, devices=devices, timeout=TIMEOUT)
        _check_resumed(workdir, reference, STOP_AT, f"{strategy}: 8 -> {devices} devices")


@pytest.mark.slow
def test_sigterm_on_2_processes_resumes_as_1(tmp_path, tfds_dir, reference):
    """2 processes x 4 devices (one input shard each) get SIGTERM; JAX's preemption service
    makes them agree on the step to save at. The run resumes as 1 process with 4 devices,
    which reads both shards."""
    workdir = tmp_path / "run"
    port = portpicker.pick_unused_port()
    procs = []
    try:
        for i in range(2):
            env = dict(
                os.environ,
                XLA_FLAGS=forced_devices(4),
                JAX_PLATFORMS="cpu",
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(i),
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
            )
            code = _code(tfds_dir, workdir, stop_at=STOP_AT - 1)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(o[-4000:] for o in outs)
    steps = Checkpointer(workdir / "checkpoints", read_only=True).all_steps()
    assert len(steps) == 1 and steps[0] < STEPS, (steps, outs[0][-3000:])
    stopped_at = steps[0]
    before = train_losses(workdir)
    assert max(before) == stopped_at
    np.testing.assert_allclose(
        [before[s] for s in range(1, stopped_at + 1)],
        [reference[s]["loss"] for s in range(1, stopped_at + 1)],
        rtol=RTOL,
    )
    assert all(f"'stopped_at': {float(stopped_at)}" in o for o in outs), outs[0][-3000:]
    run_python(_code(tfds_dir, workdir), devices=4, timeout=TIMEOUT)
    _check_resumed(workdir, reference, stopped_at, "2 processes x 4 -> 1 process x 4 devices")
