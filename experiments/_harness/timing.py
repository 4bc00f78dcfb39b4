"""Interleaved timing for noisy shared machines (a few cores shared with other work).

Every variant is timed once per round, in an order that rotates from round to round (and runs
backwards every other round, so that no variant always follows the same one), so that a burst of
background load hits all variants of a round alike. Compare variants by the median of the
per-round ratios, not by ratios of medians.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import jax

#: How the tables built on `interleaved` and `ratio_stats` read.
RATIO_NOTE = (
    "- ratios: median of per-round ratios [min–max over rounds]; step ms: median over rounds"
)


def stepper(compiled: Callable, state, *args) -> Callable[[], object]:
    """A runner for `interleaved`: one call is one step `compiled(state, *args) -> (state,
    metrics)`, the (donated) state carried from call to call; it returns the step's metrics."""
    box = [state]

    def run():
        box[0], metrics = compiled(box[0], *args)
        return metrics

    return run


def interleaved(
    runners: Mapping[str, Callable[[], object]], rounds: int, steps: int | Mapping[str, int]
) -> dict[str, list[float]]:
    """Times `steps` calls of each runner per round; returns seconds per call, one per round.

    Args:
      runners: name -> zero-argument callable doing one step and returning its outputs.
      rounds: how many rounds.
      steps: calls per variant per round (or name -> calls, for variants much slower than the
        rest); only the last call's outputs are waited for, which is enough when each call
        consumes the previous one's state.
    """
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order[::-1] if r % 2 else order:
            run = runners[name]
            n = steps[name] if isinstance(steps, Mapping) else steps
            start = time.perf_counter()
            for _ in range(n):
                out = run()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / n)
    return times


def ratio_stats(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the per-round ratios num[r] / den[r]."""
    ratios = [a / b for a, b in zip(num, den)]
    return statistics.median(ratios), min(ratios), max(ratios)


def median_ms(seconds: list[float]) -> float:
    """The median of per-round seconds, in milliseconds."""
    return 1e3 * statistics.median(seconds)
