"""A sweep on Cloud TPU VMs: each free VM runs the next unfinished point on all its workers.

This host plans each point for the VM's slice, starts it (scripts/tpu.sh `tpu-run --wait`)
and writes WORKDIR/sweep_done.json once it succeeded; a point whose VM is not READY after a
failure goes back to the queue (--recreate makes such a VM again). Usage and behaviour:
docs/tpu_and_cloud.md#a-sweep-on-tpu-vms.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tx_jax import paths
from tx_jax.launch import local, results
from tx_jax.launch.sweeps import (
    FLAG_TYPES,
    Point,
    Sweep,
    command,
    expand,
    jsonable,
    load_sweep,
    select,
)
from tx_jax.launch.tpu_vms import (
    POLL_SECONDS,
    READY,
    RECREATE_WAIT_SECONDS,
    RECREATED,
    VM,
    Cloud,
    SweepError,
    plan_target,
    ready_vms,
)

REMOTE_PYTHON = ".venv/bin/python"  # on each worker, relative to tpu.sh's REMOTE_DIR


def _remote_args(point: Point, config: str) -> list[str]:
    """`tx_jax train`'s arguments for a point (tpu.sh adds parallel.distributed)."""
    argv, wrapper = command(point, config, python=REMOTE_PYTHON)
    if wrapper:  # a generated config file would exist here, not on the VMs
        keys = [k for k, v in point.overrides.items() if not isinstance(v, FLAG_TYPES)]
        raise SweepError(
            f"sweep point {point.index} ({point.name}): {', '.join(keys)} cannot be passed as a "
            "--config flag to the TPU VMs (a list, None or dict); set it in the base config"
        )
    return argv[4:]  # after PYTHON -m tx_jax train


@dataclasses.dataclass
class _Outcome:
    kind: str  # 'done', 'failed', 'lost' (the VM), 'no fit', 'recreated', 'not recreated'
    point: Point | None
    vm: VM
    record: dict = dataclasses.field(default_factory=dict)
    detail: str = ""


class TpuSweep:
    def __init__(
        self,
        sweep: Sweep,
        points: list[Point],
        root: str,
        cloud: Cloud,
        *,
        plan: bool,
        recreate: bool,
        echo: Callable[[str], None],
    ):
        self.sweep, self.points, self.root, self.cloud = sweep, points, paths.Path(root), cloud
        self.plan, self.recreate = plan, recreate
        self._echo, self._lock = echo, threading.Lock()
        self.status: dict[int, dict] = {}
        self.spent: dict[int, float] = collections.defaultdict(float)  # over its segments
        self.fits: dict[tuple[int, str], bool] = {}

    def echo(self, line: str) -> None:
        with self._lock:
            self._echo(line)

    # ---------------------------------------------------------------- on a VM (threads)

    def _plan(self, point: Point, vm: VM) -> bool:
        key = (point.index, vm.accelerator_type)
        if key not in self.fits:
            target = plan_target(vm.accelerator_type)  # not None: checked at the start
            argv = [sys.executable, "-m", "tx_jax", "plan", f"--target={target}"]
            argv += ["--programs=train,eval"]
            argv += [a for a in _remote_args(point, self.sweep.config) if a.startswith("--config")]
            proc = subprocess.run(argv, capture_output=True, text=True)
            point.workdir.mkdir(parents=True, exist_ok=True)
            report = f"$ {shlex.join(argv)}\n{proc.stdout}{proc.stderr}"
            (point.workdir / f"plan_{vm.accelerator_type}.txt").write_text(report)
            self.fits[key] = proc.returncode == 0
        return self.fits[key]

    def run_point(self, point: Point, vm: VM) -> _Outcome:
        if self.plan and not self._plan(point, vm):
            return _Outcome("no fit", point, vm)
        argv = self.cloud.start_command(vm.name, _remote_args(point, self.sweep.config))
        point.workdir.mkdir(parents=True, exist_ok=True)
        (point.workdir / "sweep_command.sh").write_text(shlex.join(argv) + "\n")
        start = time.time()
        rc = local.run_logged(argv, point, 1)
        self.spent[point.index] += time.time() - start  # one thread runs a point at a time
        record = {
            "overrides": jsonable(point.overrides),
            "command": shlex.join(argv),
            "wall_s": round(self.spent[point.index], 2),
            "vm": vm.name,
            "accelerator_type": vm.accelerator_type,
        }
        if rc == 0:
            (point.workdir / local.DONE_FILE).write_text(json.dumps(record, indent=1) + "\n")
            return _Outcome("done", point, vm, record)
        try:
            node = self.cloud.describe(vm.name)
            state = node.get("state", "") if node else "gone"
        except SweepError as e:  # gcloud cannot say: the point is safer elsewhere
            node, state = None, f"unknown ({e})"
        if state != READY:
            return _Outcome("lost", point, vm, record, state or "no state")
        return _Outcome("failed", point, vm, record, f"rc {rc}")

    def recreate_vm(self, vm: VM, state: str) -> _Outcome:
        """Delete, create again (same type and runtime, spot or queued), wait, set up."""
        kind = ["--queued"] if vm.queued else ["--spot"]
        version = [f"--version={vm.runtime}"] if vm.runtime else []
        steps = [
            self.cloud.tpu_sh("tpu-delete", vm.name, *(["--queued"] if vm.queued else [])),
            self.cloud.tpu_sh(
                "tpu-create", vm.name, f"--accelerator-type={vm.accelerator_type}", *version, *kind
            ),
        ]
        if state == "gone":  # nothing to delete
            steps = steps[1:]
        for argv in steps:
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or [f"rc {proc.returncode}"])[-1]
                return _Outcome("not recreated", None, vm, detail=f"{argv[2]}: {last}")
        deadline = time.time() + RECREATE_WAIT_SECONDS
        while (node := self.cloud.describe(vm.name)) is None or node.get("state") != READY:
            if time.time() > deadline:
                return _Outcome("not recreated", None, vm, detail="not READY after 2 h")
            time.sleep(POLL_SECONDS)
        proc = subprocess.run(self.cloud.tpu_sh("tpu-setup", vm.name), capture_output=True)
        if proc.returncode != 0:
            return _Outcome("not recreated", None, vm, detail=f"tpu-setup: rc {proc.returncode}")
        return _Outcome("recreated", None, VM.from_describe(vm.name, node))

    # ---------------------------------------------------------------- the controller

    def tabulate(self) -> list[dict]:
        rows = []
        for p in self.points:
            status = self.status.get(p.index) or {"status": "pending"}
            rows.append(results.summarize(p, status))
        results.write_results(self.root, rows)
        results.write_curves(self.root, self.points)
        return rows

    def run(self, vms: list[VM]) -> list[dict]:
        queue = collections.deque(p for p in self.points if p.index not in self.status)
        free, busy = list(vms), []  # busy: running a point, or being recreated
        running: dict[concurrent.futures.Future, VM] = {}  # a point's run or a recreation
        with concurrent.futures.ThreadPoolExecutor(max(1, 2 * len(vms))) as pool:
            while queue or running:
                for vm in list(free):
                    point = next(
                        (p for p in queue if self.fits.get((p.index, vm.accelerator_type), True)),
                        None,
                    )
                    if point is None:
                        continue
                    queue.remove(point)
                    free.remove(vm)
                    busy.append(vm)
                    self.status[point.index] = {"status": f"running on {vm.name}"}
                    self.echo(f"[{point.index}] {point.name}: started on {vm.name}")
                    running[pool.submit(self.run_point, point, vm)] = vm
                # A point that no live VM's slice holds is not run.
                types = sorted({vm.accelerator_type for vm in free + busy})
                for point in list(queue):
                    if types and all(self.fits.get((point.index, t)) is False for t in types):
                        queue.remove(point)
                        self._not_run(point, types)
                if not running:
                    break  # points left, no VM to run them
                finished, _ = concurrent.futures.wait(
                    running, return_when=concurrent.futures.FIRST_COMPLETED
                )
                for future in finished:
                    vm = running.pop(future)
                    busy.remove(vm)
                    outcome = future.result()
                    back = self._handle(outcome, queue, pool, running, busy)
                    if back is not None:
                        free.append(back)
            for point in queue:
                self.status[point.index] = {"status": "not run (no VM left)"}
                self.echo(f"[{point.index}] {point.name}: not run: no VM is left")
        return self.tabulate()

    def _not_run(self, point: Point, types: list[str]) -> None:
        where = ", ".join(f"{point.workdir}/plan_{t}.txt" for t in types)
        self.status[point.index] = {"status": f"does not fit {'/'.join(types)}"}
        self.echo(f"[{point.index}] {point.name}: not run: its plan does not fit ({where})")

    def _handle(self, outcome: _Outcome, queue, pool, running, busy) -> VM | None:
        """Report an outcome -> the VM if it takes points again, else None."""
        point, vm = outcome.point, outcome.vm
        if outcome.kind == "no fit":
            queue.appendleft(point)  # another VM's slice may hold it
            self.status.pop(point.index)
            self.echo(f"[{point.index}] {point.name}: does not fit {vm.accelerator_type}")
            return vm
        if outcome.kind == "done":
            self.status[point.index] = {**outcome.record, "status": "ok"}
            self.echo(
                f"[{point.index}] {point.name}: finished on {vm.name} "
                f"({outcome.record['wall_s']} s)"
            )
            self.tabulate()
            return vm
        if outcome.kind == "failed":
            self.status[point.index] = {**outcome.record, "status": f"failed ({outcome.detail})"}
            self.echo(
                f"[{point.index}] {point.name}: failed on {vm.name} ({outcome.detail}; "
                f"{point.workdir}/{local.LOG_FILE})"
            )
            self.tabulate()
            return vm
        if outcome.kind == "lost":
            queue.appendleft(point)
            self.status.pop(point.index)
            self.echo(
                f"[{point.index}] {point.name}: requeued: {vm.name} is {outcome.detail}; "
                "the point resumes from its last checkpoint on the next free VM"
            )
            if self.recreate and (vm.spot or vm.queued) and outcome.detail in RECREATED:
                self.echo(f"{vm.name}: recreating ({'queued' if vm.queued else 'spot'})")
                busy.append(vm)
                running[pool.submit(self.recreate_vm, vm, outcome.detail)] = vm
            else:
                self.echo(f"{vm.name}: {outcome.detail}, no longer used")
            return None
        if outcome.kind == "recreated":
            self.echo(f"{vm.name}: recreated, {READY}")
            return vm
        self.echo(f"{vm.name}: not recreated ({outcome.detail}), no longer used")
        return None


def run_tpu_sweep(
    path: str | os.PathLike,
    root: str | None,
    tpus: Sequence[str],
    *,
    zone: str | None = None,
    project: str | None = None,
    only: Sequence[int] | None = None,
    dry_run: bool = False,
    recreate: bool = False,
    plan: bool = True,
    overrides: Mapping[str, Any] | None = None,
    echo=print,
) -> list[dict[str, Any]]:
    """Validate, then run (or with dry_run print) every point on the VMs -> the rows."""
    names = [t.strip() for t in tpus if t.strip()]
    if not names:
        raise SweepError("--tpu: name at least one TPU VM (--tpu NAME[,NAME...])")
    if not root or not paths.is_remote(root):
        raise SweepError(
            f"--root {root or '(none)'}: a TPU sweep's root is a gs:// path (--root gs://BUCKET/"
            "sweeps/NAME): every VM writes its points' workdirs there and this host reads them"
        )
    sweep = load_sweep(path)
    try:
        points = select(expand(sweep, root, overrides), only)
    except ValueError as e:
        raise SweepError(str(e)) from None
    cloud = Cloud(zone, project)
    args = {p.index: _remote_args(p, sweep.config) for p in points}  # all flags, or an error
    if dry_run:
        echo(
            f"{len(points)} point(s) over {len(names)} TPU VM(s), round-robin (a real run "
            "gives each free VM the next point, after planning it for the VM's slice):"
        )
        for i, p in enumerate(points):
            vm = names[i % len(names)]
            echo(f"[{p.index}] {p.name} -> {vm}")
            echo("    " + cloud.printed(cloud.start_command(vm, args[p.index])))
        return []
    if shutil.which("gcloud") is None:
        raise SweepError(
            "gcloud is not on PATH: install the Google Cloud CLI "
            "(https://cloud.google.com/sdk/docs/install), or see the commands with --dry-run"
        )
    runner = TpuSweep(sweep, points, root, cloud, plan=plan, recreate=recreate, echo=echo)
    try:
        for p in points:
            if (done := local.done_record(p)) is not None:
                runner.status[p.index] = {**done, "status": "ok"}
    except OSError as e:
        raise SweepError(f"--root {root}: cannot read it: {e}") from None
    pending = [p for p in points if p.index not in runner.status]
    if not pending:
        echo(f"nothing left to do: the {len(points)} point(s) are done ({root})")
        rows = runner.tabulate()
        echo((runner.root / "results.md").read_text())
        return rows
    vms = ready_vms(cloud, names, plan)
    done = len(points) - len(pending)
    echo(
        f"{len(pending)} point(s) to run ({done} done) on "
        + ", ".join(f"{vm.name} ({vm.accelerator_type}, {vm.workers} worker(s))" for vm in vms)
    )
    rows = runner.run(vms)
    echo((runner.root / "results.md").read_text())
    return rows
