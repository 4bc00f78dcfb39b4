"""Telling the training program's user that every step is being skipped, instead of skipping on.

A skipped step changes nothing but the loss scale and the counters. While a dynamic loss scale can
still back off, a run of skipped steps is the scale looking for a value that works; once it cannot
back off any further, the next batch meets the same params, the same optimizer state and the same
scale, and a run that keeps overflowing there will not recover on its own.

**Persistent overflow** is `limit` consecutive skipped steps with the loss scale at its floor, the
floor being `min_loss_scale` for a `DynamicLossScale` and the scale itself for a static or no-op
scale (which never change, so each of their skipped steps counts). A dynamic scale's streak counts
from the skipped step that brought it down to the floor; skips above the floor are not counted,
and any finite step ends the streak.

The watch reads only the per-step metrics (`grads_finite`, `loss_scale`, `skipped_steps`) the loop
fetches at its log points anyway, so it never makes the host wait for the device. A streak is
therefore noticed at the first log point at or after its `limit`-th step, and it is counted afresh
after a resume.

Example:
  >>> watch = OverflowWatch(DynamicLossScale(min_loss_scale=1.0), limit=100)
  >>> message = watch.update(fetched_window, step)  # at each log point; None while all is well
"""

from __future__ import annotations

import collections
from typing import Any, Mapping, Sequence

import numpy as np

from jamp.loss_scale import DynamicLossScale
from jamp.step import FP8_SATURATION

#: Accepted values of the `on_persistent_overflow` config field.
ON_PERSISTENT_OVERFLOW = ("stop", "warn")


class TrainingDiverged(RuntimeError):
    """Training cannot make progress; the message is one line that says what to try."""


class OverflowWatch:
    """Counts consecutive skipped steps at the loss scale's floor from fetched step metrics.

    Args:
      loss_scale: the run's loss scale (its type and `min_loss_scale` set the floor).
      limit: how many consecutive skipped steps at the floor count as persistent.
    """

    def __init__(self, loss_scale: Any, limit: int):
        if isinstance(loss_scale, DynamicLossScale):
            # Compared in fp32, the dtype the scale is held in: fp32(0.1) > 0.1, for one.
            self._floor = np.float32(loss_scale.min_loss_scale)
        else:
            self._floor = np.float32(np.inf)  # a static or no-op scale is always at its floor
        self.limit = limit
        self.streak = 0  # consecutive skipped steps at the floor, up to the last step seen
        self._reported = 0  # the streak's length when it was last reported

    def update(self, window: Sequence[Mapping[str, Any]], step: int) -> str | None:
        """Takes the host-side metrics of consecutive steps ending at `step`, oldest first.

        Returns:
          None, or a one-line description of the persistent overflow when the streak has reached
          `limit` steps, and again each time it has grown by another `limit` steps.
        """
        if not window:
            return None
        for metrics in window:
            skipped = not bool(metrics["grads_finite"])
            if skipped and np.float32(metrics["loss_scale"]) <= self._floor:
                self.streak += 1
            else:
                self.streak = self._reported = 0
        if self.streak < self._reported + self.limit:
            return None
        self._reported = self.streak
        last = window[-1]
        return (
            f"step {step}: the last {self.streak} steps were all skipped for non-finite gradients "
            f"with the loss scale at {float(last['loss_scale']):g}, which cannot back off "
            f"further ({int(last['skipped_steps'])} steps skipped in all)"
        )


#: The train step's per-module finite flags (`jamp.make_train_step`'s metrics).
BY_MODULE = "grads_finite_by_module"


class OverflowLog:
    """Which modules' gradients were non-finite on the skipped steps seen so far.

    Reads the step metrics' `grads_finite_by_module` flags (fetched with the rest at log points;
    averaged across replicas in the step, so every process reads the same).

    Example:
      >>> log = OverflowLog()
      >>> events = log.update(window, first_step=41)  # [(step, ["Conv_0"]), ...]
      >>> log.most_frequent()                          # "Conv_0 (12 steps)"
    """

    def __init__(self):
        self.counts: collections.Counter[str] = collections.Counter()

    def update(
        self, window: Sequence[Mapping[str, Any]], first_step: int
    ) -> list[tuple[int, list[str]]]:
        """Takes consecutive steps' metrics, the oldest being step `first_step`; returns
        `(step, non-finite module paths)` for each skipped step among them."""
        events = []
        for offset, metrics in enumerate(window):
            flags = metrics.get(BY_MODULE)
            if flags is None or bool(np.all(metrics["grads_finite"])):
                continue
            names = [name for name, ok in flags.items() if not np.all(np.asarray(ok))]
            self.counts.update(names)
            events.append((first_step + offset, names))
        return events

    def most_frequent(self, top: int = 5) -> str | None:
        """The modules that overflowed on the most steps, for the run's summary."""
        if not self.counts:
            return None
        pairs = self.counts.most_common(top)
        more = len(self.counts) - len(pairs)
        text = ", ".join(f"{name} ({n} step{'s' * (n != 1)})" for name, n in pairs)
        return text + (f" and {more} more" if more > 0 else "")


#: The loss's per-module forward flags (`jamp.train.tasks.make_loss_fn(forward_flags=True)`).
FORWARD = "forward_finite_by_module"


def without_flags(metrics: Mapping[str, Any]) -> dict:
    """The step metrics minus the per-module flags and fp8 saturations: the scalars
    `mean_metrics` averages."""
    return {k: v for k, v in metrics.items() if k not in (BY_MODULE, FORWARD, FP8_SATURATION)}


def advice() -> str:
    """What to try about a persistent overflow, for the end of the program's message."""
    return (
        "try a bf16 policy (--config.policy=mixed_bfloat16), a lower --config.learning_rate, "
        "gradient clipping (--config.max_grad_norm=1.0), or check the data for nan/inf"
    )
