"""Which module's forward output went non-finite first: a re-run of one overflowing batch.

The train step says, at no cost, which modules' *gradients* were non-finite
(`metrics["grads_finite_by_module"]`). That is the whole story when the overflow happened in the
backward pass; when the forward pass already overflowed, every gradient is non-finite and the
step cannot say where it began. `forward_nonfinite` re-runs the model's forward pass on the batch
with every module's output captured and checked, and names the modules whose outputs were not
finite in the order their calls finished: the first is where the overflow began (a child
finishes before its parent, so the innermost module that overflowed comes first).

It costs one more forward pass (and one compile), so the training program runs it only on
skipped steps, and only when asked (`--config.trace_nonfinite=true`). A skipped step leaves the
params and the model state as they were, so re-running the batch against the state after the
skipped step reproduces the overflow (dropout masks aside).

Example::

  found = forward_nonfinite(model, {"params": params}, images, train=True,
                            rngs={"dropout": key})
  print(found.first)          # "Block_3/Dense_1", or None when the forward pass was finite
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Hashable, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jamp import nnx as jamp_nnx
from jamp.inspect._nnx_view import NnxView, is_nnx
from jamp.wrap import Wrapped

_CALL = "__call__"


@dataclasses.dataclass(frozen=True)
class ForwardNonfinite:
    """What one forward pass's captured module outputs said.

    Attributes:
      modules: paths of the modules whose outputs held a nan or inf, in the order their calls
        finished (the model itself is "" and comes last).
      output_finite: whether the model's own output was finite.
    """

    modules: tuple[str, ...]
    output_finite: bool

    @property
    def first(self) -> Optional[str]:
        """The module where the forward pass first went non-finite, or None if none did."""
        named = [m for m in self.modules if m]
        return named[0] if named else (self.modules[0] if self.modules else None)

    def describe(self) -> str:
        """One line for a log: where the forward pass overflowed, or that it did not."""
        if self.first is None:
            return "forward pass finite (the overflow is in the backward pass)"
        more = len([m for m in self.modules if m]) - 1
        also = f" (then {more} enclosing or later modules)" if more > 0 else ""
        return f"forward output first non-finite in {self.first or 'the model'}{also}"


def _split_kwargs(kwargs) -> tuple[dict, tuple]:
    """Array-valued keyword arguments (rngs) are traced; the rest (train=True) stay static."""
    dynamic, static = {}, []
    for key, value in kwargs.items():
        leaves = jax.tree.leaves(value)
        if leaves and all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves):
            dynamic[key] = value
        else:
            static.append((key, value))
    return dynamic, tuple(static)


def _call_order(module: nn.Module, variables, args, dynamic, static) -> list[str]:
    """Module paths in the order their calls finish, from an abstract (shape-only) run."""
    order: list[str] = []

    def record(next_fun, fn_args, fn_kwargs, context):
        out = next_fun(*fn_args, **fn_kwargs)
        if context.method_name == _CALL and context.module.scope is not None:
            order.append("/".join(str(p) for p in context.module.path))
        return out

    mutable = [c for c in variables if c != "params"] or False

    def run(variables, args, dynamic):
        with nn.intercept_methods(record):
            return module.apply(variables, *args, mutable=mutable, **dynamic, **dict(static))

    jax.eval_shape(run, variables, args, dynamic)
    return list(dict.fromkeys(order))  # a shared module finishes several times: its first


def output_flags(tree, prefix=()) -> dict[str, jax.Array]:
    """`{module path: finite}` from a captured "intermediates" tree (`capture_intermediates=True`):
    whether each module's output was finite; usable inside a jitted train step."""
    flags = {}
    for key, value in tree.items():
        if key == _CALL:
            leaves = [jnp.asarray(x) for x in jax.tree.leaves(value)]
            leaves = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
            if leaves:  # a module returning only integers (an argmax) cannot overflow
                flags["/".join(prefix)] = jnp.all(
                    jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])
                )
        elif isinstance(value, Mapping):  # a submodule; other sown values are not outputs
            flags.update(output_flags(value, prefix + (str(key),)))
    return flags


def forward_nonfinite(model, *args, **kwargs) -> ForwardNonfinite:
    """Runs the model once more on one batch, checking every module's output:
    `forward_nonfinite(model, variables, *args)` for a linen model, `forward_nonfinite(model,
    *args)` for an NNX one (it carries its variables).

    Args:
      model: a linen module or a `jamp.wrap`ped one (then the outputs checked are those the
        policy's dtypes produced); a `jamp.wrap`ped NNX model, as users hold it; or an object
        whose `apply(variables, *args, **kwargs)` runs a `jamp.wrap`ped NNX model (the training
        program's view of one). NNX submodules are checked through
        `jamp.nnx.capturing_outputs` and named by attribute path.
      *args: for linen (and an apply view), the variables (`{"params": ..., "batch_stats":
        ...}`; mutable collections are updated in the re-run and thrown away), then the call's
        arguments; for an NNX model, the call's arguments.
      **kwargs: the call's keyword arguments, e.g. `train=True, rngs={"dropout": key}`.

    Returns:
      A `ForwardNonfinite` naming the modules whose outputs were not finite, in call order.
    """
    held = model
    if is_nnx(model):  # its state is read now, and passed to the re-run as arguments
        view = _VIEWS.get(id(model))
        if view is None or view[0] is not model:
            _VIEWS.clear()
            view = _VIEWS[id(model)] = (model, NnxView(model))
        model = view[1]
        variables = NnxView(held).variables
    else:
        if not args:
            raise TypeError("forward_nonfinite(model, variables, *args): variables are missing")
        variables, args = args[0], args[1:]
    dynamic, static = _split_kwargs(kwargs)
    key: Hashable = (static, jax.tree.structure((variables, args, dynamic)))
    try:
        hash(key)
    except TypeError:  # an unhashable static argument: its text tells calls apart as well
        key = repr(key)
    cached = _COMPILED.get(key)
    if cached is None or cached[0] is not held:  # one compile per model and call signature
        if isinstance(model, nn.Module):
            inner = model.module if isinstance(model, Wrapped) else model
            order = _call_order(inner, variables, args, dynamic, static)
            check = jax.jit(functools.partial(_check, model, static))
        else:  # a wrapped NNX model behind an apply: the order is noted while tracing
            order = []
            check = jax.jit(functools.partial(_check_nnx, model, static, order))
        if len(_COMPILED) >= 8:  # a few signatures at a time; forget the oldest
            _COMPILED.pop(next(iter(_COMPILED)))
        cached = _COMPILED[key] = (held, order, check)
    _, order, check = cached
    out_finite, flags = jax.device_get(check(variables, args, dynamic))
    rank = {path: i for i, path in enumerate(order)}
    bad = sorted((p for p, ok in flags.items() if not np.all(ok)), key=lambda p: rank.get(p, -1))
    return ForwardNonfinite(modules=tuple(bad), output_finite=bool(out_finite))


_COMPILED: dict = {}
_VIEWS: dict = {}  # id -> (an NNX model, its NnxView): one graph per model, for the cache


def _check_nnx(model, static, order, variables, args, dynamic):
    with jamp_nnx.capturing_outputs() as maxima:
        out = model.apply(variables, *args, **dynamic, **dict(static))
    if not maxima:
        raise ValueError(
            f"forward_nonfinite: {type(model).__name__} is not a linen module, and its apply ran "
            "no jamp.wrap'ped NNX model (nothing to check)"
        )
    order[:] = list(maxima)  # the order outputs were recorded in: as calls finish
    return _all_finite(out), {path: jnp.isfinite(m) for path, m in maxima.items()}


def _all_finite(out):
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(out)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _check(model, static, variables, args, dynamic):
    mutable = [c for c in variables if c != "params"] + ["intermediates"]
    out, state = model.apply(
        variables, *args, capture_intermediates=True, mutable=mutable, **dynamic, **dict(static)
    )
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(out)]
    out_finite = jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)
    return out_finite, output_flags(state.get("intermediates", {}))
