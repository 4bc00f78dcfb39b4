"""What rides in a `TrainState` beside the params, model state, optimizer state and loss scale,
as an extension of the train step: one small interface the step's stages call.

An extension owns one field of the state (its slot: fp8's delayed-scaling state, the params'
16-bit copies) and says, for a step:

* `tracing(slot, params)`: the context the loss is traced in (fp8: the scaling scope its
  matmuls read; copies: the casts the matmuls read instead of casting the params again);
* `observes(slot)`: whether the gradient stage differentiates the slot too, to collect what the
  step observed (fp8: each matmul's amaxes, put there by its custom derivative);
* `combine(a, b)` and `reduce(observed, axis_name)`: those observations across microbatches and
  across replicas, so every replica commits alike;
* `holds(slot)`: a bool array when this step must not be applied (a fresh fp8 state's measuring
  step), else None;
* `commit(slot, observed, finite, params)`: the slot after the step (`finite`: the gradients
  were finite; `params`: the params kept, updated or not);
* `metrics(old, new, observed)`: what it adds to the step's metrics.

The base class does nothing: an extension overrides what it needs. Extensions live with their
concern (`jamp.fp8.extension`, `jamp.copies`); `jamp.step` lists the ones it threads.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager, Optional

import jax

PyTree = Any


class Extension:
    """A state slot the train step threads; see the module docstring. Override what you need."""

    #: The `TrainState` field holding the extension's state.
    field: ClassVar[str]

    def tracing(self, slot: PyTree, params: PyTree) -> ContextManager:
        """The context the loss is traced in; `params` are the traced params."""
        del slot, params
        return contextlib.nullcontext()

    def observes(self, slot: PyTree) -> bool:
        """Whether the step differentiates `slot` to collect this step's observations."""
        del slot
        return False

    def combine(self, a: PyTree, b: PyTree) -> PyTree:
        """Two microbatches' observations as one."""
        raise NotImplementedError(f"{type(self).__name__} observes but cannot combine")

    def reduce(self, observed: PyTree, axis_name: str) -> PyTree:
        """Observations agreed by every replica over `axis_name`."""
        raise NotImplementedError(f"{type(self).__name__} observes but cannot reduce")

    def holds(self, slot: PyTree) -> Optional[jax.Array]:
        """A bool array: True when this step must not be applied; None when it never holds one."""
        del slot
        return None

    def commit(self, slot: PyTree, observed: PyTree, finite: jax.Array, params: PyTree) -> PyTree:
        """The slot after the step; `observed` is None when nothing was observed."""
        del observed, finite, params
        return slot

    def metrics(self, old: PyTree, new: PyTree, observed: PyTree) -> dict:
        """Metrics of the step: from the slot before and after, and the observations (or None)."""
        del old, new, observed
        return {}
