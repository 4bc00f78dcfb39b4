"""The OCP FP8 formats and per-tensor scaling: quantise, dequantise, the scale for an amax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jamp.policy import MATMUL_MARKER

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
#: The dtype carried between matmuls under an fp8 policy.
CARRIER = np.dtype(jnp.bfloat16)
RECIPES = ("current", "delayed")
#: Rows of a site's state: the activation (lhs), the weight (rhs), the incoming gradient.
ROWS = ("x", "w", "g")
_FMAX = np.array([448.0, 448.0, 57344.0], np.float32)
_F32 = np.dtype(np.float32)
# A scale from a tiny (or subnormal) amax must stay finite.
_SCALE_CAP = 2.0**100


def is_fp8(dtype) -> bool:
    """Whether `dtype` is the autocast marker for fp8 matmuls."""
    return dtype is not None and np.dtype(dtype) == MATMUL_MARKER


def carrier(dtype):
    """The dtype an autocast program computes in between matmuls: bfloat16 for the fp8 marker."""
    return CARRIER if is_fp8(dtype) else dtype


def quantize(x: jax.Array, scale, dtype) -> jax.Array:
    """`x * scale` in fp8 `dtype`, finite values saturated to its range, inf / NaN kept non-finite.

    Rounding is to nearest, ties to even (XLA's conversion); a finite value beyond the range
    becomes +-fmax rather than NaN (E4M3) or inf (E5M2). A non-finite `x` stays non-finite
    (E4M3 has no infinity: inf becomes NaN there).
    """
    fmax = float(jnp.finfo(dtype).max)
    y = x.astype(_F32) * jnp.asarray(scale, _F32)
    y = jnp.where(jnp.isfinite(x), jnp.clip(y, -fmax, fmax), y)
    return y.astype(dtype)


def dequantize(q: jax.Array, scale, dtype=jnp.float32) -> jax.Array:
    """The values `q` stands for: `q / scale`, in `dtype`."""
    return (q.astype(_F32) / jnp.asarray(scale, _F32)).astype(dtype)


def scale_for(amax, fmax, margin: float = 0.0, fallback=1.0):
    """`fmax / (amax * 2**margin)`; `fallback` where amax is zero or not finite."""
    amax = jnp.asarray(amax, _F32)
    ok = jnp.isfinite(amax) & (amax > 0)
    scale = jnp.asarray(fmax, _F32) / (jnp.where(ok, amax, 1.0) * np.float32(2.0**margin))
    return jnp.where(ok, jnp.minimum(scale, _SCALE_CAP), jnp.asarray(fallback, _F32))


#: The longest axis `_max_last` takes as elementwise maxima.
_UNROLLED_MAX = 64


def _amax(x) -> jax.Array:
    return jnp.max(jnp.abs(x.astype(_F32))) if x.size else jnp.zeros((), _F32)


def _max_last(x) -> jax.Array:
    """The maximum over the last axis of a small array (a site's history, its three rows), as
    elementwise maxima of its slices: XLA:GPU fuses those into the kernel that reads the result,
    where a reduction is a kernel of its own (GPT-2 small's fp8 step, history 16, on the H200
    program: 2311 -> 1795 kernels). The same values: a maximum is exact. A long axis (a history
    of hundreds) stays a reduction."""
    if x.shape[-1] > _UNROLLED_MAX:
        return jnp.max(x, axis=-1)
    return functools.reduce(jnp.maximum, [x[..., i] for i in range(x.shape[-1])])
