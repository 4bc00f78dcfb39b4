"""The dtype rules: one equation evaluated under its compute dtype, its matmuls in their mixed
form and, where activations are carried in 16 bits (`jamp.activations`), each other operation
in the dtype it may run in; returns its results and whether each is weak (made of the
variables alone, which take the dtype of what they meet instead of promoting it)."""

from __future__ import annotations

import numpy as np
from jax.extend import core as jcore

from jamp import activations as act
from jamp import fp8, jax_compat, overrides
from jamp.engine import _broadcast, _matmuls, _subprograms
from jamp.engine import _values as V
from jamp.engine._context import Context


def as_traced(eqn, invals, compute_dtype, ctx: Context, weak=None, placed=None):
    """The equation with its matmuls rewritten and everything else as traced."""
    # The mixed matmuls cast their operands themselves: a 16-bit activation goes in as it is, and
    # its gradient comes back 16-bit.
    if eqn.primitive.name not in V.MATMULS or not V.needs_rewrite(invals, compute_dtype):
        invals = V.as_traced(eqn, invals)
    outs = _matmuls.mixed(eqn, invals, compute_dtype, ctx, weak, placed)
    if outs is not None:
        return outs
    invals = V.as_traced(eqn, invals)  # (a no-op but for a grouped GEMM jamp does not rewrite)
    _matmuls.warn_uncovered(eqn, invals, compute_dtype)
    if jax_compat.is_kernel(eqn):  # a kernel runs as written, on its traced operand dtypes
        return V.bind(eqn, invals, eqn.params)
    if eqn.primitive.name == "shard_map":
        return _subprograms.shard_map(eqn, invals, compute_dtype, ctx)
    _subprograms.check_rewritable(eqn, compute_dtype, ctx)
    tracks_weak = ctx.lower or fp8.is_fp8(compute_dtype)  # fp8 tells weights by weakness
    body_weak = V.body_weak(eqn, list(weak)) if tracks_weak and weak is not None else {}
    inner = ctx.within(eqn)  # the sub-programs' name stacks continue this equation's
    params = {
        k: _subprograms.rewrite_param(v, compute_dtype, inner, body_weak.get(k))
        for k, v in eqn.params.items()
    }
    return V.bind(eqn, invals, params)


def _polymorphic(eqn, invals, weak):
    """A shape or elementwise operation, in the dtype `jamp.activations.run_dtype` picks."""
    traced = [v.aval.dtype for v in eqn.invars]
    target = act.run_dtype(traced, [V.dtype_of(x) for x in invals], weak)
    cast = []
    for x, t, w in zip(invals, traced, weak):
        if target is None or not act.is_lowerable(t):
            cast.append(V.cast(x, t))
        elif w and V.dtype_of(x) != target:
            cast.append(V.saturate(x, target))
        else:
            cast.append(V.cast(x, target))
    name, shape = eqn.primitive.name, eqn.outvars[0].aval.shape
    if name == "broadcast_in_dim" and eqn.params.get("sharding") is None:
        dims = jax_compat.param(eqn, "broadcast_dimensions")
        return [_broadcast.summed_in_f32(cast[0], shape, dims)]
    return V.bind(eqn, _broadcast.operands(name, cast, shape), eqn.params)


def _inlined(eqn, invals, weak) -> bool:
    """Whether a `jit` is evaluated in place, so that its 16-bit results stay 16-bit: one with
    16-bit operands, or one that combines variables with data (`jnp.take` of an embedding table
    by token ids: a weak float array that is a value, not a literal, beside a strong one)."""
    if any(V.dtype_of(x) != v.aval.dtype for x, v in zip(invals, eqn.invars)):
        return True
    reads_variables = any(
        w and isinstance(v, jcore.Var) and v.aval.ndim and V.is_float_dtype(v.aval.dtype)  # type: ignore[attr-defined]  # a ShapedArray
        for w, v in zip(weak, eqn.invars)
    )
    return reads_variables and not all(weak)


def _convert(eqn, invals, weak):
    """A `convert_element_type`: a conversion that would undo a 16-bit carrier is left out."""
    (x,), (v,) = invals, eqn.invars
    new_dtype = jax_compat.param(eqn, "new_dtype")
    if V.dtype_of(x) != v.aval.dtype and new_dtype == v.aval.dtype:
        return [x], list(weak)  # a no-op conversion of a lowered value (e.g. weak-type only)
    if (
        str(eqn.source_info.name_stack).endswith(overrides.OUTPUT_SCOPE)
        and act.is_lowerable(new_dtype)
        and np.dtype(V.dtype_of(x)).itemsize == 2
    ):
        # An override's 16-bit output widened to its policy's output dtype: carried as it
        # is, as the activation would be without the override (see overrides.OUTPUT_SCOPE).
        return [x], list(weak)
    return V.bind(eqn, [x], eqn.params), list(weak)


def _lowered(eqn, invals, weak, compute_dtype, ctx: Context, placed=None):
    """One equation where activations may be 16-bit; returns (outputs, whether each is weak)."""
    name, n_out = eqn.primitive.name, len(eqn.outvars)
    all_weak = all(weak)  # e.g. a gather of a weak table by data indices is data: strong
    made_of_weights = [all_weak and fp8.is_fp8(compute_dtype)] * n_out  # see `evaluate`
    op = "square" if name == "mul" and eqn.invars[0] is eqn.invars[1] else name  # x * x (norms)
    if act.runs_in_fp32(op, compute_dtype):
        outs = as_traced(eqn, invals, compute_dtype, ctx)
        if act.is_range_guard(op, compute_dtype):
            # A float16 square or power, computed in float32 where it cannot overflow, is weak:
            # a float32 reduction of it stays float32 (a norm's variance), and where it meets a
            # float16 activation (gelu's x + 0.044715 x^3) it is saturated into float16, so that
            # the rest of the expression, and what its backward keeps, is float16 again.
            return outs, [True] * n_out
        return outs, made_of_weights
    if name in ("jit", "pjit") and _inlined(eqn, invals, weak):
        return _subprograms.inline(eqn, invals, weak, compute_dtype, ctx)
    if (
        name == "gather"
        and weak[0]
        and not all_weak
        and act.is_lowerable(eqn.outvars[0].aval.dtype)
    ):
        # An embedding: rows of a float32 table looked up by data. Its result is data, carried in
        # the compute dtype as a 16-bit model's embedding (Flax `dtype=`, Keras) returns it; the
        # lookup itself stays float32, so its gradient is summed into the table in float32.
        outs = as_traced(eqn, invals, compute_dtype, ctx)
        return [V.cast(o, fp8.carrier(compute_dtype)) for o in outs], [False] * n_out
    if name in act.POLYMORPHIC_PRIMITIVES:
        return _polymorphic(eqn, invals, weak), [all_weak] * n_out
    if name == "convert_element_type":
        return _convert(eqn, invals, weak)
    lowered = any(V.dtype_of(x) != v.aval.dtype for x, v in zip(invals, eqn.invars))
    if lowered and name == "custom_jvp_call":
        return _subprograms.custom_jvp(eqn, invals, weak, compute_dtype, ctx), [False] * n_out
    if name == "remat2":  # re-applied, so that its 16-bit results stay 16-bit
        return _subprograms.remat(eqn, invals, weak, compute_dtype, ctx), [False] * n_out
    # Anything else (sub-programs, matmuls, unknown operations): as traced.
    return as_traced(eqn, invals, compute_dtype, ctx, weak, placed), made_of_weights


def evaluate(eqn, invals, weak, compute_dtype, ctx: Context, placed=None):
    """`eqn` on `invals` (whose weakness is `weak`) under `compute_dtype`, its operands placed
    as `placed` says (None: nowhere); returns its outputs and whether each is weak."""
    if ctx.lower and compute_dtype is not None and compute_dtype.itemsize < 4:
        return _lowered(eqn, invals, weak, compute_dtype, ctx, placed)
    if fp8.is_fp8(compute_dtype):
        # Evaluated in place (a closure), so that fp8 sites inside can read the scaling state.
        if eqn.primitive.name == "remat2":
            outs = _subprograms.remat(eqn, invals, weak, compute_dtype, ctx)
            return outs, [False] * len(outs)
        if eqn.primitive.name in ("jit", "pjit"):
            return _subprograms.inline(eqn, invals, weak, compute_dtype, ctx)
    outs = as_traced(eqn, invals, compute_dtype, ctx, weak, placed)
    # fp8 tells a layer's matmul by its weight: a value made of the variables alone (a cast
    # kernel, W + A @ B, a weight-normalized kernel) is one.
    poly = eqn.primitive.name in act.POLYMORPHIC_PRIMITIVES or fp8.is_fp8(compute_dtype)
    return outs, [poly and all(weak)] * len(outs)
