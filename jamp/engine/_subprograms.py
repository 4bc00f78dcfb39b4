"""The sub-programs of higher-order equations (`jit`, `scan`, `cond`, `remat`, `shard_map`,
custom derivatives): evaluated in place where their results may stay 16-bit, re-traced with
their matmuls rewritten elsewhere, and refused where jamp does not know how they are used.

Each evaluation goes back to the interpreter through `Context.interpret`."""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core as jcore

from jamp import jax_compat
from jamp.engine import _values as V
from jamp.engine._context import Context


def changes(jaxpr: jcore.Jaxpr, compute_dtype, ctx: Context) -> bool:
    """Whether evaluating `jaxpr` under `compute_dtype` would run anything differently than traced."""
    for eqn in jaxpr.eqns:
        dtype = ctx.choose(eqn, compute_dtype)
        if dtype is not None and ctx.lower and dtype.itemsize < 4:
            return True  # activations may be carried in 16 bits from here on
        if eqn.primitive.name in V.MATMULS and V.needs_rewrite([v.aval for v in eqn.invars], dtype):
            return True
        if any(changes(sub, dtype, ctx.within(eqn)) for sub in V.sub_jaxprs(eqn)):
            return True
    return False


def _rewrite_closed(
    closed: jcore.ClosedJaxpr, compute_dtype, ctx: Context, weak=None
) -> jcore.ClosedJaxpr:
    """The sub-program with its matmuls rewritten and its signature (dtypes included) unchanged."""

    ctx = ctx.stateless()

    def run(*args):
        outs, _ = ctx.interpret(closed.jaxpr, closed.consts, args, compute_dtype, ctx, weak)
        return [V.cast(o, v.aval.dtype) for o, v in zip(outs, closed.jaxpr.outvars)]

    return jax.make_jaxpr(run)(*[V.spec(v.aval) for v in closed.jaxpr.invars])


def rewrite_param(value, compute_dtype, ctx: Context, weak=None):
    """Rewrite one equation parameter if it is (a tuple of) sub-programs containing matmuls.

    `weak` gives, per input of the sub-program, whether it is weak (None: none is).
    """
    if isinstance(value, jcore.ClosedJaxpr):
        if not V.has_matmul(value.jaxpr):
            return value
        return _rewrite_closed(value, compute_dtype, ctx, weak)
    if isinstance(value, jcore.Jaxpr):
        if not V.has_matmul(value):
            return value
        closed = _rewrite_closed(jcore.ClosedJaxpr(value, ()), compute_dtype, ctx, weak)
        # An open sub-program (e.g. remat's) has no slot for constants; keep the original if the
        # rewrite needed any, rather than changing the equation's signature.
        return value if closed.consts else closed.jaxpr
    if isinstance(value, tuple) and value and all(isinstance(v, jcore.ClosedJaxpr) for v in value):
        return tuple(rewrite_param(v, compute_dtype, ctx, weak) for v in value)
    return value


def shard_map(eqn, invals, compute_dtype, ctx: Context):
    """A `shard_map` with its body rewritten: the body's collectives need the mapping's axes, so it
    is mapped again rather than re-traced on its own."""
    jaxpr = jax_compat.param(eqn, "jaxpr")
    if not V.has_matmul(jaxpr):
        return V.bind(eqn, invals, eqn.params)
    ctx = ctx.within(eqn).stateless()

    def body(*xs):
        outs, _ = ctx.interpret(jaxpr, (), xs, compute_dtype, ctx, None)
        return tuple(V.cast(o, v.aval.dtype) for o, v in zip(outs, jaxpr.outvars))

    return list(jax_compat.shard_map_like(eqn, body)(*invals))


def check_rewritable(eqn, compute_dtype, ctx: Context) -> None:
    """An unknown higher-order primitive with matmuls to rewrite inside fails here, at trace time:
    rewriting its sub-programs without knowing how it uses them could silently mis-lower it."""
    name = eqn.primitive.name
    if name in V.REWRITTEN_INSIDE or jax_compat.is_kernel(eqn):
        return
    for sub in jcore.jaxprs_in_params(eqn.params):
        if V.has_matmul(sub) and changes(sub, compute_dtype, ctx):
            raise jax_compat.unsupported(
                name, "it is a higher-order primitive with matmuls inside that jamp does not know"
            )


def inline(eqn, invals, weak, compute_dtype, ctx: Context):
    """A `jit` evaluated in place (its 16-bit results stay 16-bit; fp8 sites inside it read the
    scaling state); returns its outputs and whether each is weak."""
    closed = jax_compat.param(eqn, "jaxpr")
    return ctx.interpret(closed.jaxpr, closed.consts, invals, compute_dtype, ctx.within(eqn), weak)


def custom_jvp(eqn, invals, weak, compute_dtype, ctx: Context):
    """A custom-JVP function (e.g. `jax.nn.relu`) on 16-bit operands, keeping its derivative rule.

    The primal runs in the activation dtypes; the rule, as traced, runs on operands cast back.
    """
    call = jax_compat.param(eqn, "call_jaxpr")
    traced = [v.aval.dtype for v in eqn.invars]
    ctx = ctx.stateless()

    def body(*xs):
        return ctx.interpret(call.jaxpr, call.consts, xs, compute_dtype, ctx, weak)[0]

    specs = [jax.ShapeDtypeStruct(np.shape(x), V.dtype_of(x)) for x in invals]
    out_dtypes = [o.dtype for o in jax.eval_shape(body, *specs)]

    def down(values):
        return [V.cast(x, d) for x, d in zip(values, out_dtypes)]

    def rule(primals, tangents):
        up = V.as_traced(eqn, primals)
        up_t = [V.cast(t, d) if V.is_float_dtype(t.dtype) else t for t, d in zip(tangents, traced)]
        outs, out_t = jax.jvp(lambda *a: V.bind(eqn, a, eqn.params), up, up_t)
        return down(outs), down(out_t)

    fn = jax.custom_jvp(body)
    fn.defjvp(rule)
    return fn(*invals)


def remat(eqn, invals, weak, compute_dtype, ctx: Context):
    """A `remat` re-applied to its rewritten body: a closure, so fp8 sites inside it can read
    the scaling state (a re-traced sub-program could not carry it)."""
    jaxpr = jax_compat.param(eqn, "jaxpr")

    def body(*xs):
        return ctx.interpret(jaxpr, (), xs, compute_dtype, ctx.within(eqn), weak)[0]

    prevent_cse, policy = (jax_compat.param(eqn, k) for k in ("prevent_cse", "policy"))
    return list(jax.checkpoint(body, prevent_cse=prevent_cse, policy=policy)(*invals))
