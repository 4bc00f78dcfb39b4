"""Stage 4, update: the optax update on the params' float32 view, rounded to their dtypes."""

from __future__ import annotations

import jax
import optax

from jamp import rounding
from jamp.state import TrainState, float32_view
from jamp.step._trees import conform

# Folded into the step's key for the params' stochastic rounding: a stream apart from dropout's,
# the same on every replica (the replica index is folded into dropout's alone).
_ROUNDING_STREAM = 0x524F554E


def update(tx: optax.GradientTransformation, grads, state: TrainState, param_rounding, step_rng):
    """Stage 4: `(params, opt_state)` after `tx` on the unscaled `grads`. `step_rng`: the step's
    key before the replica index is folded in (replicas and shards round alike)."""
    # The update is applied in float32 and rounded to the params' dtypes: 16-bit params take
    # updates below half their ulp in expectation (stochastic) instead of losing them.
    params32 = float32_view(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, params32)
    opt_state = conform(opt_state, state.opt_state, "the state tx.update returned")
    params = rounding.round_tree(
        optax.apply_updates(params32, updates),
        state.params,
        param_rounding,
        jax.random.fold_in(step_rng, _ROUNDING_STREAM),
    )
    return params, opt_state
