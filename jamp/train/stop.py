"""Stopping a run cleanly: SIGTERM or Ctrl-C asks the loop to save a checkpoint and stop after
the current step, at the same step on every process."""

from __future__ import annotations

import signal
from typing import Any, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils


class StopFlag:
    """Turns SIGTERM and Ctrl-C into a request to save and stop after the current step.

    All processes of a multi-process run must stop at the same step: one that stopped alone would
    leave the others waiting in a collective for ever. There `should_stop` compares the processes'
    flags every `every` steps (a signal to any process stops all) and answers False in between.
    """

    def __init__(self, every: int = 1):
        self.signal: Optional[str] = None
        self._every = every
        self._stopping = False
        self._saved: dict[signal.Signals, Any] = {}  # signal -> the handler it had

    def should_stop(self, step: int) -> bool:
        if jax.process_count() == 1:
            return self.signal is not None
        if step % self._every == 0:
            signalled = multihost_utils.process_allgather(np.int32(self.signal is not None))
            self._stopping = bool(np.any(signalled))
            if self._stopping and self.signal is None:
                self.signal = "a signal to another process"
        return self._stopping

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        del frame
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
