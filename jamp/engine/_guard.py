"""Recognition never breaks a wrap: a recogniser that fails falls back to the plain rewrite.

The engine's recognisers (fused attention and its k/v repeats and masks, activation functions
recomputed in the backward, the loss's tail) read patterns in programs that nobody here wrote.
Where one meets a form it cannot prove (an exception inside it, which is a recogniser's bug,
not the user's), the program runs as if that recogniser were off: equation by equation, every
matmul still in the compute dtype. The user gets one `RecognitionWarning` naming the module and
what was not recognised, not a traceback.
"""

from __future__ import annotations

import warnings
from typing import Callable, TypeVar

__all__ = ["RecognitionWarning", "attempt", "uncovered", "warn"]

_T = TypeVar("_T")


class RecognitionWarning(UserWarning):
    """Part of a program does not run as the policy would have it, and runs as traced instead:
    a pattern jamp recognises (an attention, a repeat of keys and values, a recomputed activation,
    a loss's tail) was not recognised in a module (it runs equation by equation, under the same
    policy), or a contraction jamp does not rewrite (`jamp.engine.UNCOVERED_CONTRACTIONS`) runs in
    float32. Silence it with `warnings.filterwarnings("ignore", category=jamp.RecognitionWarning)`;
    please report the model."""


def warn(what: str, where: str, error: BaseException) -> None:
    """One line: what was not recognised, in which module, why, and what runs instead."""
    detail = f"{type(error).__name__}: {error}".strip().splitlines()[0][:200]
    warnings.warn(
        f"jamp: {what} in {where or 'the top-level program'} was not recognised ({detail}); "
        "it runs as traced, each matmul still under the policy.",
        RecognitionWarning,
        stacklevel=2,
    )


def uncovered(primitive: str) -> None:
    """One line: a float32 contraction that jamp leaves as traced under a 16-bit policy."""
    warnings.warn(
        f"jamp: `{primitive}` is a contraction jamp does not run in the policy's compute dtype "
        "(in this form); it runs as traced, in float32.",
        RecognitionWarning,
        stacklevel=2,
    )


def attempt(what: str, where: Callable[[], str], fn: Callable[[], _T], fallback: _T) -> _T:
    """`fn()`, or `fallback` (with a warning) where the recogniser raises."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - any failure of a recogniser is a fallback
        warn(what, where(), error)
        return fallback
