"""A wrapped NNX model, as users hold it, seen through `apply(variables, *args)`.

`jamp.inspect`'s entry points re-run a model under `jax.jit` with its variables as arguments,
as linen models are called. An NNX model carries its variables: `NnxView(model)` splits it once
into its graph and its state (`{"params": nnx.Param state, "rest": everything else}`) and
`apply` merges them back for the call, so `forward_nonfinite(model, x)` and
`range_report(model, x, loss_fn=...)` take the model as users hold it.
"""

from __future__ import annotations

from typing import Any

from flax import nnx


def is_nnx(model: Any) -> bool:
    return isinstance(model, nnx.Module)


def nnx_objects(state: Any) -> tuple | None:
    """The NNX objects an `nnx.jit` train step takes before its batch (`train_step(model,
    optimizer, batch)`, which updates them in place), where `state` is one (a model, an
    `nnx.Optimizer`) or a tuple of them; else None (a functional step's state)."""
    objects = tuple(state) if isinstance(state, (tuple, list)) else (state,)
    if objects and all(nnx.graph.is_graph_node(o) for o in objects):
        return objects
    return None


def state_of(objects: tuple) -> list:
    """The arrays `objects` (from `nnx_objects`) hold, to wait for."""
    return [nnx.state(o) for o in objects]


class NnxView:
    """`model` (an `nnx.Module`) as `apply(variables, *args, **kwargs)`; `variables` its state."""

    def __init__(self, model: nnx.Module):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        self.graphdef = graphdef
        self.variables = {"params": params, "rest": rest}

    def merge(self, variables) -> nnx.Module:
        """The model with `variables`' values (traced ones inside a transform)."""
        return nnx.merge(self.graphdef, variables["params"], variables["rest"])

    def apply(self, variables, *args, mutable=False, **kwargs):
        del mutable  # the re-run's state changes are thrown away, as for linen
        return self.merge(variables)(*args, **kwargs)


__all__ = ["NnxView", "is_nnx", "nnx_objects", "state_of"]
