"""The matmul rules: a contraction whose operands are not in its compute dtype runs in its mixed
form (`jamp.mixed_ops`, `jamp.grouped`, `jamp.fp8`), reading 16-bit operands and accumulating
in float32; the contractions the engine does not cover are named once."""

from __future__ import annotations

from typing import Optional

from jamp import activations as act
from jamp import fp8, grouped, jax_compat, mixed_ops
from jamp.engine import _guard
from jamp.engine import _values as V
from jamp.engine._context import Context


def out_dtype(eqn, compute_dtype, ctx: Context):
    """A rewritten matmul's result dtype: as traced, or the 16-bit carrier where activations
    are carried in 16 bits."""
    traced = eqn.outvars[0].aval.dtype
    lowered = ctx.lower and compute_dtype.itemsize < 4 and act.is_lowerable(traced)
    return fp8.carrier(compute_dtype) if lowered else traced


_WARNED: set[str] = set()  # the uncovered contractions warned of, once each per process


def warn_uncovered(eqn, invals, compute_dtype) -> None:
    """A float32 contraction the engine leaves as traced, under a 16-bit policy: said once."""
    name = eqn.primitive.name
    if name not in V.UNCOVERED_CONTRACTIONS or name in _WARNED:
        return
    if compute_dtype is None or compute_dtype.itemsize >= 4:
        return
    if any(V.is_float_dtype(V.dtype_of(x)) and V.dtype_of(x).itemsize >= 4 for x in invals):
        _WARNED.add(name)
        _guard.uncovered(name)


def _fp8_dot(eqn, invals, compute_dtype, ctx: Context, placed):
    site = None
    if ctx.stateful:
        site = fp8.site_name(ctx.stack(eqn), fp8.site_counts(ctx.sites), ctx.calls)
    dims = jax_compat.param(eqn, "dimension_numbers")
    lhs, rhs = invals
    return [
        fp8.dot_general(
            lhs,
            rhs,
            dims,
            out_dtype(eqn, compute_dtype, ctx),
            site,
            V.placed_for(placed, compute_dtype),
            keep_lhs=ctx.saved.holds(lhs),
        )
    ]


def mixed(eqn, invals, compute_dtype, ctx: Context, weak, placed) -> Optional[list]:
    """The results of `eqn` run as a mixed matmul, or None where it is not one to rewrite.

    `weak` gives, per operand, whether it is made of the variables alone (None: unknown)."""
    if (
        eqn.primitive is V.DOT
        and fp8.is_fp8(compute_dtype)
        and V.needs_rewrite(invals, compute_dtype)
    ):
        # A layer's matmul (activation x weight: one operand made of the weak arguments, the
        # variables, alone) is fp8; one of two activations (attention's scores and mix) stays
        # bfloat16, as in Transformer Engine, and so does a weight x weight product (LoRA's A @ B).
        if weak is not None and sum(map(bool, weak)) == 1:
            return _fp8_dot(eqn, invals, compute_dtype, ctx, placed)
        compute_dtype = fp8.CARRIER
    if not (eqn.primitive.name in V.MATMULS and V.needs_rewrite(invals, compute_dtype)):
        return None
    result = out_dtype(eqn, compute_dtype, ctx)
    if eqn.primitive is V.DOT:
        dims = jax_compat.param(eqn, "dimension_numbers")
        where = V.placed_for(placed, compute_dtype)
        lhs, rhs = invals
        return [mixed_ops.mixed_dot_general(lhs, rhs, dims, compute_dtype, result, where)]
    if eqn.primitive is V.CONV:
        where = V.placed_for(placed, compute_dtype)
        conv_dtype = fp8.carrier(compute_dtype)  # fp8 is for matmuls only
        lhs, rhs = invals
        return [mixed_ops.mixed_conv(lhs, rhs, eqn.params, conv_dtype, result, where)]
    if grouped.covers(eqn):  # grouped GEMMs run in bfloat16 under fp8 (`jamp.grouped`)
        dims = jax_compat.param(eqn, "ragged_dot_dimension_numbers")
        lhs, rhs, sizes = invals
        gemm_dtype = fp8.carrier(compute_dtype)
        return [grouped.mixed_ragged_dot(lhs, rhs, sizes, dims, gemm_dtype, result)]
    return None  # (a grouped GEMM in a form jamp does not rewrite)
