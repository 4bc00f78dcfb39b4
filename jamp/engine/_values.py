"""What the engine's rules share: dtype tests, casts, sub-program lookups, placements.

Pure helpers of `jamp.engine`: none of them evaluates a program.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jamp import copies, jax_compat, mixed_ops

DOT = lax.dot_general_p
CONV = lax.conv_general_dilated_p
#: Grouped GEMMs (`lax.ragged_dot`: a mixture of experts), by name (JAX exports no primitive).
RAGGED = "ragged_dot_general"
#: The contractions the engine runs in the compute dtype (`jamp.mixed_ops`, `jamp.grouped`).
MATMULS = frozenset({DOT.name, CONV.name, RAGGED})

#: JAX's other primitives that contract float operands, which the engine leaves as traced: a
#: float32 one under a 16-bit policy gets a one-time `RecognitionWarning` naming it. (Linear
#: algebra, `triangular_solve`, `cholesky`, `qr`, ..., also stays as traced, deliberately and
#: without a warning: as under PyTorch's autocast, its accuracy needs float32. `pallas_call`
#: kernels run as written; cuDNN's attention and scaled matmuls take the dtypes their caller
#: chose.)
UNCOVERED_CONTRACTIONS = frozenset({"symmetric_product", "ragged_dot_general"})


def is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def needs_rewrite(invals, compute_dtype) -> bool:
    lhs, rhs = invals[:2]  # (a grouped GEMM's third operand: its group sizes)
    if compute_dtype is None or not (is_float(lhs) and is_float(rhs)):
        return False
    if lhs.dtype != compute_dtype or rhs.dtype != compute_dtype:
        return True
    # Already in the compute dtype: a 16-bit product still gains from fp32 accumulation (and on
    # CPU from the fast bf16 kernels); a float32 one is left bit-identical.
    return compute_dtype.itemsize < 4


#: Higher-order primitives whose sub-programs are ordinary programs that the interpreter rewrites
#: (keeping each sub-program's signature). Kernels (`jax_compat.is_kernel`) run as written; any
#: other primitive with a matmul to rewrite inside is an `UnsupportedProgramError`.
REWRITTEN_INSIDE = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "scan",
        "while",
        "cond",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "shard_map",
    }
)


def sub_jaxprs(eqn):
    """The sub-programs the interpreter may look into: none of a kernel's."""
    return [] if jax_compat.is_kernel(eqn) else jcore.jaxprs_in_params(eqn.params)


def has_matmul(jaxpr: jcore.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in MATMULS:
            return True
        if any(has_matmul(sub) for sub in sub_jaxprs(eqn)):
            return True
    return False


def spec(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def last_dot(jaxpr: jcore.Jaxpr) -> Optional[jcore.JaxprEqn]:
    """The program's last `dot_general`, sub-programs included (in evaluation order)."""
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive is DOT:
            return eqn
        for sub in reversed(list(sub_jaxprs(eqn))):
            found = last_dot(sub)
            if found is not None:
                return found
    return None


def placed_for(placed, compute_dtype):
    """The operands' placements for one matmul: a float32 matmul (a module kept in float32)
    keeps its gradients float32 across the wire too."""
    if placed is None:
        return mixed_ops._UNPLACED
    if compute_dtype.itemsize >= 4:
        return tuple(
            None if p is None else dataclasses.replace(p, reduce_dtype=np.dtype(np.float32))
            for p in placed
        )
    return tuple(placed)


def follow_placement(eqn, placed):
    """The placement of a transpose's or a float cast's result, from its operand's."""
    (p,) = placed if len(placed) == 1 else (None,)
    if p is None or not isinstance(p.sharding, jax.sharding.NamedSharding):
        return None
    name = eqn.primitive.name
    if name == "convert_element_type" and is_float_dtype(eqn.outvars[0].aval.dtype):
        return p
    if name == "transpose":
        perm, ndim = jax_compat.param(eqn, "permutation"), eqn.invars[0].aval.ndim

        def permuted(sharding):
            if not isinstance(sharding, jax.sharding.NamedSharding):
                return None
            spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
            return jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(*(spec[d] for d in perm))
            )

        return dataclasses.replace(p, sharding=permuted(p.sharding), gathered=permuted(p.gathered))
    return None


def cast(x, dtype):
    """`x` as `dtype`; only float values are ever carried in another dtype than traced."""
    if not is_float_dtype(dtype) or dtype_of(x) == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):  # a literal: stays a constant
        return np.asarray(x, dtype)
    return copies.cast(x, dtype)  # a param's ready copy where the train step has one


def as_traced(eqn, invals):
    """The operands in the dtypes the equation was traced with (a no-op unless some were lowered)."""
    return [cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)]


def is_float_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def dtype_of(x) -> np.dtype:
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def body_weak(eqn, weak) -> dict:
    """param name -> which inputs of that sub-program are weak: the loop-invariant operands
    (a layer's variables) keep their weakness, the carried state is strong."""
    name = eqn.primitive.name
    if name in ("jit", "pjit"):
        return {"jaxpr": list(weak)}
    if name in ("closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"):
        return {"call_jaxpr": list(weak)}  # the sub-program takes the equation's operands
    if name == "scan":
        consts, carry = jax_compat.scan_split(eqn)
        return {"jaxpr": weak[:consts] + [False] * carry + weak[consts + carry :]}
    if name == "cond":
        return {"branches": weak[1:]}  # after the branch index
    if name == "while":
        nc, nb = jax_compat.while_split(eqn)
        carried = [False] * (len(weak) - nc - nb)
        return {"cond_jaxpr": weak[:nc] + carried, "body_jaxpr": weak[nc : nc + nb] + carried}
    return {}


def bind(eqn, invals, params):
    # `eqn.ctx` carries per-equation settings recorded at trace time (e.g. compute placement).
    with jax_compat.bind_context(eqn):
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    return out if eqn.primitive.multiple_results else [out]


def saturate(x, dtype):
    """`x` as `dtype` with finite values clipped to its range: a weak fill such as Flax's
    `finfo(float32).min` mask value must stay finite (-inf would make a fully masked softmax row
    NaN); infinities and NaN pass unchanged."""
    info = jnp.finfo(dtype)
    if isinstance(x, (np.ndarray, np.generic)):  # a literal: clipped now, not in the program
        x = np.asarray(x)
        return np.where(np.isfinite(x), np.clip(x, info.min, info.max), x).astype(dtype)
    clipped = jnp.clip(x, float(info.min), float(info.max))
    return jnp.where(jnp.isfinite(x), clipped, x).astype(dtype)
