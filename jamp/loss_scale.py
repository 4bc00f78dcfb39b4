"""Loss scales (no-op, static, dynamic) as pytrees that keep every field through JAX transforms.

They keep jmp's interface (its constructors, positional and keyword, and `loss_scale`,
`counter`, `period`, `factor`, `min_loss_scale`, `scale`, `unscale`, `adjust`), so code written
for `jmp.*LossScale` runs unchanged, with the same numbers step for step. Unlike jmp 0.0.4 they keep every setting through
`jax.tree_util`, `jit`, `pmap`, AOT lowering and checkpoints: state values are leaves, settings
are static treedef data, and nothing is validated or converted when JAX rebuilds them.

Example:
  >>> ls = DynamicLossScale(2.0**15, growth_interval=100)
  >>> grads = ls.unscale(grads_of_scaled_loss)
  >>> ls = ls.adjust(all_finite(grads))
"""

import dataclasses
import inspect
import math
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import jmp
import numpy as np
from flax import struct

from jamp import grad_stats
from jamp.precision import PolicyLike, get_policy

T = TypeVar("T")


def _multiply(tree: T, factor: jax.Array) -> T:
    """Multiplies the floating leaves of `tree` by an fp32 factor, keeping each leaf's dtype."""

    def mul(x):
        dtype = jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.floating):
            return x
        # The product is formed in fp32 (or wider) so that 1/scale cannot underflow in fp16.
        return (x * factor).astype(dtype)

    return jax.tree_util.tree_map(mul, tree)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


_FP32_MAX = float(np.finfo(np.float32).max)
_FP32_TINY = float(np.finfo(np.float32).tiny)


def _positive_finite_in_fp32(x: float) -> bool:
    """True when `x` stays a positive, finite, normal number once stored as an fp32 scale.

    A bound or scale past fp32's range becomes inf (or 0) on the device: the scale would then reach
    inf (or 0) and never leave it, since inf * backoff_factor is inf and 0 * growth_factor is 0.
    """
    return _FP32_TINY <= x <= _FP32_MAX and _FP32_TINY <= float(np.float32(x)) <= _FP32_MAX


def _as_f32(x: Any) -> Any:
    """Returns numbers and arrays as fp32 arrays; other objects pass through.

    JAX rebuilds pytrees with placeholders (tracers of the stored dtype, `ShapedArray`,
    lowering's `ArgInfo`), so only values that are plainly not fp32 are converted.
    """
    if _is_number(x) or isinstance(x, (np.ndarray, np.generic)):
        return jnp.asarray(x, jnp.float32)
    if isinstance(x, jax.Array) and x.dtype != jnp.float32:
        return x.astype(jnp.float32)
    return x


@struct.dataclass
class NoOpLossScale:
    """A loss scale of 1 that leaves trees untouched; for fp32 and bf16 training.

    Example:
      >>> NoOpLossScale().scale(loss) is loss
      True
    """

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: jax.Array) -> "NoOpLossScale":
        del grads_finite
        return self


@struct.dataclass
class StaticLossScale:
    """A fixed loss scale, held as an fp32 leaf so that changing it does not recompile.

    Args:
      loss_scale: the scale; a power of two keeps `unscale` exact.

    Example:
      >>> ls = StaticLossScale(2.0**10)
      >>> grads = ls.unscale(jax.grad(lambda p: ls.scale(loss_fn(p)))(params))
    """

    loss_scale: jax.Array

    def __init__(self, loss_scale):
        if _is_number(loss_scale) and not _positive_finite_in_fp32(loss_scale):
            raise ValueError(
                "StaticLossScale: loss_scale must be > 0 and finite in fp32 (at most "
                f"{_FP32_MAX:.4g}, at least {_FP32_TINY:.4g}), got {loss_scale}"
            )
        object.__setattr__(self, "loss_scale", _as_f32(loss_scale))

    def scale(self, tree: T) -> T:
        return _multiply(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        return _multiply(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> "StaticLossScale":
        del grads_finite
        return self


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
        if not _is_number(factor) or not factor > 1:
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
        if not _is_number(value):
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
        if not _positive_finite_in_fp32(value):
            raise _error(
                f"{name} must be a normal fp32 number (between {_FP32_TINY:.4g} and "
                f"{_FP32_MAX:.4g}), got {value}"
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
    """The fields of the scale that a user's call (jmp's arguments, jamp's or both) asks for."""
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
    lo = _FP32_TINY if _is_number(lo) and lo == 0 else lo  # jmp's "no floor"
    if hi is None:  # 2**24, or a larger initial scale: jmp's scale has no upper bound
        try:
            hi = max(_DEFAULT_MAX, float(loss_scale))
        except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
            hi = _DEFAULT_MAX
        # A scale past fp32's range stays an error, reported as the scale's.
        hi = hi if _positive_finite_in_fp32(hi) else _DEFAULT_MAX
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


@struct.dataclass
class DynamicLossScale:
    """A loss scale that grows while gradients stay finite and backs off when they overflow.

    `adjust(grads_finite)` is Megatron's rule; with `hysteresis=1`, PyTorch's GradScaler (which
    grows on the `growth_interval`-th finite step; exactly so for power-of-two factors)::

      if grads_finite:
        counter += 1
        if counter == growth_interval:
          loss_scale = min(loss_scale * growth_factor, max_loss_scale)
          counter = 0
          hysteresis_left = hysteresis
      else:
        counter = 0
        hysteresis_left -= 1            # not reset by a backoff, only by a growth
        if hysteresis_left <= 0:
          loss_scale = max(loss_scale * backoff_factor, min_loss_scale)
          # (loss_scale / growth_factor when backoff_factor == 1 / growth_factor, as jmp)

    The leaves are the state: `loss_scale` (fp32 whatever it is given in: fp16 cannot hold
    2**16), `counter` and `hysteresis_left` (int32; the latter stored clamped at 0, which
    changes no decision). The other fields are static settings.

    The call takes jmp's arguments, positionally or by keyword and with jmp's meaning (it grows
    by `factor` every `period` finite steps and backs off by `1 / factor`; `.period` and
    `.factor` read them back), and jamp's own settings by keyword; a setting takes one of its two
    names, not both. It checks every setting, except in a call that names every field by
    keyword, which is how JAX, `replace` and `flax.serialization` rebuild a scale.

    Args:
      loss_scale: initial scale.
      counter: finite steps since the last growth or overflow (jmp's second argument); 0.
      period: jmp's name for `growth_interval`.
      factor: jmp's single factor: `growth_factor=factor`, `backoff_factor=1 / factor`.
      min_loss_scale: lower bound, > 0 (a Python number or a concrete 0-d array, as jmp's);
        0, jmp's "no floor", is fp32's smallest normal number (a scale that reaches 0 would
        zero every gradient: jmp's goes there after ~150 overflows in a row).
      growth_interval: consecutive finite steps before the scale grows (int >= 1; 2000).
      growth_factor: growth multiplier, > 1 (2.0).
      backoff_factor: backoff multiplier, in (0, 1) (0.5).
      hysteresis: overflows tolerated before a backoff (int >= 1; 1).
      max_loss_scale: upper bound, < inf; by default 2**24, or the initial scale if larger.
      hysteresis_left: with `counter`, state to restore; `hysteresis` for a fresh scale.

    Example:
      >>> ls = DynamicLossScale(2.0**15, growth_interval=100)
      >>> float(ls.adjust(jnp.array(False)).loss_scale)
      16384.0
    """

    loss_scale: jax.Array
    counter: jax.Array
    hysteresis_left: jax.Array
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    hysteresis: int = struct.field(pytree_node=False, default=1)
    min_loss_scale: float = struct.field(pytree_node=False, default=1.0)
    max_loss_scale: float = struct.field(pytree_node=False, default=2.0**24)

    __signature__ = inspect.signature(_checked_fields).replace(
        return_annotation=inspect.Signature.empty
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Not the dataclass's: jmp's third positional argument is `period`, not `hysteresis_left`.
        if args or kwargs.keys() != _FIELDS:  # a user's call, not a rebuild
            kwargs = _checked_fields(*args, **kwargs)
        for name, value in kwargs.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_flax(cls, dynamic_scale: Any) -> "DynamicLossScale":
        """The schedule and state of a `flax.training.dynamic_scale.DynamicScale`.

        Flax grows on the finite step after `growth_interval` finite ones, so its interval N is
        jamp's N + 1; `fin_steps` is `counter`; no `minimum_scale` is fp32's smallest normal
        number; Flax's growth stops at fp32's largest, which becomes `max_loss_scale`.
        """
        ds = dynamic_scale
        return cls(
            ds.scale,
            counter=ds.fin_steps,
            growth_interval=int(ds.growth_interval) + 1,
            growth_factor=ds.growth_factor,
            backoff_factor=ds.backoff_factor,
            min_loss_scale=_FP32_TINY if ds.minimum_scale is None else ds.minimum_scale,
            max_loss_scale=_FP32_MAX,
        )

    @property
    def period(self) -> int:
        """jmp's name for `growth_interval`."""
        return self.growth_interval

    @property
    def factor(self) -> float:
        """jmp's name for `growth_factor` (jmp backs off by `1 / factor`)."""
        return self.growth_factor

    def scale(self, tree: T) -> T:
        return _multiply(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        # The reciprocal of a power of two is exact, so this undoes `scale` bit for bit.
        return _multiply(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        """Returns the next state; `grads_finite` is a bool scalar, possibly traced."""
        finite = jnp.asarray(grads_finite)
        if finite.shape != () or finite.dtype != jnp.bool_:
            raise ValueError(
                f"grads_finite must be a bool scalar, got {finite.dtype}{finite.shape}"
            )
        counter = self.counter + 1
        # `>=` rather than `==` so a counter restored under a smaller interval still grows.
        grow = finite & (counter >= self.growth_interval)
        # Clamped at 0: same decisions as Megatron's unbounded decrement, but cannot wrap.
        left_after_overflow = jnp.maximum(self.hysteresis_left - 1, 0)
        back_off = ~finite & (left_after_overflow <= 0)
        scale = self.loss_scale
        scale = jnp.where(grow, jnp.minimum(scale * self.growth_factor, self.max_loss_scale), scale)
        # jmp's single factor divides (multiplying by its rounded reciprocal would differ in the
        # last bit unless it is a power of two); other factors multiply, as GradScaler.
        jmp_factor = self.backoff_factor == 1.0 / self.growth_factor
        backed_off = scale / self.growth_factor if jmp_factor else scale * self.backoff_factor
        scale = jnp.where(back_off, jnp.maximum(backed_off, self.min_loss_scale), scale)
        counter = jnp.where(finite & ~grow, counter, 0)
        left = jnp.where(finite, self.hysteresis_left, left_after_overflow)
        left = jnp.where(grow, self.hysteresis, left)
        # Explicit dtypes: a weak-typed leaf would change the treedef's avals and recompile.
        return dataclasses.replace(
            self,
            loss_scale=scale.astype(jnp.float32),
            counter=counter.astype(jnp.int32),
            hysteresis_left=left.astype(jnp.int32),
        )


# The call with which JAX, `replace` and flax.serialization rebuild a scale names all of these.
_FIELDS = {field.name for field in dataclasses.fields(DynamicLossScale)}


LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def all_finite(tree: Any) -> jax.Array:
    """Returns a bool scalar array: True when every leaf of `tree` is finite.

    Delegates to `jmp.all_finite`, which handles int and bool leaves and empty trees.
    Under `pmap`, average the gradients first so every replica reaches the same verdict.

    Example:
      >>> bool(all_finite({"w": jnp.array([1.0, jnp.inf])}))
      False
    """
    return jmp.all_finite(tree)


def finite_by_group(tree: Any, depth: int = 1) -> dict[str, jax.Array]:
    """Returns `{group: bool scalar}`: whether every leaf of each group of `tree` is finite.

    A group is a path prefix of `depth` branching levels: for a Flax params tree with depth=1,
    the model's top-level modules ("Dense_0", "Block_3", ...; an NNX model's list of blocks gives
    one group per item, "blocks/3"). The flags come from one pass over the leaves
    (`jamp.grad_stats`, which gives the global norm from the same pass), so a train step can
    say which modules overflowed at no extra cost; `all_finite(tree)` is the `and` of the values.

    Example:
      >>> flags = finite_by_group({"a": {"w": jnp.ones(2)}, "b": {"w": jnp.array([jnp.inf])}})
      >>> {k: bool(v) for k, v in flags.items()}
      {'a': True, 'b': False}
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth!r}.")
    return grad_stats.grad_stats(tree, depth).finite_by_group


def select_tree(pred: Any, a: T, b: T) -> T:
    """Returns `a` where the bool scalar `pred` is True, else `b`, leaf by leaf.

    Args:
      pred: bool scalar (Python bool or array, possibly traced).
      a, b: trees of the same structure and leaf dtypes.

    Returns:
      A tree like `a`; use it to skip an update whose gradients overflowed.

    Example:
      >>> params = select_tree(grads_finite, new_params, params)
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(f"pred must be a bool scalar, got {pred.dtype}{pred.shape}")
    return jmp.select_tree(pred, a, b)


def loss_scale_for(policy: PolicyLike) -> LossScale:
    """Returns the default loss scale for a policy: dynamic for fp16 compute, else no-op.

    bf16 has fp32's exponent range, so only fp16 gradients need scaling to avoid underflow.

    Args:
      policy: a `jmp.Policy` or anything `jamp.precision.get_policy` accepts.

    Returns:
      `DynamicLossScale()` when the compute dtype is float16, otherwise `NoOpLossScale()`.

    Example:
      >>> type(loss_scale_for("mixed_float16")).__name__
      'DynamicLossScale'
    """
    if jnp.dtype(get_policy(policy).compute_dtype) == jnp.float16:
        return DynamicLossScale()
    return NoOpLossScale()
