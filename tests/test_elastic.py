"""Elastic resume: a run stopped by SIGTERM continues on another topology with the same batches.

The data stream is kept in global terms (input shards, data/shards.py) and the train
state restores into whatever mesh the new run builds, so a run stopped on 8 devices resumes on
4 or on 1, and one stopped as 2 processes resumes as 1; the losses after the resume are the
uninterrupted run's, and the stream continues where it stopped (its example count goes on).
A checkpoint is the same whichever strategy saved it: a mesh run resumes on 4 devices as pmap
and a pmap run as a mesh run.

The processes are launched once for the module (the fixture `runs`): one with 8 devices trains
the uninterrupted reference and the mesh and pmap runs that stop; a pair of processes trains
the run that stops as 2; one with 4 devices resumes all three. The resumes on 1 device run in
this process.

Tolerance: other device counts sum the gradients in another order, so the losses differ by
float32 rounding (measured: BENCHMARKS.md "Elastic resume"); RTOL bounds that.
"""

import json
import shutil
import subprocess
import sys
import types

import numpy as np
import portpicker
import pytest
import zygote
from helpers import ROOT, process_env, run_python, tiny_config, train_losses

from tx_jax.runner.loop import train_and_evaluate
from tx_jax.training.checkpoint import Checkpointer

# the fixture's processes are shared by this file's tests: one xdist worker runs them all
# (launch.sh's --dist loadfile; this mark does the same under --dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("elastic")]

STEPS, STOP_AT = 6, 3
OVERRIDES = {
    "data.packing": True,
    "data.input_shards": 2,
    "checkpoint.every": 1000,  # only the SIGTERM save and the last one
    "train.num_steps": STEPS,
}
STRATEGIES = ("mesh", "pmap")
OTHER = {"mesh": "pmap", "pmap": "mesh"}  # the strategy a stopped run resumes under on 4
RTOL = 1e-5
TIMEOUT = 300


def _code(tfds_dir, runs: list[tuple[str, object, int | None, dict]]) -> str:
    """Trains tiny_config(OVERRIDES, overrides) in `workdir` for each (label, workdir,
    stop_at, overrides) of `runs` in turn, printing `RESULT label {final metrics}`; with
    `stop_at`, the process sends itself SIGTERM once step `stop_at` is logged (the loop saves
    and stops at the next step boundary: a preemption at a known step)."""
    lines = [
        "import os, signal, time",
        "import jax",
        "from helpers import tiny_config",
        "from tx_jax.runner.loop import train_and_evaluate",
        "from tx_jax.training import logs",
        "stop_at = None",
        "write = logs.MetricLogger.write",
        "def signalling_write(self, step, split, scalars):",
        "    write(self, step, split, scalars)",
        "    if split == 'train' and step == stop_at:",
        "        os.kill(os.getpid(), signal.SIGTERM)",
        # the coordination service needs a moment to agree on the step to stop at; with
        # the steps served from the compilation cache the run could end before it did
        "        time.sleep(1.0 if jax.process_count() > 1 else 0.0)",
        "logs.MetricLogger.write = signalling_write",
    ]
    for label, workdir, stop_at, overrides in runs:
        config = {**OVERRIDES, **overrides}
        lines += [
            f"stop_at = {stop_at!r}",
            f"print('RESULT {label}', train_and_evaluate(tiny_config({str(tfds_dir)!r}, "
            f"**{config!r}), {str(workdir)!r}), flush=True)",
        ]
    return "\n".join(lines)


def _result(out: str, label: str) -> str:
    """The final metrics that `_code` printed for the run `label`."""
    return next((x for x in out.splitlines() if x.startswith(f"RESULT {label} ")), "")


def _train_records(workdir) -> dict[int, dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == "train"}


def _two_processes(tfds_dir, workdir) -> list[str]:
    """2 processes x 4 devices train in `workdir` and get SIGTERM after step STOP_AT - 1;
    their outputs, once both exited 0."""
    port = portpicker.pick_unused_port()
    procs = []
    try:
        for i in range(2):
            env = process_env(i, 2, port, 4)
            code = _code(tfds_dir, [("two", workdir, STOP_AT - 1, {})])
            procs.append(
                zygote.Popen(
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
    return outs


@pytest.fixture(scope="module")
def runs(tfds_dir, tmp_path_factory):
    """Every launch of the module, in order. 8 devices: the uninterrupted reference (mesh) and
    the mesh and pmap runs stopped at STOP_AT (in `<strategy>8`); 2 processes x 4 devices:
    the run that stops (`two`); 4 devices: copies of the three, resumed (`<strategy>_on4`
    under the other strategy, `two_resumed`). The stopped workdirs are left as the stop left
    them."""
    base = tmp_path_factory.mktemp("elastic")
    eight = [("reference", base / "reference", None, {})]
    eight += [(s, base / f"{s}8", STOP_AT, {"parallel.strategy": s}) for s in STRATEGIES]
    out8 = run_python(_code(tfds_dir, eight), devices=8, timeout=TIMEOUT)
    outs2 = _two_processes(tfds_dir, base / "two")
    on4 = [(s, base / f"{s}_on4", None, {"parallel.strategy": OTHER[s]}) for s in STRATEGIES]
    on4.append(("two", base / "two_resumed", None, {}))
    for (_, workdir, _, _), stopped in zip(
        on4, [*(base / f"{s}8" for s in STRATEGIES), base / "two"]
    ):
        shutil.copytree(stopped, workdir)
    run_python(_code(tfds_dir, on4), devices=4, timeout=TIMEOUT)
    return types.SimpleNamespace(
        base=base, reference=_train_records(base / "reference"), out8=out8, outs2=outs2
    )


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


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sigterm_on_8_devices_resumes_on_4_and_on_1(tmp_path, tfds_dir, runs, strategy):
    """The state restores into the new run's mesh (sharded) or replicas (pmap), on 4 devices
    under the other strategy and on 1 under its own; the reference is the mesh run (pmap
    computes the same sums in another order: within RTOL)."""
    stopped, reference = runs.base / f"{strategy}8", runs.reference
    assert f"'stopped_at': {float(STOP_AT)}" in _result(runs.out8, strategy), runs.out8
    assert Checkpointer(stopped / "checkpoints", read_only=True).all_steps() == [STOP_AT]
    before = _train_records(stopped)
    assert sorted(before) == list(range(1, STOP_AT + 1))
    np.testing.assert_allclose(
        [before[s]["loss"] for s in range(1, STOP_AT + 1)],
        [reference[s]["loss"] for s in range(1, STOP_AT + 1)],
        rtol=RTOL,
    )
    label = f"{strategy} on 8 -> {OTHER[strategy]} on 4"
    _check_resumed(runs.base / f"{strategy}_on4", reference, STOP_AT, label)
    # on 1 device: this process's
    workdir = tmp_path / "on1"
    shutil.copytree(stopped, workdir)
    config = tiny_config(tfds_dir, **{**OVERRIDES, "parallel.strategy": strategy})
    train_and_evaluate(config, workdir)
    _check_resumed(workdir, reference, STOP_AT, f"{strategy}: 8 -> 1 devices")


def test_sigterm_on_2_processes_resumes_as_1(runs):
    """2 processes x 4 devices (one input shard each) get SIGTERM; JAX's preemption service
    makes them agree on the step to save at. The run resumes as 1 process with 4 devices,
    which reads both shards."""
    workdir, reference, outs = runs.base / "two", runs.reference, runs.outs2
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
    stop = f"'stopped_at': {float(stopped_at)}"
    assert all(stop in _result(o, "two") for o in outs), outs[0][-3000:]
    _check_resumed(
        runs.base / "two_resumed", reference, stopped_at, "2 processes x 4 -> 1 process x 4"
    )
