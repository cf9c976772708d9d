"""A `jax.profiler` trace of chosen train steps, for TensorBoard's profile view.

`train.profile_steps = (start, stop)` traces steps start .. stop - 1 (numbered from 1) of
every host into WORKDIR/tensorboard/plugins/profile/, beside the run's scalars (the Profile
tab needs `tensorboard-plugin-profile`). The first steps include compilation.
"""

from __future__ import annotations

from typing import Any

import jax
from etils import epath


def profile_window(value: Any, num_steps: int) -> tuple[int, int] | None:
    """train.profile_steps -> (start, stop), or None when off (empty or None); a ValueError
    naming the key for anything else."""
    if value is None or len(value) == 0:
        return None
    if len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise ValueError(f"train.profile_steps={value!r}; expected (start, stop), two integers")
    start, stop = value
    if not 1 <= start < stop <= num_steps + 1:
        raise ValueError(
            f"train.profile_steps={tuple(value)!r}; expected 1 <= start < stop <= "
            f"train.num_steps + 1 = {num_steps + 1} (steps start .. stop - 1 are traced)"
        )
    return start, stop


class StepProfiler:
    """Starts the trace before step `start` runs and stops it once step `stop - 1` has run."""

    def __init__(self, window: tuple[int, int] | None, logdir: epath.Path):
        self.window, self.logdir, self.active = window, logdir, False

    def before(self, step: int) -> None:
        """Called with the number of the step about to run."""
        if self.window and step == self.window[0] and not self.active:
            self.logdir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.logdir))
            self.active = True

    def after(self, step: int, outputs: Any) -> None:
        """Called with the number of the step just dispatched and its outputs."""
        if self.active and step >= self.window[1] - 1:
            jax.block_until_ready(outputs)  # the trace must hold the step's device work
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
