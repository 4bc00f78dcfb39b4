"""Grouped GEMMs (`jax.lax.ragged_dot`, a mixture of experts' matmuls) in a compute dtype,
forward *and* backward, as `jamp.mixed_ops` does for `dot_general`.

`lax.ragged_dot(x, w, group_sizes)` multiplies consecutive row groups of `x` ([tokens, d], sorted
by expert) each by its own matrix of `w` ([experts, d, f]): the primitive is
`ragged_dot_general`, whose rows are ragged along a non-contracting axis of the left operand.
Its backward is two more grouped GEMMs: the left operand's gradient the same form, the
experts' gradient one whose ragged axis is contracted (one matrix per expert).

`mixed_ragged_dot` casts both operands to the compute dtype, accumulates in float32, and runs
both backward GEMMs on 16-bit operands too (the cotangent cast to the compute dtype), handing
back gradients in each operand's own dtype: float32 for float32 experts, summed in float32.
Where the lowering is "upcast" (a CPU without 16-bit matmuls, `jamp.hardware`), the 16-bit
operands are widened to float32 first: the same products, exactly.

Only the form JAX itself can differentiate is rewritten (ragged along a non-contracting axis, no
`group_offset`); `covers(eqn)` says which. fp8 policies run grouped GEMMs in bfloat16.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax

from jamp import hardware, jax_compat, mixed_ops

__all__ = ["covers", "mixed_ragged_dot"]

_ACC = np.dtype(np.float32)


def _kept(ndim: int, *used) -> list[int]:
    taken = {int(d) for axes in used for d in axes}
    return [d for d in range(ndim) if d not in taken]


def _key(dims) -> tuple:
    """`RaggedDotDimensionNumbers` as nested tuples of ints (hashable: a static argument):
    (lhs contracting, rhs contracting, lhs batch, rhs batch, lhs ragged, rhs group)."""
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    axes = (lc, rc, lb, rb, dims.lhs_ragged_dimensions, dims.rhs_group_dimensions)
    return tuple(tuple(int(d) for d in a) for a in axes)


def _dims(lc, rc, lb, rb, ragged, group) -> lax.RaggedDotDimensionNumbers:
    return lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=((list(lc), list(rc)), (list(lb), list(rb))),
        lhs_ragged_dimensions=list(ragged),
        rhs_group_dimensions=list(group),
    )


def covers(eqn) -> bool:
    """Whether `mixed_ragged_dot` runs this `ragged_dot_general` equation: ragged along a
    non-contracting axis of the left operand (a mixture of experts' forward), one group axis,
    no `group_offset`."""
    lc, _, lb, _, ragged, group = _key(jax_compat.param(eqn, "ragged_dot_dimension_numbers"))
    return (
        eqn.params.get("group_offset") is None
        and len(ragged) == 1
        and len(group) == 1
        and ragged[0] not in lc + lb
    )


def _gemm(lhs, rhs, group_sizes, dims, out_dtype, lowering):
    if lowering == "upcast":  # products of 16-bit values are exact in float32
        lhs, rhs = lhs.astype(_ACC), rhs.astype(_ACC)
    out = lax.ragged_dot_general(lhs, rhs, group_sizes, dims, preferred_element_type=_ACC)
    return out.astype(out_dtype)


def _backward_dims(key: tuple, lhs_ndim: int, rhs_ndim: int):
    """The two grouped GEMMs of the backward: ((dims, perm) of d lhs, (dims, perm) of d rhs),
    each `transpose(ragged_dot_general(...), perm)` in its operand's axis order."""
    lc, rc, lb, rb, (ragged,), group = (list(a) for a in key)
    l_kept, r_kept = _kept(lhs_ndim, lc, lb), _kept(rhs_ndim, rc, rb, group)
    nb = len(lb)
    g_batch = list(range(nb))
    g_l = list(range(nb, nb + len(l_kept)))  # the cotangent's axes: batch, lhs kept, rhs kept
    g_r = list(range(nb + len(l_kept), nb + len(l_kept) + len(r_kept)))
    # d lhs: the cotangent against the experts, ragged where the lhs was: the forward's form.
    d_lhs = _dims(g_r, r_kept, g_batch, rb, [nb + l_kept.index(ragged)], group)
    l_src = lb + l_kept + [lc[rc.index(r)] for r in sorted(rc)]
    # d rhs: lhs against the cotangent, the ragged axis contracted: one matrix per group, first.
    d_rhs = _dims(l_kept, g_l, lb, g_batch, [ragged], [])
    r_src = group + rb + [rc[lc.index(a)] for a in sorted(lc)] + r_kept
    return (d_lhs, tuple(np.argsort(l_src))), (d_rhs, tuple(np.argsort(r_src)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ragged(lhs, rhs, group_sizes, key, compute_dtype, out_dtype, lowering):
    return _ragged_fwd(lhs, rhs, group_sizes, key, compute_dtype, out_dtype, lowering)[0]


def _ragged_fwd(lhs, rhs, group_sizes, key, compute_dtype, out_dtype, lowering):
    lhs_c, rhs_c = lhs.astype(compute_dtype), rhs.astype(compute_dtype)
    out = _gemm(lhs_c, rhs_c, group_sizes, _dims(*key), out_dtype, lowering)
    like = (jax.numpy.zeros((0,), lhs.dtype), jax.numpy.zeros((0,), rhs.dtype))
    return out, (lhs_c, rhs_c, group_sizes, like)


def _ragged_bwd(key, compute_dtype, out_dtype, lowering, residuals, g):
    del out_dtype
    lhs_c, rhs_c, group_sizes, (lhs_like, rhs_like) = residuals
    (l_dims, l_perm), (r_dims, r_perm) = _backward_dims(key, lhs_c.ndim, rhs_c.ndim)
    g_c = g.astype(compute_dtype)
    # A gradient that goes to a 16-bit operand is rounded to it anyway; else float32.
    l_out = lhs_like.dtype if mixed_ops._is_16bit(lhs_like.dtype) else _ACC
    r_out = rhs_like.dtype if mixed_ops._is_16bit(rhs_like.dtype) else _ACC
    d_lhs = lax.transpose(_gemm(g_c, rhs_c, group_sizes, l_dims, l_out, lowering), l_perm)
    d_rhs = lax.transpose(_gemm(lhs_c, g_c, group_sizes, r_dims, r_out, lowering), r_perm)
    return d_lhs.astype(lhs_like.dtype), d_rhs.astype(rhs_like.dtype), None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def mixed_ragged_dot(lhs, rhs, group_sizes, dims, compute_dtype, out_dtype):
    """`lax.ragged_dot_general(lhs, rhs, group_sizes, dims)` on operands cast to
    `compute_dtype`, accumulated in float32, returned in `out_dtype`; its gradients (two grouped
    GEMMs on 16-bit operands) come back in `lhs.dtype` and `rhs.dtype`. `dims` must be a form
    `covers` accepts."""
    compute_dtype = np.dtype(compute_dtype)
    lowering = hardware.matmul_lowering(compute_dtype)
    key = _key(dims)
    return _ragged(lhs, rhs, group_sizes, key, compute_dtype, np.dtype(out_dtype), lowering)
