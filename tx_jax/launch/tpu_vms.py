"""Cloud TPU VMs for a sweep: `gcloud ... tpu-vm describe` for a VM's state, scripts/tpu.sh
(its quoting, remote directory and set-up) to run on every worker, delete, create, set up.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

TPU_SH = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "tpu.sh"
READY = "READY"
RECREATED = ("PREEMPTED", "TERMINATED", "gone")  # what --recreate brings back
# How often a VM being recreated is asked whether it is READY, and for how long.
POLL_SECONDS = 30
RECREATE_WAIT_SECONDS = 2 * 3600


class SweepError(ValueError):
    """A mistake the user can fix (a VM, the root, gcloud): one line, nothing started."""


@dataclasses.dataclass
class VM:
    name: str
    accelerator_type: str
    workers: int
    runtime: str = ""
    spot: bool = False
    queued: bool = False

    @classmethod
    def from_describe(cls, name: str, node: Mapping[str, Any]) -> VM:
        scheduling = node.get("schedulingConfig") or {}
        return cls(
            name=name,
            accelerator_type=node.get("acceleratorType", ""),
            workers=len(node.get("networkEndpoints") or []) or 1,
            runtime=node.get("runtimeVersion", ""),
            spot=bool(scheduling.get("spot") or scheduling.get("preemptible")),
            queued=bool(node.get("queuedResource")),
        )


class Cloud:
    """The gcloud calls of a TPU sweep (the module's docstring says which go through tpu.sh)."""

    def __init__(self, zone: str | None, project: str | None):
        self.where = [f"--zone={zone}"] * bool(zone) + [f"--project={project}"] * bool(project)

    def describe(self, name: str) -> dict | None:
        """The node's JSON, or None if it does not exist."""
        argv = ["gcloud", "compute", "tpus", "tpu-vm", "describe", name, *self.where]
        proc = subprocess.run([*argv, "--format=json"], capture_output=True, text=True)
        if proc.returncode == 0:
            return json.loads(proc.stdout)
        if "NOT_FOUND" in proc.stderr or "not found" in proc.stderr.lower():
            return None
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise SweepError(f"{shlex.join(argv)}: {last}")

    def tpu_sh(self, command: str, name: str, *args: str) -> list[str]:
        return ["bash", str(TPU_SH), command, name, *self.where, *args]

    def start_command(self, name: str, args: Sequence[str]) -> list[str]:
        """scripts/tpu.sh's command that runs tx_jax train ARGS on every worker and waits."""
        return self.tpu_sh("tpu-run", name, "--no-plan", "--wait", "--", *args)

    def printed(self, argv: Sequence[str]) -> str:
        """What tpu.sh --dry-run prints for `argv`: the gcloud command, exactly."""
        cut = argv.index("--") if "--" in argv else len(argv)
        argv = [*argv[:cut], "--dry-run", *argv[cut:]]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SweepError(proc.stderr.strip().splitlines()[-1])
        return proc.stdout.strip()


def plan_target(accelerator_type: str) -> str | None:
    """Cloud's accelerator type -> tx_jax plan's target (as scripts/tpu.sh's plan_target)."""
    if accelerator_type.startswith("v5litepod-"):
        return "tpu:v5e-" + accelerator_type.removeprefix("v5litepod-")
    if accelerator_type.split("-")[0] in ("v4", "v5p", "v5e", "v6e"):
        return f"tpu:{accelerator_type}"
    return None


def ready_vms(cloud: Cloud, names: Sequence[str], plan: bool) -> list[VM]:
    """The named VMs, each READY and (with `plan`) of a slice tx_jax plan knows, else the
    first mistake as a SweepError."""
    vms = []
    for name in dict.fromkeys(names):  # each once
        node = cloud.describe(name)
        state = node.get("state", "") if node else "gone"
        if node is None or state != READY:
            where = " ".join(cloud.where)
            raise SweepError(
                f"TPU VM {name} "
                + ("does not exist" if node is None else f"is {state}, not {READY}")
                + f" (gcloud compute tpus tpu-vm describe {name} {where}".rstrip()
                + "); create it with ./launch.sh tpu-create and tpu-setup, or leave it out"
            )
        vms.append(VM.from_describe(name, node))
        if plan and plan_target(vms[-1].accelerator_type) is None:
            raise SweepError(
                f"TPU VM {name}: tx_jax plan cannot plan for {vms[-1].accelerator_type} "
                "(v4, v5e, v5p, v6e slices); pass --no-plan to start its points unplanned"
            )
    if plan and importlib.util.find_spec("libtpu") is None:
        raise SweepError(
            "planning each point needs the TPU compiler (the plan extra: pip install -e "
            "'.[plan]'; ./launch.sh sweep --tpu installs it), or pass --no-plan"
        )
    return vms
