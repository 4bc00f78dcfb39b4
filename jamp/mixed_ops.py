"""Matmuls and convolutions whose operands are cast to a compute dtype, forward *and* backward.

These are the two primitives that a precision policy actually changes. Each takes operands of any
floating dtype, casts them to ``compute_dtype``, accumulates in float32 and returns ``out_dtype``.
Their custom VJPs cast the incoming cotangent to ``compute_dtype`` too, so that the backward
matmuls also run on 16-bit operands: JAX's default transpose rules would otherwise pair a float32
cotangent with a 16-bit operand, which XLA then computes entirely in float32. Gradients come back in
each operand's own dtype (float32 for float32 master weights).

Example::

  y = mixed_dot_general(x, w, (((1,), (0,)), ((), ())), jnp.bfloat16, jnp.float32)

How a mixed matmul is lowered depends on the hardware (`jamp.hardware.matmul_lowering`):
"native" hands XLA the 16-bit operands (on CPUs in the layout of XLA:CPU's bf16 kernels);
"upcast", chosen on CPUs that lack native 16-bit matmuls, widens the 16-bit operands to float32
(in the same layout) and runs a float32 dot. Both compute the same thing: products of 16-bit
values are exact in float32, so either is 16-bit x 16-bit with float32 accumulation, equal up to
summation order.
The environment variable ``JAMP_MATMUL_LOWERING`` (auto / native / upcast; the test suite pins
"native") or `jamp.hardware.pinned_lowering` overrides the choice; it is read when a function is
traced, so a function jitted before the change keeps its form.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp import conv_patches, copies, hardware, jax_compat

# Accumulate in float32: 16-bit accumulation loses the small terms of long sums.
_ACC = np.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where a sharded operand (a parameter split over a mesh) lives, and the dtype that its
    gradient crosses the wire in.

    The operand is cast to the compute dtype on its own shard, so that whatever gathers it moves
    16-bit values (XLA's partitioner, left alone, gathers the float32 parameter and casts after);
    with `gathered` (its sharding with the FSDP axis dropped) the 16-bit copy is gathered there
    once, and that copy serves the backward pass too (left to XLA it is gathered again). Its
    gradient leaves the matmul in `reduce_dtype` (the GEMM still accumulates in float32), which
    is the dtype XLA sums it across devices in, and is constrained back to `sharding`, so that
    the sum lands in the parameter's own shards.
    """

    sharding: jax.sharding.Sharding
    reduce_dtype: np.dtype = _ACC
    gathered: Optional[jax.sharding.Sharding] = None


def _to_compute(x, dtype, placed: Optional[Placed], ready=None):
    x = x.astype(dtype) if ready is None else ready
    if placed is None:
        return x
    x = lax.with_sharding_constraint(x, placed.sharding)
    if placed.gathered is not None:
        x = lax.with_sharding_constraint(x, placed.gathered)
    return x


def _grad_acc(placed: Optional[Placed]) -> np.dtype:
    return _ACC if placed is None else np.dtype(placed.reduce_dtype)


def _to_operand(d, like_dtype, placed: Optional[Placed]):
    if placed is not None:
        d = lax.with_sharding_constraint(d, placed.sharding)
    return d.astype(like_dtype)


_UNPLACED = (None, None)


def _free_dims(ndim, *used):
    taken = set().union(*map(set, used))
    return [d for d in range(ndim) if d not in taken]


def _size(x, axes) -> int:
    return int(np.prod([x.shape[d] for d in axes], dtype=np.int64))


def _canonical_matmul(lhs, rhs, dims, acc=_ACC, widen=False):
    """The same product as a [batch, M, K] x [batch, K, N] matmul behind an optimization barrier.

    XLA:CPU runs bf16 x bf16 -> fp32 only in its fast matmul kernels, which take this layout; its
    generic dot rejects that type combination at run time. Left alone, XLA folds neighbouring
    transposes into the dot's dimension numbers and may hand it to the generic dot, so the operands
    are materialised in the canonical layout and the barrier keeps them there.

    With `widen` (the "upcast" lowering) the 16-bit operands are laid out the same way and then
    widened to float32 for a float32 dot: the fast kernels take that layout in float32 too, and
    every dot of a Transformer step reaches them (left to XLA, its attention dots do not).
    """
    (lc, rc), (lb, rb) = dims
    l_free = _free_dims(lhs.ndim, lc, lb)
    r_free = _free_dims(rhs.ndim, rc, rb)
    batch = [lhs.shape[d] for d in lb]
    m, k, n, b = _size(lhs, l_free), _size(lhs, lc), _size(rhs, r_free), _size(lhs, lb)
    lhs3 = lax.transpose(lhs, tuple(lb) + tuple(l_free) + tuple(lc)).reshape(b, m, k)
    rhs3 = lax.transpose(rhs, tuple(rb) + tuple(rc) + tuple(r_free)).reshape(b, k, n)
    lhs3, rhs3 = lax.optimization_barrier((lhs3, rhs3))
    if not lb:
        lhs3, rhs3, mm = lhs3[0], rhs3[0], (((1,), (0,)), ((), ()))
    else:
        mm = (((2,), (1,)), ((0,), (0,)))
    out = _dot_in(lhs3, rhs3, mm, acc, widen)
    out = lax.optimization_barrier(out)
    return out.reshape(
        tuple(batch) + tuple(lhs.shape[d] for d in l_free) + tuple(rhs.shape[d] for d in r_free)
    )


def _dot_in(lhs, rhs, dims, acc, widen):
    if widen:
        # Exact: a float32 product of two 16-bit values has no rounding error, and the sum is
        # float32's, as in a native 16-bit GEMM; a 16-bit `acc` is one rounding of that sum.
        return lax.dot_general(lhs.astype(_ACC), rhs.astype(_ACC), dims).astype(acc)
    return lax.dot_general(lhs, rhs, dims, preferred_element_type=acc)


def _matmul(lhs, rhs, dims, out_dtype, acc=_ACC, lowering="native"):
    """`acc` is the dot's result dtype: float32, or a 16-bit reduce dtype for a weight gradient
    (the GEMM accumulates in float32 and rounds once, so its partial sums cross devices 16-bit).
    `lowering` is "native" (16-bit operands into the dot) or "upcast" (widened to float32)."""
    widen = lowering == "upcast"
    if hardware.target_platform() == "cpu":
        return _canonical_matmul(lhs, rhs, dims, acc, widen).astype(out_dtype)
    if not widen and acc == _ACC and _is_16bit(out_dtype) and lhs.dtype == rhs.dtype == out_dtype:
        # A 16-bit result straight from the GEMM: XLA:GPU's 16-bit GEMMs (cuBLAS, Triton) sum in
        # float32 and round once as they write, the value of a float32 result converted, without
        # writing the float32 result out for another kernel to convert (XLA fuses no convert
        # into a GEMM whose result several kernels read, as a merged q/k/v projection's is).
        # (lax.DotAlgorithmPreset.BF16_BF16_F32 would say so in the program, but XLA's cuBLAS
        # rewrite then drops the GEMM's op name, which the reports attribute kernels by.)
        return lax.dot_general(lhs, rhs, dims, preferred_element_type=np.dtype(out_dtype))
    return _dot_in(lhs, rhs, dims, acc, widen).astype(out_dtype)


def product(lhs, rhs, dimension_numbers, out_dtype):
    """`lax.dot_general(lhs, rhs)` of same-dtype operands, summed in float32 and written in
    `out_dtype`, in the form this platform runs fastest (as a wrapped model's matmuls are); no
    custom derivative: for code that writes its own backward (`jamp.losses`)."""
    lowering = hardware.matmul_lowering(np.dtype(lhs.dtype))
    return _matmul(lhs, rhs, dimension_numbers, np.dtype(out_dtype), _ACC, lowering)


def _is_16bit(dtype) -> bool:
    return np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _inverse_permutation(src):
    # `src[i]` is the operand axis that result axis i holds; return the transpose to operand order.
    return tuple(src.index(axis) for axis in range(len(src)))


# The lowering is a static argument so that traces made under different lowerings never share
# a cache entry.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _dot(lhs, rhs, ready, dimension_numbers, compute_dtype, out_dtype, placed, lowering):
    out, _ = _dot_fwd(
        lhs, rhs, ready, dimension_numbers, compute_dtype, out_dtype, placed, lowering
    )
    return out


def _dot_fwd(lhs, rhs, ready, dimension_numbers, compute_dtype, out_dtype, placed, lowering):
    lhs_c = _to_compute(lhs, compute_dtype, placed[0], ready[0])
    rhs_c = _to_compute(rhs, compute_dtype, placed[1], ready[1])
    out = _matmul(lhs_c, rhs_c, dimension_numbers, out_dtype, lowering=lowering)
    # Keep the 16-bit copies, not the fp32 originals: half the residual memory. The zero-size
    # arrays only carry the operands' dtypes to the backward pass.
    return out, (lhs_c, rhs_c, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype), ready)


def backward_dims(dimension_numbers, lhs_ndim: int, rhs_ndim: int, g_ndim: int):
    """How the two backward products of a `dot_general` run on its cotangent `g`.

    Returns `((dims, perm) for d lhs, (dims, perm) for d rhs)`: d lhs is
    `transpose(dot_general(g, rhs, dims), perm)`, d rhs is `transpose(dot_general(lhs, g, dims),
    perm)`, each in its operand's axis order.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = map(list, (lc, rc, lb, rb))
    nb = len(lb)
    l_free = _free_dims(lhs_ndim, lc, lb)
    r_free = _free_dims(rhs_ndim, rc, rb)
    # The result's axes are [batch] + [lhs free] + [rhs free].
    g_batch = list(range(nb))
    g_lfree = list(range(nb, nb + len(l_free)))
    g_rfree = list(range(nb + len(l_free), g_ndim))
    # d lhs: contract g's rhs-free axes with rhs's free axes. Result axes: [batch] + [lhs free] +
    # [rhs's contracting axes in ascending order], each of which pairs with one lhs contracting axis.
    src = lb + l_free + [lc[rc.index(r)] for r in sorted(rc)]
    d_lhs = (((g_rfree, r_free), (g_batch, rb)), _inverse_permutation(src))
    # d rhs: contract lhs's free axes with g's lhs-free axes. Result axes: [batch] + [lhs's
    # contracting axes in ascending order] + [rhs free].
    src = rb + [rc[lc.index(axis)] for axis in sorted(lc)] + r_free
    d_rhs = (((l_free, g_lfree), (lb, g_batch)), _inverse_permutation(src))
    return d_lhs, d_rhs


def _dot_bwd(dimension_numbers, compute_dtype, out_dtype, placed, lowering, residuals, g):
    del out_dtype
    lhs_c, rhs_c, lhs_like, rhs_like, ready = residuals
    (l_dims, l_perm), (r_dims, r_perm) = backward_dims(
        dimension_numbers, lhs_c.ndim, rhs_c.ndim, g.ndim
    )
    g_c = g.astype(compute_dtype)
    # A gradient that goes to a 16-bit operand (16-bit activations) is rounded to it anyway.
    acc = _grad_acc(placed[0])
    out = lhs_like.dtype if placed[0] is None and _is_16bit(lhs_like.dtype) else acc
    d_lhs = lax.transpose(_matmul(g_c, rhs_c, l_dims, out, acc, lowering), l_perm)
    acc = _grad_acc(placed[1])
    out = rhs_like.dtype if placed[1] is None and _is_16bit(rhs_like.dtype) else acc
    d_rhs = lax.transpose(_matmul(lhs_c, g_c, r_dims, out, acc, lowering), r_perm)
    return (
        _to_operand(d_lhs, lhs_like.dtype, placed[0]),
        _to_operand(d_rhs, rhs_like.dtype, placed[1]),
        copies.no_gradient(ready),
    )


_dot.defvjp(_dot_fwd, _dot_bwd)


def mixed_dot_general(lhs, rhs, dimension_numbers, compute_dtype, out_dtype, placed=_UNPLACED):
    """`lax.dot_general` on operands cast to `compute_dtype`, accumulated in fp32.

    Args:
      lhs, rhs: floating arrays of any dtype.
      dimension_numbers: as for `lax.dot_general`.
      compute_dtype: dtype of both operands of the forward and backward matmuls.
      out_dtype: dtype of the result.
      placed: per operand, a `Placed` (a sharded parameter: cast on its shard, gradient reduced
        in its reduce dtype) or None.

    Returns:
      The product, in `out_dtype`. Its gradients come back in `lhs.dtype` and `rhs.dtype`.
    """
    dims = tuple(tuple(tuple(int(d) for d in axes) for axes in pair) for pair in dimension_numbers)
    compute_dtype = np.dtype(compute_dtype)
    lowering = hardware.matmul_lowering(compute_dtype)
    ready = copies.ready_operands(lhs, rhs, compute_dtype)
    return _dot(lhs, rhs, ready, dims, compute_dtype, np.dtype(out_dtype), tuple(placed), lowering)


def _conv(lhs, rhs, params, preferred):
    return lax.conv_general_dilated_p.bind(
        lhs, rhs, **dict(params), preferred_element_type=preferred
    )


def _conv_result(compute_dtype, wanted) -> np.dtype:
    """The result dtype a 16-bit convolution asks for: `wanted` (float32, or a reduce dtype),
    except where the program is compiled for a GPU. There cuDNN's 16-bit convolutions take
    16-bit operands, accumulate in float32 and round the result once; a convolution asked for
    a float32 result from 16-bit operands is run by XLA:GPU as a float32 convolution, operands
    widened (seen in the H200 program: experiments/results/gpu_compile_h200.md), so there the
    result is the compute dtype, widened afterwards: PyTorch autocast's form too. A float16
    weight gradient may then overflow where a float32 one would not; the dynamic loss scale
    backs off, as under autocast. (NVIDIA GPUs: AMD's are not known to need it.)"""
    if hardware.target_platform() == "gpu" and np.dtype(compute_dtype).itemsize < 4:
        if "AMD" not in str(getattr(hardware.target_device(), "device_kind", "")):
            return np.dtype(compute_dtype)
    return np.dtype(wanted)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _mixed_conv(lhs, rhs, ready, params, compute_dtype, out_dtype, placed):
    return _conv_fwd(lhs, rhs, ready, params, compute_dtype, out_dtype, placed)[0]


def _conv_fwd(lhs, rhs, ready, params, compute_dtype, out_dtype, placed):
    lhs_c = _to_compute(lhs, compute_dtype, placed[0], ready[0])
    rhs_c = _to_compute(rhs, compute_dtype, placed[1], ready[1])
    out = _conv(lhs_c, rhs_c, params, _conv_result(compute_dtype, _ACC)).astype(out_dtype)
    return out, (lhs_c, rhs_c, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype), ready)


def _conv_bwd(params, compute_dtype, out_dtype, placed, residuals, g):
    del out_dtype
    lhs_c, rhs_c, lhs_like, rhs_like, ready = residuals
    # Convolution transposes are convolutions with rearranged windows; JAX's own rules get those
    # right. Run on a compute-dtype cotangent, every backward operand is 16-bit, and asking for
    # fp32 results (the kernel's in its reduce dtype) keeps a scaled weight gradient, a sum over
    # the whole batch, from having to fit in fp16.
    d_lhs, d_rhs = jax_compat.conv_transposes(
        g.astype(compute_dtype),
        lhs_c,
        rhs_c,
        params,
        _conv_result(compute_dtype, _ACC),
        _conv_result(compute_dtype, _grad_acc(placed[1])),
    )
    return (
        _to_operand(d_lhs, lhs_like.dtype, placed[0]),
        _to_operand(d_rhs, rhs_like.dtype, placed[1]),
        copies.no_gradient(ready),
    )


_mixed_conv.defvjp(_conv_fwd, _conv_bwd)


# ----- convolutions with few input channels, as one matmul over their patches (CPU): when, and
# the patches' layout, are `jamp.conv_patches`'; the products and their VJP are these.

_MM = (((1,), (0,)), ((), ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _patch_conv(lhs, rhs, params, compute_dtype, out_dtype, placed, lowering):
    return _patch_conv_fwd(lhs, rhs, params, compute_dtype, out_dtype, placed, lowering)[0]


def _patch_conv_fwd(lhs, rhs, params, compute_dtype, out_dtype, placed, lowering):
    p = dict(params)
    to_lhs, to_rhs, to_out = conv_patches.channels_last_perms(p["dimension_numbers"])
    x = lax.transpose(_to_compute(lhs, compute_dtype, placed[0]), to_lhs)
    w = lax.transpose(_to_compute(rhs, compute_dtype, placed[1]), to_rhs)
    patches = conv_patches.extract(x, w.shape[:-2], p["window_strides"], p["padding"])
    w2 = w.reshape(-1, w.shape[-1])
    out = _matmul(patches.reshape(-1, w2.shape[0]), w2, _MM, _ACC, lowering=lowering)
    out = out.reshape(patches.shape[:-1] + (w2.shape[1],))
    out = lax.transpose(out, _inverse_permutation(to_out)).astype(out_dtype)
    # Zero-size arrays carry the input's channels-last shape and the operands' dtypes.
    shape_like = jnp.zeros((0,) + x.shape, lhs.dtype)
    return out, (patches, w, shape_like, jnp.zeros((0,), rhs.dtype))


def _patch_conv_bwd(params, compute_dtype, out_dtype, placed, lowering, residuals, g):
    del out_dtype
    p = dict(params)
    to_lhs, to_rhs, to_out = conv_patches.channels_last_perms(p["dimension_numbers"])
    patches, w, lhs_like, rhs_like = residuals
    g2 = lax.transpose(g.astype(compute_dtype), to_out).reshape(-1, w.shape[-1])
    p2 = patches.reshape(-1, patches.shape[-1])
    # Both products take 16-bit operands and return fp32; the scatter back sums in fp32.
    acc = _grad_acc(placed[1])
    d_w = _matmul(p2, g2, (((0,), (0,)), ((), ())), acc, acc, lowering)
    d_w = d_w.reshape(w.shape)
    d_patches = _matmul(
        g2, w.reshape(-1, w.shape[-1]), (((1,), (1,)), ((), ())), _ACC, _ACC, lowering
    )
    d_x = conv_patches.scatter(
        d_patches.reshape(patches.shape),
        lhs_like.shape[1:],
        w.shape[:-2],
        p["window_strides"],
        p["padding"],
    )
    d_lhs = lax.transpose(d_x, _inverse_permutation(to_lhs))
    d_rhs = lax.transpose(d_w, _inverse_permutation(to_rhs))
    return (
        _to_operand(d_lhs, lhs_like.dtype, placed[0]),
        _to_operand(d_rhs, rhs_like.dtype, placed[1]),
    )


_patch_conv.defvjp(_patch_conv_fwd, _patch_conv_bwd)


def mixed_conv(lhs, rhs, params, compute_dtype, out_dtype, placed=_UNPLACED):
    """`lax.conv_general_dilated` on operands cast to `compute_dtype`, accumulated in fp32.

    Args:
      lhs, rhs: floating input and kernel, any dtype.
      params: the `conv_general_dilated` primitive's parameters, as a mapping (its
        `preferred_element_type` is replaced).
      compute_dtype: dtype of the operands of the forward and backward convolutions; all
        three return fp32 (a sharded kernel's gradient: its reduce dtype).
      out_dtype: dtype of the result.
      placed: per operand, a `Placed` or None, as for `mixed_dot_general`.

    Returns:
      The convolution, in `out_dtype`; gradients come back in the operands' own dtypes.
    """
    frozen = tuple(sorted((k, v) for k, v in params.items() if k != "preferred_element_type"))
    dtypes = (np.dtype(compute_dtype), np.dtype(out_dtype), tuple(placed))
    if conv_patches.lowerable(lhs, rhs, params):
        return _patch_conv(lhs, rhs, frozen, *dtypes, hardware.matmul_lowering(compute_dtype))
    ready = copies.ready_operands(lhs, rhs, compute_dtype)
    return _mixed_conv(lhs, rhs, ready, frozen, *dtypes)
