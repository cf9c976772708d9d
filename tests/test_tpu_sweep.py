"""A sweep on TPU VMs (launch/tpu_queue.py, tpu_vms.py), without Google Cloud: a stand-in
`gcloud` on PATH (tests/gcloud_standin/gcloud) whose VMs' workers are local processes, each
with its own home directory (its disk), and tests/gcs_server.py as the bucket. The sweep's
code, tpu.sh and the training runs are the real ones.

VMs: tx-a, a v4-16 spot VM (2 workers: each point runs as 2 processes of jax.distributed), and
tx-b, a v4-8 (1 worker). The sweep: 3 seeds of configs/default.py:debug, 8 steps, a checkpoint
every 2 (three points: each VM runs one, then one of them another).
"""

from __future__ import annotations

import csv
import io
import json
import os
import pathlib
import re
import shutil
import sys

import numpy as np
import pytest
from etils import epath
from helpers import ROOT, forced_devices

from tx_jax.cli import sweep as sweep_cli
from tx_jax.launch import tpu_vms


def cli_sweep(argv: list[str]) -> int:
    """`tx_jax sweep ARGV...` in this process -> its exit status."""
    return sweep_cli.main(["tx_jax sweep", *argv])


pytestmark = [pytest.mark.slow]

BUCKET = "gs://tx-jax-test/sweeps"
STANDIN = ROOT / "tests" / "gcloud_standin"
SWEEP = """
CONFIG = "configs/default.py:debug"
NAME = "seeds"
BASE = {
    "data.packing": True,
    "data.max_train_len": 32,
    "data.max_eval_len": 32,
    "train.log_every": 1,
    "checkpoint.every": 2,
    "checkpoint.async_save": False,
    "eval.every": 1000,
    "eval.bleu_examples": 0,
    "eval.score_test": False,
}
EXTRA = []


def sweep():
    return [{"seed": s} for s in range(3)] + EXTRA
"""
VMS = {
    "tx-a": {"state": "READY", "acceleratorType": "v4-16", "workers": 2, "spot": True},
    "tx-b": {"state": "READY", "acceleratorType": "v4-8", "workers": 1},
}


class Fleet:
    def __init__(self, base: pathlib.Path):
        self.dir = base / "gcloud"
        self.dir.mkdir()
        (self.dir / "vms.json").write_text(json.dumps(VMS))
        for name, vm in VMS.items():
            for i in range(vm["workers"]):
                self.set_up(name, i)
        self.sweep_file = base / "seeds.py"
        self.sweep_file.write_text(SWEEP)

    def set_up(self, name: str, worker: int) -> None:
        """What tpu-setup leaves on a worker: ~/tx_jax with the code and .venv/bin/python."""
        repo = self.dir / "vms" / name / f"w{worker}" / "tx_jax"
        (repo / ".venv" / "bin").mkdir(parents=True)
        for part in ("tx_jax", "configs"):
            (repo / part).symlink_to(ROOT / part)
        python = repo / ".venv" / "bin" / "python"
        python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        python.chmod(0o755)

    def calls(self, command: str | None = None) -> list[list[str]]:
        path = self.dir / "calls.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        calls = [json.loads(line) for line in lines]
        return [c for c in calls if command is None or c[3:4] == [command]]

    def vms(self) -> dict:
        return json.loads((self.dir / "vms.json").read_text())


@pytest.fixture(scope="module")
def fleet(gcs, tmp_path_factory):
    return Fleet(tmp_path_factory.mktemp("fleet"))


def use_standin(mp: pytest.MonkeyPatch, fleet: Fleet) -> None:
    """The repository as working directory, the stand-in gcloud first on PATH, one device."""
    mp.chdir(ROOT)
    mp.setenv("PATH", f"{STANDIN}{os.pathsep}{os.environ['PATH']}")
    mp.setenv("GCLOUD_STANDIN_DIR", str(fleet.dir))
    mp.setenv("XLA_FLAGS", forced_devices(1))


@pytest.fixture
def cloud_env(fleet, monkeypatch):
    use_standin(monkeypatch, fleet)
    return fleet


def sweep(fleet, capsys, root: str, *args: str) -> tuple[int, list[str]]:
    argv = [str(fleet.sweep_file), "--tpu=tx-a,tx-b", "--zone=z", f"--root={root}", *args]
    rc = cli_sweep(argv)
    out = capsys.readouterr()
    print(out.out, out.err)
    return rc, out.out.splitlines() + out.err.splitlines()


def losses(workdir: str) -> dict[int, float]:
    out = {}
    for line in (epath.Path(workdir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == "train":
            out[record["step"]] = record["loss"]  # a rerun step's last record wins
    return out


def results(root: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO((epath.Path(root) / "results.csv").read_text())))


@pytest.fixture(scope="module")
def first(fleet, gcs):
    """2 VMs x 3 points to the end (once for the module)."""
    mp = pytest.MonkeyPatch()
    try:
        use_standin(mp, fleet)
        root = f"{BUCKET}/first"
        rc = cli_sweep(
            [str(fleet.sweep_file), "--tpu=tx-a,tx-b", "--zone=z", f"--root={root}", "--no-plan"]
        )
        return rc, root, list(fleet.calls("ssh"))
    finally:
        mp.undo()


def test_two_vms_run_three_points_to_the_end(first, fleet):
    rc, root, ssh = first
    assert rc == 0
    rows = results(root)
    assert [r["name"] for r in rows] == [f"seed={s}" for s in range(3)]
    assert all(r["status"] == "ok" and r["steps"] == "8" for r in rows), rows
    for r in rows:
        float(r["val_loss"])
    on = {
        r["name"]: json.loads((epath.Path(r["workdir"]) / "sweep_done.json").read_text())["vm"]
        for r in rows
    }
    assert on["seed=0"] == "tx-a" and on["seed=1"] == "tx-b"  # the first two, dealt in order
    assert set(on.values()) == {"tx-a", "tx-b"}
    assert len(ssh) == 3 and all("--worker=all" in c and "--zone=z" in c for c in ssh)
    command = next(c for c in ssh if c[4] == "tx-a")[-1]
    assert command.startswith("--command=cd ~/tx_jax && .venv/bin/python -m tx_jax train ")
    assert f"--workdir={root}/00_seed=0" in command and "--config.seed=0" in command
    assert command.endswith("--config.parallel.distributed=True")
    # every worker of tx-a ran its points: each prepared the data on its own disk
    for worker in ("w0", "w1"):
        assert list((fleet.dir / "vms" / "tx-a" / worker / "tensorflow_datasets").iterdir())
    log = (epath.Path(root) / "00_seed=0" / "sweep.log").read_text()
    assert "step      8/8" in log
    md = (epath.Path(root) / "results.md").read_text()
    assert "| 2 | seed=2 | ok | 8 |" in md
    assert len((epath.Path(root) / "curves.png").read_bytes()) > 1000


def test_a_rerun_has_nothing_left_to_do(first, cloud_env, capsys):
    rc, root, _ = first
    before = len(cloud_env.calls())
    rc, lines = sweep(cloud_env, capsys, root, "--no-plan")
    assert rc == 0
    assert f"nothing left to do: the 3 point(s) are done ({root})" in lines
    assert len(cloud_env.calls()) == before  # not even a describe
    assert [r["status"] for r in results(root)] == ["ok"] * 3


def test_a_preempted_vm_loses_no_point(first, cloud_env, capsys):
    """tx-a is preempted at step 5 of its point (checkpoint at 4): the point goes back to the
    queue and finishes on tx-b, from its checkpoint, with the losses of the uninterrupted run.
    --recreate tries to bring tx-a back, in a zone that has no capacity: the sweep goes on.
    (One point: tx-b is free when it is requeued.)"""
    _, first_root, _ = first
    (cloud_env.dir / "preempt.json").write_text(json.dumps({"vm": "tx-a", "on": r"^step +5/"}))
    vms = {**VMS, "_create_error": "There is no more capacity in the zone"}
    (cloud_env.dir / "vms.json").write_text(json.dumps(vms))
    root = f"{BUCKET}/preempted"
    rc, lines = sweep(cloud_env, capsys, root, "--no-plan", "--only=0", "--recreate")
    assert rc == 0, lines
    events = [line for line in lines if line.startswith(("[", "tx-"))]
    assert events[0] == "[0] seed=0: started on tx-a"
    assert not any(e.startswith("[1]") for e in events), events  # --only=0
    assert (
        "[0] seed=0: requeued: tx-a is PREEMPTED; the point resumes from its last "
        "checkpoint on the next free VM" in events
    )
    assert "tx-a: recreating (spot)" in events
    assert any(e.startswith("tx-a: not recreated (tpu-create: ERROR:") for e in events), events
    assert "[0] seed=0: started on tx-b" in events
    assert any(e.startswith("[0] seed=0: finished on tx-b") for e in events)
    assert "PREEMPTED" not in cloud_env.vms().get("tx-a", {}).get("state", "")  # deleted
    assert [c[3:5] for c in cloud_env.calls() if c[3] in ("delete", "create")] == [
        ["delete", "tx-a"],
        ["create", "tx-a"],
    ]
    create = cloud_env.calls("create")[-1]
    assert "--accelerator-type=v4-16" in create and "--spot" in create

    got, want = losses(f"{root}/00_seed=0"), losses(f"{first_root}/00_seed=0")
    assert sorted(got) == list(range(1, 9))
    np.testing.assert_allclose(
        [got[s] for s in range(1, 9)], [want[s] for s in range(1, 9)], rtol=1e-5
    )
    log = (epath.Path(root) / "00_seed=0" / "sweep.log").read_text()
    assert "closed by remote host" in log and "step      5/8" in log


def test_dry_run_needs_no_gcloud_and_deals_points_round_robin(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"  # bash and dirname, which tpu.sh needs, and no gcloud
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.chdir(ROOT)
    assert shutil.which("gcloud") is None
    root = "gs://BUCKET/sweeps/table3"
    argv = ["experiments/table3.py", "--tpu=tx-a,tx-b", "--zone=us-central2-b", f"--root={root}"]
    assert cli_sweep([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("19 point(s) over 2 TPU VM(s), round-robin")
    starts = [line for line in lines if line.startswith("    + gcloud ")]
    assert len(starts) == 19
    for i, line in enumerate(starts):
        assert line.startswith(
            f"    + gcloud compute tpus tpu-vm ssh {'tx-b' if i % 2 else 'tx-a'}"
            " --zone=us-central2-b --worker=all '--command=cd ~/tx_jax && "
        )
        assert f"--workdir={root}/{i:02d}_" in line
    assert "--config.model.num_heads=1 --config.parallel.distributed=True'" in starts[1]
    # the docs show this very output
    docs = (ROOT / "docs" / "tpu_and_cloud.md").read_text()
    assert out.strip() in docs
    # without --dry-run: no gcloud is a one-line error
    assert cli_sweep(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gcloud is not on PATH" in err[0], err


@pytest.mark.parametrize(
    "change, args, message",
    [
        (
            {},
            ["--tpu=tx-a,tx-zz"],
            "TPU VM tx-zz does not exist (gcloud compute tpus tpu-vm describe tx-zz --zone=z)",
        ),
        (
            {"tx-c": {**VMS["tx-b"], "state": "CREATING"}},
            ["--tpu=tx-c"],
            "TPU VM tx-c is CREATING, not READY",
        ),
        ({}, ["--tpu=tx-b", "--root=runs/sweeps/seeds"], "a TPU sweep's root is a gs:// path"),
        (
            {"tx-d": {**VMS["tx-b"], "acceleratorType": "v3-8"}},
            ["--tpu=tx-d"],
            "TPU VM tx-d: tx_jax plan cannot plan for v3-8 (v4, v5e, v5p, v6e slices); "
            "pass --no-plan",
        ),
    ],
)
def test_a_users_mistake_is_one_line(cloud_env, capsys, change, args, message):
    (cloud_env.dir / "vms.json").write_text(json.dumps({**VMS, **change}))
    argv = [str(cloud_env.sweep_file), "--zone=z", f"--root={BUCKET}/mistakes", *args]
    assert cli_sweep(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_point_that_does_not_fit_is_listed_and_the_rest_run(
    first, cloud_env, capsys, tmp_path, monkeypatch
):
    """Planned for tx-b's v4-8 first: a batch no v4 chip holds is not run (the plan says so in
    its workdir); the new seed runs; the finished three are skipped."""
    pytest.importorskip("libtpu", reason="the TPU compiler (pip install -e '.[plan]')")
    monkeypatch.setenv("TX_JAX_PLAN_CACHE", str(tmp_path / "plans"))
    _, root, _ = first
    text = cloud_env.sweep_file.read_text().replace(
        "EXTRA = []", "EXTRA = [{'seed': 3}, {'data.tokens_per_batch': 268435456}]"
    )
    cloud_env.sweep_file.write_text(text)
    try:
        argv = [str(cloud_env.sweep_file), "--tpu=tx-b", "--zone=z", f"--root={root}"]
        rc = cli_sweep(argv)
    finally:
        cloud_env.sweep_file.write_text(SWEEP)
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert rc == 1 and "1 point(s) failed or not run" in out.err
    assert lines[0] == "2 point(s) to run (3 done) on tx-b (v4-8, 1 worker(s))"
    assert any(re.match(r"\[3\] seed=3: finished on tx-b", line) for line in lines), lines
    big = "[4] data.tokens_per_batch=268435456: not run: its plan does not fit"
    assert any(line.startswith(big) for line in lines), lines
    plan = epath.Path(root) / "04_data.tokens_per_batch=268435456" / "plan_v4-8.txt"
    assert "DOES NOT FIT" in plan.read_text()
    assert [r["status"] for r in results(root)] == ["ok"] * 4 + ["does not fit v4-8"]


def test_plan_targets():
    assert tpu_vms.plan_target("v5litepod-16") == "tpu:v5e-16"
    assert tpu_vms.plan_target("v4-16") == "tpu:v4-16"
    assert tpu_vms.plan_target("v2-8") is None
