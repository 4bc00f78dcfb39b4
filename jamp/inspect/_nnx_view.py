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


__all__ = ["NnxView", "is_nnx"]
