"""Stage 3, unscale and check: the gradients divided by the scale they were computed with, their
finiteness (one verdict, and one flag per module), their norm, and clipping in true units."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jamp.grad_stats import grad_stats

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Checked:
    """The unscaled (and clipped) gradients, whether they are finite, their norm before clipping,
    and `{module path: finite}`."""

    grads: PyTree
    finite: jax.Array
    norm: jax.Array
    finite_by_module: Any


def clip_by_global_norm(grads: PyTree, norm: jax.Array, max_norm: float) -> PyTree:
    """Rescales `grads` (whose global norm is `norm`) so the norm is at most `max_norm`."""
    factor = max_norm / jnp.maximum(norm, max_norm)  # 1 when already inside the ball
    return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)


def unscale_and_check(grads, loss_scale, attribution_depth: int, max_grad_norm) -> Checked:
    """Stage 3. `loss_scale` is the scale of stage 1, not the adjusted one."""
    grads = loss_scale.unscale(grads)
    # The norm, the verdict and one flag per module from one pass over the gradients, a few
    # kernels for all leaves (on a skipped step the flags say where the overflow was; the
    # gradients are averaged already, so replicas agree).
    stats = grad_stats(grads, attribution_depth)
    if max_grad_norm is not None:  # a threshold in true gradient units, so clip unscaled
        grads = clip_by_global_norm(grads, stats.norm, max_grad_norm)
    return Checked(grads, stats.finite, stats.norm, stats.finite_by_group)
