"""Run logs: TensorBoard event files, WORKDIR/metrics.jsonl, and a console progress line.

Only process 0 writes. Each metrics.jsonl line is {"step": N, "split": "train", ...floats}.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import platform
import sys
import time
from typing import Any

import jax
from etils import epath

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


@functools.cache  # fixed for the life of the process; read once, not at every save
def versions() -> dict[str, str]:
    """Python, platform and the versions of the packages a result depends on."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["backend"] = jax.default_backend()
    out["devices"] = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    return out


class MetricLogger:
    """Writes scalars to TensorBoard and metrics.jsonl; prints the console line."""

    def __init__(self, workdir: str | epath.Path, total_steps: int):
        self.workdir = epath.Path(workdir)
        self.total_steps = total_steps
        self.enabled = jax.process_index() == 0
        self._tb = None
        self._created = self._start = time.time()
        self._start_step: int | None = None
        if self.enabled:
            self.workdir.mkdir(parents=True, exist_ok=True)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.workdir / "tensorboard"))

    def write(self, step: int, split: str, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        try:
            self._write(step, split, scalars)
        except OSError as e:
            raise OSError(f"writing the logs in {self.workdir} failed at step {step}: {e}") from e

    def _write(self, step: int, split: str, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._tb.add_scalar(f"{split}/{key}", value, step)
        self._tb.flush()
        record = {
            "step": int(step),
            "split": split,
            "elapsed": round(time.time() - self._created, 3),  # seconds since the run started
            **{k: float(v) for k, v in scalars.items()},
        }
        with (self.workdir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

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

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def write_json(path: epath.Path, obj: Any) -> None:
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
