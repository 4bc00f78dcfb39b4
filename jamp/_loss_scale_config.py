"""A loss scale's settings checked and resolved: jmp's names and Flax's into jamp's, each setting
in its range and every bound a normal fp32 number, with a one-line `ValueError` naming the first
bad setting and what it accepts. `jamp.loss_scale` builds its scales from these."""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


FP32_MAX = float(np.finfo(np.float32).max)
FP32_TINY = float(np.finfo(np.float32).tiny)


def positive_finite_in_fp32(x: float) -> bool:
    """True when `x` stays a positive, finite, normal number once stored as an fp32 scale.

    A bound or scale past fp32's range becomes inf (or 0) on the device: the scale would then reach
    inf (or 0) and never leave it, since inf * backoff_factor is inf and 0 * growth_factor is 0.
    """
    return FP32_TINY <= x <= FP32_MAX and FP32_TINY <= float(np.float32(x)) <= FP32_MAX


_DEFAULT_MAX = 2.0**24


def _error(message: str) -> ValueError:
    return ValueError(f"DynamicLossScale: {message}")


def _is_whole(value: Any) -> bool:
    """An int, a whole float (jmp takes `period=5.`) or a concrete integer scalar; not a bool."""
    if isinstance(value, (float, np.floating)):
        return math.isfinite(value) and float(value).is_integer()
    if isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, jax.core.Tracer):
        return np.ndim(value) == 0 and jnp.issubdtype(value.dtype, jnp.integer)
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _resolve_jmp_names(period, factor, growth_interval, growth_factor, backoff_factor):
    """jamp's (growth_interval, growth_factor, backoff_factor) from either naming: jmp's `period`
    is `growth_interval`; its `factor` grows by `factor` and backs off by `1 / factor`. One
    setting under both names is an error, not a silent choice."""
    if period is not None:
        if growth_interval is not None:
            raise _error("give period (jmp's name) or growth_interval, not both")
        growth_interval = period
    if factor is not None:
        if growth_factor is not None or backoff_factor is not None:
            raise _error("give factor (jmp's name) or growth_factor / backoff_factor, not both")
        if not is_number(factor) or not factor > 1:
            raise _error(f"factor must be a number > 1, got {factor!r}")
        growth_factor, backoff_factor = factor, 1.0 / factor
    return (
        2000 if growth_interval is None else growth_interval,
        2.0 if growth_factor is None else growth_factor,
        0.5 if backoff_factor is None else backoff_factor,
    )


def _check_config(scale, growth_interval, growth_factor, backoff_factor, hysteresis, lo, hi):
    """Raises a one-line ValueError naming the first bad setting and what it accepts."""
    for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if not _is_whole(value) or value < 1:
            raise _error(
                f"{name} must be an int >= 1 (or a whole float, as jmp takes), got {value!r}"
            )
    bounds = {"min_loss_scale": lo, "max_loss_scale": hi}
    numbers = {"growth_factor": growth_factor, "backoff_factor": backoff_factor, **bounds}
    for name, value in numbers.items():
        if not is_number(value):
            raise _error(f"{name} must be a Python number, got {value!r}")
    if not growth_factor > 1:
        raise _error(f"growth_factor must be > 1, got {growth_factor}")
    if not 0 < backoff_factor < 1:
        raise _error(f"backoff_factor must be in (0, 1), got {backoff_factor}")
    if jnp.shape(scale) != ():
        raise _error(f"loss_scale must be a scalar, got shape {jnp.shape(scale)}")
    if not 0 < lo <= hi < math.inf:
        raise _error(
            "need 0 < min_loss_scale <= max_loss_scale < inf (min_loss_scale=0 means no floor), "
            f"got {lo}, {hi}"
        )
    for name, value in bounds.items():
        if not positive_finite_in_fp32(value):
            raise _error(
                f"{name} must be a normal fp32 number (between {FP32_TINY:.4g} and "
                f"{FP32_MAX:.4g}), got {value}"
            )
    try:
        value = float(scale)
    except jax.errors.ConcretizationTypeError:
        return  # Built inside a trace: the value cannot be read, the bounds were checked.
    if not lo <= value <= hi:
        raise _error(
            f"need min_loss_scale <= loss_scale <= max_loss_scale, got {lo}, {value}, {hi}"
        )


def _checked_fields(
    loss_scale: Any = 2.0**16,
    counter: Any = 0,
    period: int | None = None,
    factor: float | None = None,
    min_loss_scale: Any = 1.0,
    *,
    growth_interval: int | None = None,
    growth_factor: float | None = None,
    backoff_factor: float | None = None,
    hysteresis: int = 1,
    max_loss_scale: float | None = None,
    hysteresis_left: Any = None,
) -> dict[str, Any]:
    """The fields of the scale that a user's call (jmp's arguments, jamp's or both) asks for.

    Its signature is `DynamicLossScale`'s; its name is the one a call with a wrong argument reads
    in the `TypeError`, which is why `jamp.loss_scale` imports it with its underscore.
    """
    growth_interval, growth_factor, backoff_factor = _resolve_jmp_names(
        period, factor, growth_interval, growth_factor, backoff_factor
    )
    lo, hi = min_loss_scale, max_loss_scale
    if isinstance(lo, (np.ndarray, np.generic, jax.Array)) and np.ndim(lo) == 0:
        try:  # jmp keeps min_loss_scale as a 0-d array
            lo = float(lo)
        except jax.errors.ConcretizationTypeError:
            raise _error(
                "min_loss_scale must be a concrete number (it is static configuration), "
                "got a traced value"
            ) from None
    lo = FP32_TINY if is_number(lo) and lo == 0 else lo  # jmp's "no floor"
    if hi is None:  # 2**24, or a larger initial scale: jmp's scale has no upper bound
        try:
            hi = max(_DEFAULT_MAX, float(loss_scale))
        except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
            hi = _DEFAULT_MAX
        # A scale past fp32's range stays an error, reported as the scale's.
        hi = hi if positive_finite_in_fp32(hi) else _DEFAULT_MAX
    _check_config(loss_scale, growth_interval, growth_factor, backoff_factor, hysteresis, lo, hi)
    left = hysteresis if hysteresis_left is None else hysteresis_left
    return dict(
        loss_scale=jnp.asarray(loss_scale, jnp.float32),
        counter=jnp.asarray(counter, jnp.int32),
        hysteresis_left=jnp.asarray(left, jnp.int32),
        growth_interval=int(growth_interval),
        growth_factor=float(growth_factor),
        backoff_factor=float(backoff_factor),
        hysteresis=int(hysteresis),
        min_loss_scale=float(lo),
        max_loss_scale=float(hi),
    )


def flax_fields(dynamic_scale: Any) -> dict[str, Any]:
    """The fields of `DynamicLossScale.from_flax(dynamic_scale)` (its docstring says how)."""
    ds = dynamic_scale
    return _checked_fields(
        ds.scale,
        counter=ds.fin_steps,
        growth_interval=int(ds.growth_interval) + 1,
        growth_factor=ds.growth_factor,
        backoff_factor=ds.backoff_factor,
        min_loss_scale=FP32_TINY if ds.minimum_scale is None else ds.minimum_scale,
        max_loss_scale=FP32_MAX,
    )
