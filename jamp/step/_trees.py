"""Tree helpers the step's stages share: fp32 metrics, state leaves kept in their dtypes, the
average of floating leaves across replicas."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any
Metrics = Mapping[str, jax.Array]


def metrics_fp32(metrics: Metrics) -> dict[str, jax.Array]:
    """Returns the user's metrics as fp32 arrays, so they can be averaged and logged alike."""
    # Integer counts and bool flags become fp32 too: averaged over replicas they are fractions.
    return jax.tree.map(lambda value: jnp.asarray(value, jnp.float32), dict(metrics))


def conform(new: PyTree, old: PyTree, what: str) -> PyTree:
    """Returns `new` with the structure check passed and every leaf cast to `old`'s dtype."""
    # A state leaf whose dtype drifts (bf16 statistics, a weakly typed counter) would make the next
    # jitted call compile again, and would break the lax.scan carry and select_tree below.
    if not jax.tree.leaves(old) and not jax.tree.leaves(new):
        return old  # a model without mutable state may hand back {} or None
    if jax.tree.structure(new) != jax.tree.structure(old):  # type: ignore[operator]  # PyTreeDef: jaxlib has no stub
        raise ValueError(
            f"{what} has structure {jax.tree.structure(new)}, "
            f"but the state holds {jax.tree.structure(old)}; they must match."
        )
    return jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), new, old)


def pmean_floats(tree: PyTree, axis_name: str) -> PyTree:
    """Averages the floating-point leaves of `tree` over `axis_name`; other leaves pass through."""

    # Integer leaves (counters in model state) are the same on every replica already, and a pmean
    # of integers would truncate.
    def mean(x):
        return lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x

    return jax.tree.map(mean, tree)
