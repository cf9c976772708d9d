"""launch.sh tpu-*: --dry-run prints the gcloud commands (quoted so that each argument stays
one word) and runs nothing; gcloud is not needed (PATH holds no gcloud here)."""

import glob
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT

TRICKY = "--workdir=gs://b/run 1"


def dry_run(*args: str) -> list[str]:
    """The printed commands of `./launch.sh ARGS --dry-run`, each split into its words."""
    proc = subprocess.run(
        ["./launch.sh", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},  # no gcloud on this PATH
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines and all(line.startswith("+ ") for line in lines), proc.stdout
    return lines


def test_create_plain_spot_and_queued():
    (line,) = dry_run(
        "tpu-create",
        "tx1",
        "--dry-run",
        "--zone",
        "us-central2-b",
        "--project",
        "my proj",
        "--spot",
    )
    assert line == (
        "+ gcloud compute tpus tpu-vm create tx1 --zone=us-central2-b '--project=my proj' "
        "--accelerator-type=v4-8 --version=tpu-ubuntu2204-base --spot"
    )
    (line,) = dry_run(
        "tpu-create",
        "tx1",
        "--queued",
        "--accelerator-type=v5litepod-8",
        "--version",
        "v2-alpha-tpuv5-lite",
        "--dry-run",
    )
    assert line == (
        "+ gcloud alpha compute tpus queued-resources create tx1 --node-id=tx1 "
        "--accelerator-type=v5litepod-8 --runtime-version=v2-alpha-tpuv5-lite"
    )
    # without --version: the generation's runtime
    runtimes = {
        "v4-32": "tpu-ubuntu2204-base",
        "v5litepod-16": "v2-alpha-tpuv5-lite",
        "v5p-8": "v2-alpha-tpuv5",
        "v6e-8": "v2-alpha-tpuv6e",
    }
    for accel, runtime in runtimes.items():
        (line,) = dry_run("tpu-create", "tx1", f"--accelerator-type={accel}", "--dry-run")
        assert line.endswith(f"--accelerator-type={accel} --version={runtime}"), line


def test_setup_waits_copies_to_all_workers_and_runs_the_worker_script():
    describe, tar, scp, ssh = dry_run("tpu-setup", "tx1", "--zone=z", "--dry-run")
    assert describe == (
        "+ gcloud alpha compute tpus queued-resources describe tx1 --zone=z "
        "'--format=value(state.state)'"
    )
    assert tar.startswith("+ tar czf ") and "--exclude=.venv" in tar
    assert "gcloud compute tpus tpu-vm scp" in scp and "--worker=all" in scp
    words = shlex.split(ssh[2:])
    assert words[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tx1"]
    assert "--worker=all" in words
    remote = next(w for w in words if w.startswith("--command=")).removeprefix("--command=")
    assert remote.endswith("cd ~/tx_jax && bash scripts/tpu_worker_setup.sh")
    *_, ssh = dry_run("tpu-setup", "tx1", "--extras", "export", "--dry-run")
    assert ssh.endswith("bash scripts/tpu_worker_setup.sh export'")


def test_run_quotes_user_arguments_as_one_word():
    big = "--config=configs/wmt14_ende.py:variant=big"
    (line,) = dry_run(
        "tpu-run", "tx1", "--dry-run", "--no-plan", "--", big, TRICKY, "--config.train.num_steps=10"
    )
    assert line.startswith("+ gcloud compute tpus tpu-vm ssh tx1 --worker=all '--command=")
    assert r"'\''--workdir=gs://b/run 1'\''" in line  # exact, quoted inside the --command
    words = shlex.split(line[2:])  # what the local shell passes to gcloud
    remote = shlex.split(words[-1].removeprefix("--command="))  # what each worker's shell runs
    start = remote.index("train")
    assert remote[start + 1 : start + 5] == [
        big,
        TRICKY,
        "--config.train.num_steps=10",
        "--config.parallel.distributed=True",
    ]
    assert remote[remote.index("nohup") :][:3] == ["nohup", ".venv/bin/python", "-m"]
    assert remote[-6:] == [">", "runs/tpu-run.log", "2>&1", "<", "/dev/null", "&"]


def test_quotes_dollar_and_single_quote():
    (line,) = dry_run("tpu-run", "tx1", "--dry-run", "--no-plan", "--", "--x=it's $HOME")
    remote = shlex.split(shlex.split(line[2:])[-1].removeprefix("--command="))
    assert "--x=it's $HOME" in remote


def test_logs_and_delete():
    (line,) = dry_run("tpu-logs", "tx1", "--worker=3", "--dry-run")
    assert (
        line == "+ gcloud compute tpus tpu-vm ssh tx1 --worker=3 '--command=tail -n 100 -f "
        "~/tx_jax/runs/tpu-run.log'"
    )
    (line,) = dry_run("tpu-delete", "tx1", "--zone", "z", "--dry-run")
    assert line == "+ gcloud compute tpus tpu-vm delete tx1 --zone=z --quiet"


def test_bad_usage_fails_without_gcloud():
    proc = subprocess.run(
        ["./launch.sh", "tpu-run", "tx1", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "expected -- ARGS" in proc.stderr


def test_run_plans_the_slice_first():
    big = "--config=configs/wmt14_ende.py:variant=big"
    args = ("--", big, TRICKY, "--config.train.num_steps=10")
    plan, ssh = dry_run("tpu-run", "tx1", "--dry-run", "--accelerator-type=v5litepod-16", *args)
    assert plan == (
        "+ .venv/bin/python -m tx_jax plan --target=tpu:v5e-16 --programs=train,eval "
        f"{big} --config.train.num_steps=10"
    )  # the config flags only, in order; the workdir is not the plan's
    assert ssh.startswith("+ gcloud compute tpus tpu-vm ssh tx1 --worker=all")
    # no type given: gcloud is asked what the TPU is (the dry run plans tpu-create's v4-8)
    describe, plan, _ = dry_run("tpu-run", "tx1", "--zone=z", "--dry-run", *args)
    assert describe == (
        "+ gcloud compute tpus tpu-vm describe tx1 --zone=z '--format=value(acceleratorType)'"
    )
    assert "--target=tpu:v4-8" in plan


def test_run_refuses_a_run_that_does_not_fit():
    """The plan really runs (the TPU compiler, this host's CPU): a batch no v5e chip holds is
    refused before anything reaches gcloud (which is not installed here)."""
    pytest.importorskip("libtpu", reason="the TPU compiler (pip install -e '.[plan]')")
    proc = subprocess.run(
        [
            "./launch.sh",
            "tpu-run",
            "tx1",
            "--accelerator-type=v5litepod-4",
            "--",
            "--config=configs/default.py:debug",
            "--config.data.tokens_per_batch=268435456",
            "--workdir=gs://b/run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TX_JAX_PYTHON": sys.executable},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "DOES NOT FIT" in proc.stdout
    assert "tpu-run: not started" in proc.stderr and "gcloud" not in proc.stderr


def test_run_without_the_plan_extra_says_what_to_install():
    """A Python without libtpu (this interpreter's base, no packages): one line, before gcloud."""
    base = getattr(sys, "_base_executable", sys.executable)
    proc = subprocess.run(
        ["./launch.sh", "tpu-run", "tx1", "--accelerator-type=v4-8", "--", "--config=c.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "TX_JAX_PYTHON": base},
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f"tpu.sh: tpu-run: planning here needs tx_jax with the TPU compiler in {base}: "
        "./launch.sh test installs both (or .venv/bin/pip install -e '.[plan]'); or pass "
        "--no-plan\n"
    )


def test_run_wait_runs_in_the_foreground():
    """--wait (the TPU sweep's way): no nohup, no log file, the workers' exit status."""
    (line,) = dry_run("tpu-run", "tx1", "--dry-run", "--no-plan", "--wait", "--", TRICKY)
    remote = shlex.split(shlex.split(line[2:])[-1].removeprefix("--command="))
    assert remote[:3] == ["cd", "~/tx_jax", "&&"]
    assert remote[3:] == [
        ".venv/bin/python",
        "-m",
        "tx_jax",
        "train",
        TRICKY,
        "--config.parallel.distributed=True",
    ]


# ------------------------------------------------------------- tpu-setup on stand-in workers
STANDIN = ROOT / "tests" / "gcloud_standin"


def old_python() -> str | None:
    """A real interpreter older than 3.11 (as a TPU image's python3 3.10 is), if this host has
    one: tx_jax cannot be installed into a venv made from it."""
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")))
    candidates += [f"/usr/bin/python3.{minor}" for minor in range(6, 11)]
    for path in candidates:
        if not os.access(path, os.X_OK):
            continue
        probe = [path, "-c", "import sys; sys.exit(sys.version_info >= (3, 11))"]
        if subprocess.run(probe, capture_output=True).returncode == 0:
            return path
    return None


def test_setup_brings_its_own_python_to_workers_whose_python3_is_too_old(tmp_path):
    """tpu-create --queued, then tpu-setup on a 2-worker VM whose python3 is older than 3.11:
    tpu-setup waits for ACTIVE, then each worker's .venv is a Python 3.11 from uv with tx_jax
    and jax[tpu] in it, and prints its devices. The package index's stand-in: the packages this
    test runs with, on PYTHONPATH, and pip without an index (no network in tests)."""
    old = old_python()
    uv = shutil.which("uv", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("uv")
    if old is None or uv is None:
        pytest.skip("needs an interpreter older than 3.11 and uv (the test extra)")
    image, tools, state = tmp_path / "image", tmp_path / "tools", tmp_path / "gcloud"
    for d in (image, tools, state):
        d.mkdir()
    (image / "python3").symlink_to(old)  # the image's python3, first on the workers' PATH
    (tools / "uv").symlink_to(uv)  # as uv's installer leaves it in ~/.local/bin
    # the CPython 3.11 that uv finds (on a real worker it downloads one)
    (tools / "python3.11").symlink_to(getattr(sys, "_base_executable", sys.executable))
    (state / "vms.json").write_text("{}")
    (state / "workers.json").write_text(
        json.dumps(
            {
                "PATH": f"{image}:{tools}:/usr/bin:/bin",
                "PYTHONPATH": ":".join(p for p in sys.path if p.endswith("site-packages")),
                "PIP_NO_INDEX": "1",
                "PIP_NO_BUILD_ISOLATION": "0",
                "UV_PYTHON_DOWNLOADS": "never",
            }
        )
    )
    env = {
        **os.environ,
        "PATH": f"{STANDIN}{os.pathsep}{os.environ['PATH']}",
        "GCLOUD_STANDIN_DIR": str(state),
        "TPU_POLL_SECONDS": "0",
    }

    def launch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["./launch.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
        )

    created = launch("tpu-create", "tx-q", "--queued", "--accelerator-type=v4-16")
    assert created.returncode == 0, created.stderr
    vms = json.loads((state / "vms.json").read_text())
    vms["tx-q"]["workers"] = 2  # a v4-16 has two hosts
    (state / "vms.json").write_text(json.dumps(vms))

    proc = launch("tpu-setup", "tx-q")
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[:2] == [
        "tpu-setup: tx-q is queued (WAITING_FOR_RESOURCES, 0 min): waiting until it is ACTIVE",
        "tpu-setup: tx-q is queued (PROVISIONING, 0 min): waiting until it is ACTIVE",
    ]
    installing = [line for line in lines if "installing tx_jax and jax[tpu] into .venv" in line]
    assert len(installing) == 2
    assert all(f"(Python {sys.version.split()[0]})" in line for line in installing), installing
    assert (
        sorted(line for line in lines if "[process 0]" in line)
        == ["tpu-setup [process 0]: [CpuDevice(id=0)]"] * 2
    )
    for worker in ("w0", "w1"):
        repo = state / "vms" / "tx-q" / worker / "tx_jax"
        assert (repo / "scripts" / "tpu_worker_setup.sh").exists()
        assert not (repo / ".venv" / "lib" / "python3.10").exists()
        assert (repo / ".venv" / "lib" / "python3.11" / "site-packages").is_dir()
        installed = list((repo / ".venv" / "lib" / "python3.11" / "site-packages").glob("*tx_jax*"))
        assert installed, "tx_jax is not installed in the worker's .venv"
    # the image's python3 is what the old set-up (python3 -m venv) would have used
    version = subprocess.run([old, "--version"], capture_output=True, text=True).stdout
    assert version.startswith("Python 3.") and int(version.split(".")[1]) < 11
