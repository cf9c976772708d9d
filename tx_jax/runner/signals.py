"""Stopping cleanly: SIGTERM / SIGINT save a checkpoint at the next step boundary."""

from __future__ import annotations

import signal
import threading

import jax

from tx_jax.training import checkpoint as ckpt_lib


class StopSignal:
    """SIGTERM / SIGINT ask the loop to save and exit at the next step boundary; a second
    SIGINT interrupts at once. Only a single process installs a handler: with several, JAX's
    coordination service watches SIGTERM and Orbax's `reached_preemption` makes them agree
    on the step, and a Python handler would replace that watcher."""

    def __init__(self, checkpointer: ckpt_lib.Checkpointer):
        self.checkpointer = checkpointer
        self.signum: int | None = None
        self._previous = {}
        main = threading.current_thread() is threading.main_thread()
        if main and jax.process_count() == 1:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "preemption"

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1:
            return bool(self.checkpointer.manager.reached_preemption(step))
        return self.signum is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
