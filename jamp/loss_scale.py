"""Loss scales (no-op, static, dynamic) as pytrees that keep every field through JAX transforms.

They keep jmp's interface (its constructors, positional and keyword, and `loss_scale`,
`counter`, `period`, `factor`, `min_loss_scale`, `scale`, `unscale`, `adjust`), so code written
for `jmp.*LossScale` runs unchanged, with the same numbers step for step. Unlike jmp 0.0.4 they
keep every setting through `jax.tree_util`, `jit`, `pmap`, AOT lowering and checkpoints: state
values are leaves, settings are static treedef data, and nothing is validated or converted when
JAX rebuilds them. Their settings are checked in `jamp._loss_scale_config`; the finite verdict
they adjust on is `jamp.finite`'s, re-exported here.

Example:
  >>> ls = DynamicLossScale(2.0**15, growth_interval=100)
  >>> grads = ls.unscale(grads_of_scaled_loss)
  >>> ls = ls.adjust(all_finite(grads))
"""

import dataclasses
import inspect
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jamp._loss_scale_config import (
    FP32_MAX,
    FP32_TINY,
    _checked_fields,
    flax_fields,
    is_number,
    positive_finite_in_fp32,
)
from jamp.finite import all_finite, finite_by_group, select_tree  # noqa: F401
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


def _as_f32(x: Any) -> Any:
    """Returns numbers and arrays as fp32 arrays; other objects pass through.

    JAX rebuilds pytrees with placeholders (tracers of the stored dtype, `ShapedArray`,
    lowering's `ArgInfo`), so only values that are plainly not fp32 are converted.
    """
    if is_number(x) or isinstance(x, (np.ndarray, np.generic)):
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
        if is_number(loss_scale) and not positive_finite_in_fp32(loss_scale):
            raise ValueError(
                "StaticLossScale: loss_scale must be > 0 and finite in fp32 (at most "
                f"{FP32_MAX:.4g}, at least {FP32_TINY:.4g}), got {loss_scale}"
            )
        object.__setattr__(self, "loss_scale", _as_f32(loss_scale))

    def scale(self, tree: T) -> T:
        return _multiply(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        return _multiply(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> "StaticLossScale":
        del grads_finite
        return self


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

    The call takes jmp's arguments, positionally or by keyword (`.period` and `.factor` read
    them back), and jamp's own settings by keyword; a setting takes one of its two names, not
    both. It checks every setting, except in a call that names every field by keyword, which is
    how JAX, `replace` and `flax.serialization` rebuild a scale.

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
        return cls(**flax_fields(dynamic_scale))

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


# A rebuild's call (the class's docstring) names all of these.
_FIELDS = {field.name for field in dataclasses.fields(DynamicLossScale)}


LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


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
