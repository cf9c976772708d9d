"""Run logs: TensorBoard event files, WORKDIR/metrics.jsonl, and a console progress line.

Only process 0 writes. Each metrics.jsonl line is {"step": N, "split": "train", ...floats}.
On a gs:// workdir the event files are staged locally and copied up through tx_jax.paths (at
most every TB_SYNC_SECONDS, and on close), so every write has one client and retry policy.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

import jax
from etils import epath

from tx_jax import paths

PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "tensorflow-datasets",
    "sentencepiece",
    "sacrebleu",
    "ml-collections",
    "numpy",
)


# CPU features the CPU kernels' bfloat16 dots run on: they set a run's speed, so its minutes
# compare only between CPUs with the same ones.
BF16_CPU_FEATURES = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu() -> str:
    """The host CPU as a run should report it: model name, the cores this process may use and
    its bfloat16 features, e.g. 'AMD EPYC, 2 cores, avx512_bf16' (Linux's /proc/cpuinfo;
    platform.processor() elsewhere)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    bf16 = ",".join(f for f in BF16_CPU_FEATURES if f in flags) or "no bfloat16 units"
    return f"{model}, {cores} cores, {bf16}"


@functools.cache  # fixed for the life of the process; read once, not at every save
def versions() -> dict[str, str]:
    """Python, platform, CPU and the versions of the packages a result depends on."""
    out = {"python": sys.version.split()[0], "platform": platform.platform(), "cpu": cpu()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["backend"] = jax.default_backend()
    out["devices"] = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    return out


# How often a gs:// workdir's TensorBoard files are copied up (each copy is the whole file).
TB_SYNC_SECONDS = 30.0


def _summary_writer_class():
    """tensorboardX's SummaryWriter imported without torch (which it imports only to recognise
    torch tensors, at seconds of every process's start)."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's fallback
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricLogger:
    """Writes scalars to TensorBoard and metrics.jsonl; prints the console line."""

    def __init__(
        self,
        workdir: str | epath.Path,
        total_steps: int,
        *,
        train_seconds: float = 0.0,
        eval_seconds: float = 0.0,
        started: float | None = None,
    ):
        """`train_seconds`, `eval_seconds`: the segments' before this process (a resumed
        run's checkpoint's); `started`: when this process's segment began (time.time())."""
        self.workdir = epath.Path(workdir)
        self.total_steps = total_steps
        self.enabled = jax.process_index() == 0
        self._tb = None
        self._created = self._start = time.time()
        self._segment_start = self._created if started is None else started
        self._train_seconds = float(train_seconds)
        self._eval_seconds = float(eval_seconds)
        self._start_step: int | None = None
        self._staging: str | None = None  # local TensorBoard dir of a remote workdir
        self._synced: dict[str, int] = {}  # staged file -> size copied up
        self._last_sync = 0.0
        if self.enabled:
            self.workdir.mkdir(parents=True, exist_ok=True)
            SummaryWriter = _summary_writer_class()
            tb_dir = str(self.workdir / "tensorboard")
            if paths.is_remote(self.workdir):
                self._staging = tb_dir = tempfile.mkdtemp(prefix="tx_jax_tensorboard_")
            self._tb = SummaryWriter(tb_dir)

    def write(self, step: int, split: str, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        try:
            self._write(step, split, scalars)
        except Exception as e:  # noqa: BLE001 - storage clients raise their own types
            raise OSError(
                f"writing the logs in {self.workdir} failed at step {step}: {type(e).__name__}: {e}"
            ) from e

    def _write(self, step: int, split: str, scalars: dict[str, float]) -> None:
        record = {
            "step": int(step),
            "split": split,
            "elapsed": round(time.time() - self._created, 3),  # seconds since the logger started
            "train_seconds": round(self.train_seconds(), 3),  # every segment's, compile included
            "eval_seconds": round(self._eval_seconds, 3),  # the evaluations' part of it
            **{k: float(v) for k, v in scalars.items()},
        }
        paths.append_text(self.workdir / "metrics.jsonl", json.dumps(record) + "\n")
        for key, value in scalars.items():
            self._tb.add_scalar(f"{split}/{key}", value, step)
        self._tb.flush()
        if self._staging and time.time() - self._last_sync >= TB_SYNC_SECONDS:
            self._sync()

    def segment(self, event: str, step: int) -> None:
        """Append {event: 'start' | 'stop', step, seconds, time, cpu, devices} to
        WORKDIR/segments.jsonl: which machine trained which steps, and for how long."""
        if not self.enabled:
            return
        record = {
            "event": event,
            "step": int(step),
            "train_seconds": round(self.train_seconds(), 3),
            "eval_seconds": round(self._eval_seconds, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpu": cpu(),
            "devices": versions()["devices"],
        }
        paths.append_text(self.workdir / "segments.jsonl", json.dumps(record) + "\n")

    def train_seconds(self) -> float:
        """Wall seconds of every segment so far (set-up, compilation, evaluations included)."""
        return self._train_seconds + time.time() - self._segment_start

    def count_eval(self, seconds: float) -> None:
        """Add an evaluation during training (`seconds` of wall time) to eval_seconds."""
        self._eval_seconds += seconds

    def eval_seconds(self) -> float:
        """Wall seconds of evaluation during training in every segment of the run so far."""
        return self._eval_seconds

    def budget_clock(self) -> float:
        """train_seconds minus eval_seconds: what train.time_budget_minutes counts."""
        return self.train_seconds() - self._eval_seconds

    def _sync(self) -> None:
        """Copy the staged event files that grew to WORKDIR/tensorboard."""
        self._last_sync = time.time()
        for rel in paths.files(self._staging):
            local = os.path.join(self._staging, rel)
            size = os.path.getsize(local)
            if self._synced.get(rel) != size:
                remote = self.workdir / "tensorboard" / rel
                remote.parent.mkdir(parents=True, exist_ok=True)
                with open(local, "rb") as f:
                    remote.write_bytes(f.read())
                self._synced[rel] = size

    def progress(self, step: int, scalars: dict[str, float]) -> None:
        """step, loss, lr, tokens/s, ETA on one line."""
        if not self.enabled:
            return
        if self._start_step is None:
            self._start_step, self._start = step, time.time()
        done = max(step - self._start_step, 1)
        eta = (time.time() - self._start) / done * max(self.total_steps - step, 0)
        print(
            f"step {step:>6}/{self.total_steps}  loss {scalars.get('loss', float('nan')):.4f}  "
            f"acc {scalars.get('accuracy', float('nan')):.3f}  lr {scalars.get('lr', 0):.2e}  "
            f"tok/s {scalars.get('tokens_per_sec', 0):,.0f}  "
            f"elapsed {_fmt(time.time() - self._created)}  ETA {_fmt(eta)}",
            flush=True,
        )

    def close(self, quiet: bool = False, copy: bool = True) -> None:
        """Close the writer and copy a remote workdir's last events up (a second call: nothing).
        `quiet`: print a failure, not raise it (the run's own error is the one to see);
        `copy=False`: leave the events (the store is failing)."""
        if self._tb is None:
            return
        tb, self._tb = self._tb, None
        try:
            tb.close()  # flushes: a full local disk fails here
            if self._staging and copy:
                self._sync()
            elif self._staging:
                print(f"warning: the last TensorBoard events were not copied to {self.workdir}")
        except Exception as e:  # noqa: BLE001 - storage clients raise their own types
            if not quiet:
                raise OSError(f"closing the logs in {self.workdir} failed: {e}") from e
            print(f"warning: closing the logs in {self.workdir} failed: {e}")
        finally:
            if self._staging:
                shutil.rmtree(self._staging, ignore_errors=True)
                self._staging = None


def write_json(path: epath.Path, obj: Any) -> None:
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
