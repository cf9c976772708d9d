"""launch.sh tpu-*: --dry-run prints the gcloud commands (quoted so that each argument stays
one word) and runs nothing; gcloud is not needed (PATH holds no gcloud here)."""

import os
import shlex
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


def test_setup_copies_to_all_workers_and_installs_jax_tpu():
    lines = dry_run("tpu-setup", "tx1", "--zone=z", "--dry-run")
    assert "gcloud compute tpus tpu-vm scp" in lines[1] and "--worker=all" in lines[1]
    words = shlex.split(lines[2][2:])
    assert words[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tx1"]
    assert "--worker=all" in words
    remote = next(w for w in words if w.startswith("--command=")).removeprefix("--command=")
    assert "pip install -q -e '.[test]' 'jax[tpu]'" in remote


def test_run_quotes_user_arguments_as_one_word():
    big = "--config=configs/wmt14_ende.py:variant=big"
    (line,) = dry_run(
        "tpu-run", "tx1", "--dry-run", "--no-plan", "--", big, TRICKY, "--config.train.num_steps=10"
    )
    assert line.startswith("+ gcloud compute tpus tpu-vm ssh tx1 --worker=all '--command=")
    assert r"'\''--workdir=gs://b/run 1'\''" in line  # exact, quoted inside the --command
    words = shlex.split(line[2:])  # what the local shell passes to gcloud
    remote = shlex.split(words[-1].removeprefix("--command="))  # what each worker's shell runs
    start = remote.index("tx_jax.main")
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
        "+ .venv/bin/python -m tx_jax.plan --target=tpu:v5e-16 --programs=train,eval "
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


def test_run_wait_runs_in_the_foreground():
    """--wait (the TPU sweep's way): no nohup, no log file, the workers' exit status."""
    (line,) = dry_run("tpu-run", "tx1", "--dry-run", "--no-plan", "--wait", "--", TRICKY)
    remote = shlex.split(shlex.split(line[2:])[-1].removeprefix("--command="))
    assert remote[:3] == ["cd", "~/tx_jax", "&&"]
    assert remote[3:] == [
        ".venv/bin/python",
        "-m",
        "tx_jax.main",
        TRICKY,
        "--config.parallel.distributed=True",
    ]
