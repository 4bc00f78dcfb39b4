"""Op-level autocast for JAX functions: rewrite a traced program so its matmuls use a compute dtype.

`autocast(fn, compute_dtype)` traces `fn` to a jaxpr and evaluates it again, replacing every
`dot_general` and `conv_general_dilated` whose floating operands are not already in the compute
dtype by its mixed-precision form (`jamp.mixed_ops`). Every other operation runs exactly as traced,
so reductions, softmax, normalization and the loss keep their float32 numerics, and the function's
inputs, outputs and intermediate dtypes are unchanged.

Working on the traced program rather than on module attributes is what lets a policy reach matmuls
that no `dtype=` argument controls: layers that hard-code `dtype=jnp.float32`, raw `x @ param`
products, shared submodules, and matmuls inside `jit`, `scan`, `cond`, `remat` or custom-derivative
functions.

Where an equation runs is decided by `compute_for(eqn, inherited)`, which returns the compute dtype
for that equation (or None to leave it as traced); `inherited` is the dtype chosen for the enclosing
equation when the interpreter descends into a sub-program. `jamp.wrap` uses the name stack that
Flax module calls leave on each equation to give submodules policies of their own.

Example::

  loss = autocast(lambda w, x: jnp.tanh(x @ w).sum(), jnp.bfloat16)(w, x)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jamp import mixed_ops

ComputeFor = Callable[[jcore.JaxprEqn, Optional[np.dtype]], Optional[np.dtype]]

_DOT = lax.dot_general_p
_CONV = lax.conv_general_dilated_p


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _needs_rewrite(invals, compute_dtype) -> bool:
    lhs, rhs = invals
    if compute_dtype is None or not (_is_float(lhs) and _is_float(rhs)):
        return False
    if lhs.dtype != compute_dtype or rhs.dtype != compute_dtype:
        return True
    # Already in the compute dtype: a 16-bit product still gains from fp32 accumulation (and on
    # CPU from the fast bf16 kernels); a float32 one is left bit-identical.
    return compute_dtype.itemsize < 4


def _has_matmul(jaxpr: jcore.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive in (_DOT, _CONV):
            return True
        if any(_has_matmul(sub) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def _spec(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _rewrite_closed(closed: jcore.ClosedJaxpr, compute_dtype, compute_for) -> jcore.ClosedJaxpr:
    def run(*args):
        return eval_jaxpr(closed.jaxpr, closed.consts, args, compute_dtype, compute_for)

    return jax.make_jaxpr(run)(*[_spec(v.aval) for v in closed.jaxpr.invars])


def _rewrite_param(value, compute_dtype, compute_for):
    """Rewrite one equation parameter if it is (a tuple of) sub-programs containing matmuls."""
    if isinstance(value, jcore.ClosedJaxpr):
        if not _has_matmul(value.jaxpr):
            return value
        return _rewrite_closed(value, compute_dtype, compute_for)
    if isinstance(value, jcore.Jaxpr):
        if not _has_matmul(value):
            return value
        closed = _rewrite_closed(jcore.ClosedJaxpr(value, ()), compute_dtype, compute_for)
        # An open sub-program (e.g. remat's) has no slot for constants; keep the original if the
        # rewrite needed any, rather than changing the equation's signature.
        return value if closed.consts else closed.jaxpr
    if isinstance(value, tuple) and value and all(isinstance(v, jcore.ClosedJaxpr) for v in value):
        return tuple(_rewrite_param(v, compute_dtype, compute_for) for v in value)
    return value


def _eval_eqn(eqn, invals, compute_dtype, compute_for):
    if eqn.primitive is _DOT and _needs_rewrite(invals, compute_dtype):
        out_dtype = eqn.outvars[0].aval.dtype
        return [
            mixed_ops.mixed_dot_general(
                *invals, eqn.params["dimension_numbers"], compute_dtype, out_dtype
            )
        ]
    if eqn.primitive is _CONV and _needs_rewrite(invals, compute_dtype):
        out_dtype = eqn.outvars[0].aval.dtype
        return [mixed_ops.mixed_conv(*invals, eqn.params, compute_dtype, out_dtype)]
    params = {k: _rewrite_param(v, compute_dtype, compute_for) for k, v in eqn.params.items()}
    # `eqn.ctx` carries per-equation settings recorded at trace time (e.g. compute placement).
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    return out if eqn.primitive.multiple_results else [out]


def eval_jaxpr(jaxpr: jcore.Jaxpr, consts, args, compute_dtype, compute_for: ComputeFor):
    """Evaluate `jaxpr` on `args`, with matmuls in the dtype that `compute_for` picks per equation.

    Args:
      jaxpr: the program to evaluate.
      consts: values of its constvars.
      args: values of its invars (arrays or tracers).
      compute_dtype: the dtype in force where no equation says otherwise (None: as traced).
      compute_for: `(eqn, inherited_dtype) -> dtype or None`.

    Returns:
      The list of output values.
    """
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        eqn_dtype = compute_for(eqn, compute_dtype)
        # Keep the module path of each operation, for profiles and for anyone reading the program.
        with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
            outs = _eval_eqn(eqn, [read(v) for v in eqn.invars], eqn_dtype, compute_for)
        for var, val in zip(eqn.outvars, outs):
            if not isinstance(var, jcore.DropVar):
                env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _inherit(eqn, inherited):
    del eqn
    return inherited


def _is_traceable(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def autocast(fn: Callable, compute_dtype, compute_for: ComputeFor = _inherit) -> Callable:
    """Return `fn` with its matmuls and convolutions run in `compute_dtype`.

    Array arguments (and array leaves of pytree arguments) are traced; every other leaf (Python
    numbers, strings, flags) is passed through unchanged, as a static value.

    Args:
      fn: any JAX-traceable function returning a pytree of arrays.
      compute_dtype: dtype of matmul and convolution operands (None leaves them as traced).
      compute_for: optional per-equation choice of compute dtype (see the module docstring).

    Returns:
      A function with `fn`'s signature and output dtypes.
    """
    compute_dtype = None if compute_dtype is None else np.dtype(compute_dtype)

    def wrapped(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        traced = [_is_traceable(leaf) for leaf in leaves]

        def flat_fn(*arrays):
            it = iter(arrays)
            full = [next(it) if t else leaf for leaf, t in zip(leaves, traced)]
            a, kw = jax.tree.unflatten(treedef, full)
            return fn(*a, **kw)

        arrays = [leaf for leaf, t in zip(leaves, traced) if t]
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
        outs = eval_jaxpr(closed.jaxpr, closed.consts, arrays, compute_dtype, compute_for)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped
