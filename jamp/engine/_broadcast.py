"""A 16-bit value broadcast against a larger one, whose gradient is summed in float32.

Where a small operand meets a large activation in an elementwise operation (a bias added to a
layer's output, a position embedding added to every sequence of the batch, a per-channel scale),
its gradient is the incoming gradient summed over the broadcast axes. JAX's transpose sums in the
operand's dtype: with 16-bit activations, a layer's bias gradient is a bfloat16 sum of batch x
length terms, whose accumulator (and XLA:GPU's partial sums between the two passes of a long
reduction) keeps 8 bits of mantissa, where a float32 one keeps 24: once the sum has grown,
later terms round away (the H200 program of a GPT-2-small step had 145 such bfloat16
reductions). Here the operand is broadcast explicitly, by a broadcast whose backward widens the
gradient to float32, sums there (XLA fuses the widening into the reduction: the same bytes are
read) and rounds once to the operand's dtype. The forward is the same broadcast XLA fuses into
the operation; values are unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp.engine import _values as V
from jamp.scopes import SUM_SCOPE

#: Elementwise operations whose operands JAX broadcasts (size-1 axes, or a rank-0 operand).
ELEMENTWISE = frozenset({"add", "add_any", "sub", "mul", "div", "max", "min"})
_F32 = np.dtype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _broadcast(x, shape, dims, x_shape, x_dtype):
    return lax.broadcast_in_dim(x, shape, dims)


def _broadcast_fwd(x, shape, dims, x_shape, x_dtype):
    return _broadcast(x, shape, dims, x_shape, x_dtype), None


def _broadcast_bwd(shape, dims, x_shape, x_dtype, _, g):
    summed = [i for i in range(len(shape)) if i not in dims]
    summed = sorted(summed + [d for k, d in enumerate(dims) if x_shape[k] == 1 and shape[d] != 1])
    lead = len(summed)
    if summed == list(range(lead)) and len(shape) - lead >= 2:
        # Summed over leading axes, leaving an array (a position embedding's gradient, summed
        # over the batch; an attention bias's, over batch and length): a product with ones,
        # 16-bit operands accumulated in float32. As a reduction over the batch axis, at 32
        # sequences of GPT-2 small's widths XLA:GPU laid the whole step's activations out
        # batch-minor with a transpose at every matmul (+7.5 % predicted step time). The ones
        # are two rows, of which one is kept: XLA:GPU turns a product with a single row (a
        # vector) back into a reduction below 10M elements (DotStrengthReduction), which at
        # sequences of 256 did the same. A bias's sum (leaving one axis) stays a reduction: as
        # a product, GPT-2 small's H200 step at batch 8 was predicted slower (19.77 against
        # 19.67 ms: more GEMM time than the reductions it saved).
        rows, cols = int(np.prod(shape[:lead])), int(np.prod(shape[lead:]))
        with jax.named_scope(SUM_SCOPE):  # named: a GEMM that is not a layer's
            ones = jnp.ones((2, rows), g.dtype)
            total = lax.dot_general(
                ones, g.reshape(rows, cols), (((1,), (0,)), ((), ())), preferred_element_type=_F32
            )[0]
    else:
        total = lax.reduce_sum(g.astype(_F32), tuple(summed))
    return (total.reshape(x_shape).astype(x_dtype),)


_broadcast.defvjp(_broadcast_fwd, _broadcast_bwd)


def _is_16bit_array(x) -> bool:
    if isinstance(x, (np.ndarray, np.generic, int, float)):  # a literal: no gradient
        return False
    dtype = V.dtype_of(x)
    return V.is_float_dtype(dtype) and np.dtype(dtype).itemsize == 2


def summed_in_f32(x, shape, dims):
    """`lax.broadcast_in_dim(x, shape, dims)`, its gradient summed in float32 when `x` is a
    16-bit array that the broadcast enlarges; else the plain broadcast."""
    shape, dims = tuple(shape), tuple(dims)
    if not _is_16bit_array(x) or int(np.prod(x.shape)) == int(np.prod(shape)):
        return lax.broadcast_in_dim(x, shape, dims)
    return _broadcast(x, shape, dims, tuple(x.shape), np.dtype(V.dtype_of(x)))


def operands(name: str, operands_: list, shape) -> list:
    """The operands of elementwise operation `name` with result `shape`, each 16-bit array that
    JAX would broadcast to it broadcast explicitly by `summed_in_f32`."""
    if name not in ELEMENTWISE:
        return operands_
    out = []
    for x in operands_:
        x_shape = tuple(np.shape(x))
        if _is_16bit_array(x) and x_shape != tuple(shape):
            if not x_shape:
                dims: tuple = ()
            elif len(x_shape) == len(shape):
                dims = tuple(range(len(shape)))
            else:  # not a broadcast this rule knows: left as it is
                out.append(x)
                continue
            x = summed_in_f32(x, shape, dims)
        out.append(x)
    return out
