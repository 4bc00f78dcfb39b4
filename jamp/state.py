"""The training state: one immutable pytree that a step consumes and returns.

Everything a run needs to resume lives here as arrays (step, params, optimizer state, mutable model
collections, the loss scale and its counters), and nothing else: no model, no optimizer, no
functions. That keeps the state checkpointable as-is, replicable with `jamp.parallel.replicate`, and
safe to pass through `jax.jit` and `jax.pmap` without static arguments.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Self

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jamp.copies import compute_copies, dtype_of
from jamp.loss_scale import NoOpLossScale

PyTree = Any


def float32_view(params: PyTree) -> PyTree:
    """`params` with its 16-bit float leaves in float32 (what the optimizer sees and updates)."""

    def up(leaf):
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            return jnp.asarray(leaf, jnp.float32)
        return leaf

    return jax.tree.map(up, params)


def _int32_scalar(value: int) -> jax.Array:
    """Returns `value` as a strongly typed int32 scalar array."""
    # A python int (or a weakly typed array) would give the first jitted call a different input type
    # than the int32 the step returns, and the second call would compile again.
    return jnp.asarray(value, dtype=jnp.int32)


@struct.dataclass
class TrainState:
    """Immutable pytree holding everything a training step reads and writes.

    Attributes:
        step: int32 scalar, the number of steps taken, skipped ones included.
        params: the model parameters (normally fp32, whatever the compute dtype; bfloat16 params
            are updated in fp32 and rounded back, stochastically by default: see
            `jamp.step.make_train_step`).
        opt_state: the optax state for `params`, built from their float32 view.
        model_state: mutable Flax collections other than params, e.g. `{'batch_stats': ...}`;
            `{}` for a model without any.
        loss_scale: a `NoOpLossScale`, `StaticLossScale` or `DynamicLossScale` (all pytrees).
        skipped_steps: int32 scalar, how many steps were skipped because the gradients were not
            finite.
        fp8_state: the fp8 matmuls' scaling state (a `jamp.fp8.Fp8State`: per site amax history
            and scales), or None (no fp8, or stateless current scaling).
        adaptive_state: the adaptive-precision controller's state (a
            `jamp.adaptive.AdaptiveState`), or None. The train step passes it through untouched;
            it is here so that checkpoints keep it with the rest.
        compute_params: None, or the params' matrices in the compute dtype (a tree like
            `params`, None for the leaves without a copy): written by each step's update from
            the params it keeps, and read by the wrapped model's matmuls instead of casting the
            params again (see `create`). `replace(params=...)` makes them again.

    Example:
        >>> state = TrainState.create(params, optax.adam(1e-3),
        ...                           model_state={"batch_stats": stats},
        ...                           loss_scale=DynamicLossScale())
        >>> state = state.replace(params=new_params)  # updates return a new state
    """

    step: jax.Array
    params: PyTree
    opt_state: optax.OptState
    model_state: PyTree
    loss_scale: Any
    skipped_steps: jax.Array
    fp8_state: Any = None
    adaptive_state: Any = None
    compute_params: Any = None

    if TYPE_CHECKING:  # flax.struct.dataclass adds it at run time; declared for type checkers

        def replace(self, **updates: Any) -> Self: ...

    @classmethod
    def create(
        cls,
        params: PyTree,
        tx: optax.GradientTransformation,
        *,
        model_state: Mapping[str, Any] | None = None,
        loss_scale: Any = None,
        fp8_state: Any = None,
        adaptive_state: Any = None,
        compute_dtype: Any = None,
    ) -> "TrainState":
        """Builds the state for step 0 and initializes the optimizer state from `params`.

        Args:
            params: the model parameters, e.g. `variables['params']`.
            tx: the optax transformation whose state to initialize; it is not stored, so pass the same
                one to `jamp.step.make_train_step`.
            model_state: mutable collections other than params (e.g. `{'batch_stats': ...}`); `{}` when
                omitted. The train step's `loss_fn` must return a tree of the same structure and dtypes.
            loss_scale: the loss scale to start from; `NoOpLossScale()` when omitted.
            fp8_state: the fp8 scaling state to start from (`jamp.fp8.init_state`), or None.
            adaptive_state: the adaptive-precision state to start from
                (`jamp.adaptive.Controller.init`), or None.
            compute_dtype: the policy's compute dtype (`policy.compute_dtype`). A 16-bit float
                dtype (e.g. `jnp.bfloat16`) keeps `compute_params` in it: every float32 param of two or more
                axes also in that dtype, which the step's update writes as it writes the params
                (one more output of the kernel it runs anyway) and the next step's matmuls read.
                That saves a cast kernel per weight matrix per step, reading the float32 params,
                for 2 bytes per parameter held between steps (the 16-bit copies a step casts
                are alive through its backward pass anyway). The model computes with the cast's
                bits (XLA:CPU at -O0 was seen to round a few copies one step off; checkpoints
                keep the copies, so a resumed run reads what the update wrote). float32 (the
                `float32` policy's) or None (the default): no copies; the step casts the params
                itself if the model computes in 16 bits.

        Returns:
            A `TrainState` with `step == 0` and `skipped_steps == 0`, both int32 arrays.

        Example:
            >>> variables = model.init(key, x)
            >>> params = variables.pop("params")  # what is left: batch_stats and the like
            >>> state = TrainState.create(params, optax.sgd(0.1), model_state=variables)
        """
        if compute_dtype is not None:
            d = jnp.dtype(compute_dtype)
            if not jnp.issubdtype(d, jnp.floating) or d.itemsize == 1:
                raise ValueError(
                    f"compute_dtype must be a float dtype (bfloat16 or float16 for copies, float32 "
                    f"for none), got {d}."
                )
            if d.itemsize > 2:  # the float32 policy computes with the params themselves
                compute_dtype = None
        return cls(
            step=_int32_scalar(0),
            params=params,
            # float32 moments whatever the params' dtype: the step applies updates in float32
            # (16-bit optimizer state is a choice of its own: `jamp.lowbit`)
            opt_state=tx.init(float32_view(params)),
            model_state={} if model_state is None else model_state,
            loss_scale=NoOpLossScale() if loss_scale is None else loss_scale,
            skipped_steps=_int32_scalar(0),
            fp8_state=fp8_state,
            adaptive_state=adaptive_state,
            compute_params=None if compute_dtype is None else compute_copies(params, compute_dtype),
        )


def _replace(self: TrainState, **updates: Any) -> TrainState:
    """A new state with `updates`; new params without new `compute_params` get theirs made again
    from them, so that the copies the matmuls read never go stale."""
    if "params" in updates and "compute_params" not in updates and self.compute_params is not None:
        dtype = dtype_of(self.compute_params)
        updates["compute_params"] = (
            None if dtype is None else compute_copies(updates["params"], dtype)
        )
    return dataclasses.replace(self, **updates)


TrainState.replace = _replace  # type: ignore[method-assign,assignment]  # over flax.struct's
