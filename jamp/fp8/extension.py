"""fp8's delayed-scaling state (`TrainState.fp8_state`) as an extension of the train step
(`jamp.extension.Extension`).

The loss is traced under the state's scaling scope, whose matmuls read their scales from it;
differentiating the loss with respect to the state as well gives this step's amaxes in its place
(each matmul's custom derivative puts them there). They are max-reduced over microbatches and
replicas; after the finite check the state takes them (a skipped step keeps it bit-identical,
like the params). A fresh delayed state's first step only measures: it is not applied.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar

import jmp

from jamp.extension import Extension
from jamp.fp8 import state as fp8_state
from jamp.fp8.scope import scaling

#: The step metric `{fp8 site: f32[3], how far past fmax the amaxes of x, w and g went}`
#: (`jamp.fp8.saturation`), with an fp8 state: where delayed scaling clipped values, for
#: adaptive precision.
FP8_SATURATION = "fp8_saturation"


@dataclasses.dataclass(frozen=True)
class Fp8Extension(Extension):
    """`metric_sites`: how many representative sites report their newest amax and scale per
    operand in the step's `metrics["fp8"]` (the first, middle and last matmuls)."""

    metric_sites: int = 3
    field: ClassVar[str] = "fp8_state"

    @contextlib.contextmanager
    def tracing(self, slot, params):
        del params
        with scaling(slot) as scope:
            yield
        scope.check_reached()  # a site the loss never reached would never update

    def observes(self, slot) -> bool:
        # The derivative with respect to the state is not a gradient: the optimizer never sees it.
        return fp8_state.uses_state(slot)

    def combine(self, a, b):
        return fp8_state.combine(a, b)  # the step's amax is the largest of its microbatches'

    def reduce(self, observed, axis_name):
        return fp8_state.pmax(observed, axis_name)  # every replica scales its next step alike

    def holds(self, slot):
        # A fresh delayed state's first step only measures: its scales fit no tensor yet.
        return fp8_state.measuring(slot) if fp8_state.uses_state(slot) else None

    def commit(self, slot, observed, finite, params):
        del params
        if observed is None:
            return slot
        # a skipped step keeps the state bit-identical, like the params
        return jmp.select_tree(finite, fp8_state.update(slot, observed), slot)

    def metrics(self, old, new, observed) -> dict:
        out = {}
        if fp8_state.uses_state(new) and self.metric_sites:
            out["fp8"] = fp8_state.metrics(new, fp8_state.representative(new, self.metric_sites))
        if observed is not None:
            out[FP8_SATURATION] = fp8_state.saturation(old, observed)
        return out
