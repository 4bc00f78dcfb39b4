"""Stage 5, commit: the step applied or kept, the extensions' slots committed, the loss scale
adjusted, the step counted, and the step's metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jamp.finite import select_tree
from jamp.state import TrainState
from jamp.step.check import Checked
from jamp.step.gradients import Grads


def _applied(state, g: Grads, finite, extensions):
    """Whether the step is applied: finite gradients, and no observing extension holding it."""
    applied = finite
    for ext in extensions:
        if ext.field in g.observed:
            held = ext.holds(getattr(state, ext.field))
            if held is not None:
                applied = applied & jnp.logical_not(held)
    return applied


def commit(
    state: TrainState, g: Grads, checked: Checked, params, opt_state, extensions, by_module: bool
):
    """Stage 5: `(new_state, metrics)` from the update `(params, opt_state)` of stage 4."""
    finite = checked.finite
    applied = _applied(state, g, finite, extensions)
    # A skipped step leaves everything but the loss scale and the counters bit-identical, batch
    # statistics included (a nan in them would otherwise poison every later step).
    params, opt_state, model_state = select_tree(
        applied,
        (params, opt_state, g.model_state),
        (state.params, state.opt_state, state.model_state),
    )
    old = {e.field: getattr(state, e.field) for e in extensions}
    new = {
        e.field: e.commit(old[e.field], g.observed.get(e.field), finite, params) for e in extensions
    }
    new_loss_scale = state.loss_scale.adjust(finite)  # back off on overflow, grow when stable
    skipped_steps = state.skipped_steps + jnp.logical_not(applied).astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1,  # counts skipped steps too: schedules and rngs move on
        params=params,
        opt_state=opt_state,
        model_state=model_state,
        loss_scale=new_loss_scale,
        skipped_steps=skipped_steps,
        **new,
    )
    metrics: dict[str, jax.Array] = {
        **g.metrics,
        "loss": g.loss,
        "grad_norm": checked.norm,
        "loss_scale": new_loss_scale.loss_scale,
        "grads_finite": finite,
        "skipped_steps": skipped_steps,
    }
    if by_module:
        metrics["grads_finite_by_module"] = checked.finite_by_module
    for e in extensions:
        metrics.update(e.metrics(old[e.field], new[e.field], g.observed.get(e.field)))
    return new_state, metrics
