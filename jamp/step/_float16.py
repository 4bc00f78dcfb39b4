"""The commonest fp16 mistake, caught while the step traces: float16 compute with no loss scale."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
from jax.extend import core as jcore

_WARNED_UNSCALED: list[bool] = []


def _computes_in_float16(jaxpr) -> bool:
    """Whether the program makes float16 arrays (a float16 policy's casts and matmuls; on a CPU
    without float16 matmuls, jamp widens float16 operands for a float32 dot)."""
    for eqn in jaxpr.eqns:
        if any(
            getattr(v.aval, "dtype", None) == jnp.float16 and getattr(v.aval, "ndim", 0)
            for v in eqn.outvars
        ):
            return True
        if any(_computes_in_float16(sub) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def warn_float16_unscaled(jaxpr) -> None:
    """Once per process: float16 compute under a NoOpLossScale, the commonest fp16 mistake
    (PyTorch's autocast without a GradScaler): small gradients flush to zero in float16."""
    if _WARNED_UNSCALED or not _computes_in_float16(jaxpr):
        return
    _WARNED_UNSCALED.append(True)
    warnings.warn(
        "the train step computes in float16 without a loss scale (the state holds a "
        "NoOpLossScale): gradients below float16's range flush to zero. Create the state with "
        "loss_scale=jamp.loss_scale_for(policy) (a dynamic scale for float16).",
        stacklevel=4,
    )
