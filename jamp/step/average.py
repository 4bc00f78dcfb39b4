"""Stage 2, average across replicas: gradients, loss, metrics, model state and the extensions'
observations, before anything checks them, so every replica takes the same decisions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jamp.step._trees import pmean_floats
from jamp.step.gradients import Grads


def average(g: Grads, axis_name, reduce_dtype, extensions) -> Grads:
    """Stage 2 over `axis_name` (None: one replica, `g` as it is). `reduce_dtype`: what the
    gradients cross the wire in (None: float32)."""
    if axis_name is None:
        return g
    # Average before checking finiteness: an inf on one replica becomes an inf on all, so every
    # replica takes the same skip decision and the replicas never drift apart. Batch statistics
    # are averaged too, for the same reason.
    grads = g.grads
    if reduce_dtype is not None:  # what crosses the wire; an overflow there is caught
        grads = jax.tree.map(lambda x: x.astype(reduce_dtype), grads)
    grads, loss, model_state, metrics = pmean_floats(
        (grads, g.loss, g.model_state, g.metrics), axis_name
    )
    grads = jax.tree.map(lambda x: x.astype(jnp.float32), grads)
    by_field = {e.field: e for e in extensions}
    observed = {f: by_field[f].reduce(o, axis_name) for f, o in g.observed.items()}
    return dataclasses.replace(
        g, grads=grads, loss=loss, model_state=model_state, metrics=metrics, observed=observed
    )
