"""The params' 16-bit copies a train state keeps (`TrainState.compute_params`): which leaves get
one, and, while a step traces its loss, which traced value has one ready for its matmuls.

A wrapped model's matmuls read the float32 params in the compute dtype; cast in the step, that is
a kernel per weight matrix per step. A state created with `compute_dtype` keeps the copies, the
step's update writes them with the params (one more output of a kernel it runs anyway), and the
next step's matmuls read them (`ready_casts`): Megatron's 16-bit model params beside float32
main params. The gradient still comes back to the float32 params, in float32.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, ContextManager

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp.extension import Extension

PyTree = Any


def _is_none(x) -> bool:
    return x is None


def compute_copies(params: PyTree, dtype) -> PyTree:
    """`params` with each floating matrix (two or more axes: matmul and convolution kernels,
    embeddings) wider than `dtype` cast to it, and None in every other leaf's place."""
    dtype = jnp.dtype(dtype)

    def copy(leaf):
        d = jnp.dtype(leaf.dtype) if hasattr(leaf, "dtype") else jnp.result_type(leaf)
        if not (jnp.issubdtype(d, jnp.floating) and jnp.ndim(leaf) >= 2):
            return None
        if d.itemsize <= dtype.itemsize:
            return None
        if isinstance(leaf, jax.ShapeDtypeStruct):  # an abstract state: abstract copies
            return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
        return jnp.asarray(leaf).astype(dtype)

    return jax.tree.map(copy, params)


def dtype_of(copies: PyTree):
    """The dtype of a tree of copies (from `compute_copies`), or None where it holds none."""
    return next((c.dtype for c in jax.tree.leaves(copies)), None)


def recast(params: PyTree, copies: PyTree) -> PyTree:
    """`copies` (from `compute_copies`) made again from `params`: each leaf cast to its copy's dtype."""
    return jax.tree.map(
        lambda c, p: None if c is None else p.astype(c.dtype), copies, params, is_leaf=_is_none
    )


def pairs(params: PyTree, copies: PyTree) -> list[tuple[Any, Any]]:
    """`(param leaf, its copy or None)` for every leaf, for `ready_casts`."""
    treedef = jax.tree.structure(copies, is_leaf=_is_none)
    leaves = treedef.flatten_up_to(params)  # type: ignore[attr-defined]  # jaxlib has no stub
    return list(zip(leaves, jax.tree.leaves(copies, is_leaf=_is_none)))


# (id(value), (value, its copy in a compute dtype)) while a step traces its loss: see `ready_casts`.
_READY: dict[int, tuple[Any, Any]] = {}


@contextlib.contextmanager
def ready_casts(pairs):
    """While tracing: for each `(value, copy)` pair (`copy` None: none), a matmul or convolution
    that reads `value` in `copy`'s dtype reads `copy` instead of casting `value` again. Values are
    matched by identity: a value the model transforms first is cast as before.

    The train step passes its params with `TrainState.compute_params`, the copies the previous
    step's update wrote: the cast kernel per weight matrix per step goes (Megatron's 16-bit model
    params beside float32 main params). The gradient still comes back to `value`, in its dtype.
    """
    before = dict(_READY)
    _READY.update((id(v), (v, c)) for v, c in pairs if c is not None)
    try:
        yield
    finally:
        _READY.clear()
        _READY.update(before)


def has_ready() -> bool:
    return bool(_READY)


def follow_ready(x, out, rearrange) -> None:
    """Where `x` has a ready copy, `out` (= `rearrange(x)`, a transpose or reshape: Flax's
    `Embed.attend` and Hugging Face's Conv1D transpose their kernels before the matmul) has
    `rearrange(copy)`, until the `ready_casts` that holds `x` ends."""
    found = _READY.get(id(x))
    if found is not None and found[0] is x:
        _READY[id(out)] = (out, rearrange(found[1]))


def ready(x, dtype):
    """The copy of `x` in `dtype` that `ready_casts` holds, or None."""
    found = _READY.get(id(x))
    if found is None or found[0] is not x or np.dtype(found[1].dtype) != np.dtype(dtype):
        return None
    return found[1]


def ready_operands(lhs, rhs, dtype) -> tuple[Any, Any]:
    """Each operand's ready copy in `dtype`, or None: what a matmul or convolution reads."""
    return ready(lhs, dtype), ready(rhs, dtype)


def cast(x, dtype):
    """`x.astype(dtype)`, or the copy `ready_casts` holds for `x` in `dtype` (its gradient goes
    back to `x`, as a cast's would)."""
    found = ready(x, dtype)
    return lax.convert_element_type(x, dtype) if found is None else _read_ready(x, found)


@jax.custom_vjp
def _read_ready(x, ready):
    return ready


def _read_ready_fwd(x, ready):
    return ready, (jnp.zeros((0,), x.dtype), ready)


def _read_ready_bwd(residuals, g):
    like, ready = residuals
    return g.astype(like.dtype), no_gradient(ready)


_read_ready.defvjp(_read_ready_fwd, _read_ready_bwd)


def no_gradient(ready):
    """The cotangent of the `ready_casts` copies: none flows there (they are the params' values
    rounded; the gradient goes to the params)."""
    return jax.tree.map(jnp.zeros_like, ready)


class CopiesExtension(Extension):
    """The copies (`TrainState.compute_params`) as an extension of the train step: the loss is
    traced with them ready for its matmuls, and the step makes them again from the params it
    keeps (one more output of the update's kernels; a skipped step's are the same bits)."""

    field: ClassVar[str] = "compute_params"

    def tracing(self, slot, params) -> ContextManager:
        return ready_casts(() if slot is None else pairs(params, slot))

    def commit(self, slot, observed, finite, params):
        del observed, finite
        return None if slot is None else recast(params, slot)
