"""A real multi-process run: 2 processes x 4 CPU devices on 127.0.0.1 (jax.distributed, gloo).

One pair of processes is launched twice (the module fixture `launches`), and each launch
trains two runs one after the other, one per parallel strategy:
- pmap (the option on jax.pmap): 2 steps and a checkpoint in the first launch, resumed to 4
  in the second; its host-local replicas are saved as one global array, every process
  restores its own copy, and the losses are those of 1 process with 1 device.
- mesh (the default), with data.input_shards=2 (each process reads only its shard):
  SIGKILLed after a checkpoint in the first launch, resumed in the second; the train and
  validation losses are those of 1 process with 8 devices, the same mesh and the same input
  shards, and the checkpoint then restores and evaluates in this (1-device) process.
- LoRA on mesh's last checkpoint (second launch): the digest of the frozen base, taken from
  parameters spread over both processes, is the one this process computes, so the adapted
  run restores here.
"""

import json
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import portpicker
import pytest
import zygote
from flax import traverse_util
from helpers import ROOT, process_env, run_python, tiny_config, train_losses

from tx_jax.runner.evaluator import Evaluator
from tx_jax.runner.loop import train_and_evaluate
from tx_jax.runner.setup import build_run, size_from_data
from tx_jax.training.checkpoint import Checkpointer

# the fixture's launches are shared by this file's tests: one xdist worker runs them all
# (launch.sh's --dist loadfile; this mark does the same under --dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multiprocess")]

NUM_PROCESSES, LOCAL_DEVICES = 2, 4
OVERRIDES = {  # the mesh run (the default strategy)
    "data.packing": True,
    "checkpoint.every": 2,
    "eval.every": 4,
    "eval.bleu_examples": 8,  # greedy decoding with parameters spread over 2 processes
    "model.dropout_rate": 0.1,  # one dropout key for the global batch: must match too
    "data.input_shards": 2,  # one shard per process
}
PMAP = {"parallel.strategy": "pmap", "data.packing": True, "checkpoint.every": 2}
# LoRA on the mesh run's last checkpoint, in the second launch: the frozen base's digest
# gathers parameters that span both processes
LORA = {**OVERRIDES, "train.num_steps": 3, "checkpoint.every": 3, "eval.bleu_examples": 0}
LORA.update({"train.lora.rank": 4, "train.lora.alpha": 8.0})
PMAP_STEPS = (2, 4)  # the pmap run's num_steps in the first and in the second launch
TIMEOUT = 300  # seconds for any one launch; a hung collective fails the test, not CI


def _code(tfds_dir, runs: list[tuple[str, object, dict]]) -> str:
    """Trains each (label, workdir, overrides) of `runs` in turn; after each prints
    LOCAL_INPUT label {json}: this process's input shards and the examples they read
    (`ShardedTrainIterator.local_stats`)."""
    lines = [
        "import json; from helpers import tiny_config",
        "from tx_jax.runner.loop import train_and_evaluate",
        "from tx_jax.data import shards as m; made = []; init = m.ShardedTrainIterator"
        ".__init__; m.ShardedTrainIterator.__init__ = lambda self, *a, **k: (init(self, *a, **k),"
        " made.append(self))[0]",
    ]
    for label, workdir, overrides in runs:
        lines += [
            f"train_and_evaluate(tiny_config({str(tfds_dir)!r}, **{overrides!r}), "
            f"{str(workdir)!r})",
            f"print('LOCAL_INPUT {label}', json.dumps(made[-1].local_stats()), flush=True)",
        ]
    return "\n".join(lines)


def _local_input(logs, name: str, label: str) -> list[dict]:
    """Each process's LOCAL_INPUT record of the run `label` in the launch `name`."""
    out, head = [], f"LOCAL_INPUT {label} "
    for i in range(NUM_PROCESSES):
        lines = (logs / f"{name}_process{i}.log").read_text().splitlines()
        out.append(json.loads(next(x for x in lines if x.startswith(head))[len(head) :]))
    return out


def _launch(tfds_dir, runs, logs, name: str) -> list[subprocess.Popen]:
    """Start the processes that train `runs` (see `_code`), on a fresh port each time."""
    port = portpicker.pick_unused_port()
    procs: list[subprocess.Popen] = []
    try:
        for i in range(NUM_PROCESSES):
            env = process_env(i, NUM_PROCESSES, port, LOCAL_DEVICES)
            with open(logs / f"{name}_process{i}.log", "w") as log:  # the child keeps a copy
                procs.append(
                    zygote.Popen(
                        [sys.executable, "-c", _code(tfds_dir, runs)],
                        cwd=ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
    except BaseException:
        _kill(procs)
        raise
    return procs


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def _outputs(logs) -> str:
    return "\n".join(f"===== {p.name}\n{p.read_text()[-5000:]}" for p in sorted(logs.iterdir()))


def _wait(procs, logs, timeout=TIMEOUT) -> None:
    """All exit 0 within `timeout`, else AssertionError with every process's output."""
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit after {timeout} s\n{_outputs(logs)}") from None
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), f"exit codes {codes}\n{_outputs(logs)}"


def _wait_past_checkpoint(workdir, step: int, procs, logs, timeout=TIMEOUT) -> None:
    """Until a complete checkpoint >= `step` exists (Orbax renames it into place when done)
    and a later step is logged: a kill then loses steps that the resumed run must redo."""
    deadline = time.time() + timeout
    ckpt_dir = workdir / "checkpoints"
    while time.time() < deadline:
        done = (
            [int(d.name) for d in ckpt_dir.iterdir() if d.name.isdigit()]
            if ckpt_dir.exists()
            else []
        )
        if done and max(done) >= step and _last_logged_step(workdir) > max(done):
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a process exited early\n{_outputs(logs)}")
        time.sleep(0.05)
    raise AssertionError(f"no step past checkpoint {step} in {timeout} s\n{_outputs(logs)}")


def _last_logged_step(workdir) -> int:
    """The last complete line of metrics.jsonl (process 0 may be writing the next one)."""
    lines = (workdir / "metrics.jsonl").read_text().split("\n")[:-1]
    return json.loads(lines[-1])["step"] if lines else 0


def _records(workdir) -> list[dict]:
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


def _validation(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in _records(workdir) if r["split"] == "validation"}


@pytest.fixture(scope="module")
def launches(tmp_path_factory, tfds_dir):
    """The two launches of the pair. 1: pmap trains PMAP_STEPS[0] steps, then mesh trains
    (far more steps than we let it run) and both processes are SIGKILLed after mesh's
    checkpoint 4. 2: pmap resumes to PMAP_STEPS[1], mesh resumes to a target beyond
    anything done, then LoRA adapts mesh's last checkpoint; both exit 0."""
    base = tmp_path_factory.mktemp("two_processes")
    mesh, pmap, lora, logs = base / "mesh", base / "pmap", base / "lora", base / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []
    try:
        first = [
            ("pmap", pmap, {**PMAP, "train.num_steps": PMAP_STEPS[0]}),
            ("mesh", mesh, {**OVERRIDES, "train.num_steps": 1000}),
        ]
        procs = _launch(tfds_dir, first, logs, "1_killed")
        _wait_past_checkpoint(mesh, 4, procs, logs)
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
        pmap_before = _records(pmap)
        before = _records(mesh)
        ckpt = Checkpointer(mesh / "checkpoints", read_only=True).latest_step()
        killed_at = max(r["step"] for r in before)
        target = max(killed_at, 9) + 3  # BLEU > 0 by step 12
        second = [
            ("pmap", pmap, {**PMAP, "train.num_steps": PMAP_STEPS[1]}),
            ("mesh", mesh, {**OVERRIDES, "train.num_steps": target}),
            ("lora", lora, {**LORA, "train.init_from": str(mesh)}),
        ]
        procs = _launch(tfds_dir, second, logs, "2_resumed")
        _wait(procs, logs)
    finally:
        _kill(procs)
    print(f"mesh: killed at step {killed_at} (latest checkpoint {ckpt}); resumed to {target}")
    return types.SimpleNamespace(
        mesh=mesh,
        pmap=pmap,
        lora=lora,
        logs=logs,
        pmap_before=pmap_before,
        before=before,
        ckpt=ckpt,
        killed_at=killed_at,
        target=target,
    )


def test_two_processes_train_resume_and_match_one_process(tmp_path, tfds_dir, launches):
    workdir, logs, before = launches.mesh, launches.logs, launches.before
    ckpt, killed_at, target = launches.ckpt, launches.killed_at, launches.target
    after = _records(workdir)[len(before) :]
    # metrics.jsonl comes from process 0 alone: each step once per launch, in order
    train_steps = [r["step"] for r in before if r["split"] == "train"]
    assert train_steps == list(range(1, killed_at + 1))
    resumed_steps = [r["step"] for r in after if r["split"] == "train"]
    assert resumed_steps == list(range(ckpt + 1, target + 1)), _outputs(logs)

    # the same steps in 1 process with 8 devices and the same mesh: the same losses
    reference = tmp_path / "reference"
    run_python(
        "from helpers import tiny_config; from tx_jax.runner.loop import train_and_evaluate;"
        f"train_and_evaluate(tiny_config({str(tfds_dir)!r}, "
        f"**{ {**OVERRIDES, 'train.num_steps': target}!r}), {str(reference)!r})",
        devices=NUM_PROCESSES * LOCAL_DEVICES,
        timeout=TIMEOUT,
    )
    got, want = train_losses(workdir), train_losses(reference)
    steps = list(range(1, target + 1))
    print("2 processes:", [round(got[s], 6) for s in steps])
    print("1 process:  ", [round(want[s], 6) for s in steps])
    print("max relative difference:", max(abs(got[s] / want[s] - 1) for s in steps))
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)
    # each process read only its shard: the examples of the two add up to the logged total
    local = _local_input(logs, "2_resumed", "mesh")
    print("per process input:", local)
    assert [x["shards"] for x in local] == [[0], [1]]
    total = [r for r in _records(workdir) if r["split"] == "train"][-1]["data_examples"]
    assert local[0]["examples"] + local[1]["examples"] == total
    assert abs(local[0]["examples"] - local[1]["examples"]) < 0.2 * total
    got_eval, want_eval = _validation(workdir), _validation(reference)
    assert set(got_eval) == set(want_eval) and target in got_eval
    for key in ("loss", "accuracy", "bleu", "chrf"):
        np.testing.assert_allclose(
            [got_eval[s][key] for s in sorted(want_eval)],
            [want_eval[s][key] for s in sorted(want_eval)],
            rtol=1e-5,
            err_msg=key,
        )
    print("validation 2 processes:", got_eval[target])
    print("validation 1 process:  ", want_eval[target])

    # the 2-process checkpoint restores and evaluates here, on 1 device
    config = tiny_config(tfds_dir, **{**OVERRIDES, "train.num_steps": target})
    run = build_run(size_from_data(config, workdir))
    assert jax.process_count() == 1  # this process, with its own device(s)
    checkpointer = Checkpointer(workdir / "checkpoints", read_only=True)
    assert checkpointer.latest_step() == target
    state, data_state, _ = checkpointer.restore(target, run.strategy.abstract_state(run.init_fn))
    assert int(state.step) == target
    assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(state.params))
    # the iterator state holds both shards (gathered from the two processes): any process
    # count can take its share of it
    assert data_state["input_shards"] == 2 and sorted(data_state["shards"]) == ["0", "1"]
    shardings = run.strategy.state_shardings(jax.eval_shape(run.init_fn))
    evaluator = Evaluator(run, shardings)
    metrics = evaluator._loss_metrics(state, run.task.eval_batches("validation", 1))
    np.testing.assert_allclose(metrics["loss"], got_eval[target]["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy"], got_eval[target]["accuracy"], rtol=1e-5)


def test_two_processes_with_pmap_save_resume_and_match_one_device(tmp_path, tfds_dir, launches):
    """pmap across processes: its host-local replicas are saved as one global array, and
    every process restores its own copy."""
    first, last = PMAP_STEPS
    workdir = launches.pmap
    steps = list(range(1, last + 1))
    # the first launch finished its run and saved before it went on to the mesh run
    assert [r["step"] for r in launches.pmap_before if r["split"] == "train"] == steps[:first]
    # the second resumed from that checkpoint: each step logged once
    assert [r["step"] for r in _records(workdir) if r["split"] == "train"] == steps
    assert Checkpointer(workdir / "checkpoints", read_only=True).all_steps() == [first, last]
    train_and_evaluate(
        tiny_config(tfds_dir, **PMAP, **{"train.num_steps": last}), tmp_path / "one_device"
    )
    got, want = train_losses(workdir), train_losses(tmp_path / "one_device")
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)


def test_two_processes_adapt_with_lora_and_record_the_base_one_process_reads(launches):
    from tx_jax.inference import restore
    from tx_jax.model import lora as lora_lib

    steps = LORA["train.num_steps"]
    assert [r["step"] for r in _records(launches.lora) if r["split"] == "train"] == [1, 2, 3]
    meta = Checkpointer(launches.lora / "checkpoints", read_only=True).restore_meta(steps)
    base = restore.load(launches.mesh)
    assert meta["base"]["step"] == launches.target == base.step
    assert meta["base"]["digest"] == restore.params_digest(base.params)
    adapted = restore.load(launches.lora)  # reads the base again and checks that digest
    assert adapted.step == steps
    got, want = (
        {k: np.asarray(v) for k, v in traverse_util.flatten_dict(x.params, sep="/").items()}
        for x in (adapted, base)
    )
    adapters = {k for k in got if lora_lib.ADAPTER.search(k)}
    assert adapters and set(got) - adapters == set(want)
    for key, value in want.items():  # the base, bit for bit
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert any(np.abs(got[k]).max() > 0 for k in adapters if k.endswith("_lora_b"))
