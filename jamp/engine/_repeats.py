"""Keys and values repeated over the heads (grouped-query attention), read from the program.

Models repeat a KV head for each of its query heads in many ways: `jnp.repeat(k, g, axis)`,
`broadcast_to(k[..., None, :], ...)` then a reshape (Gemma), `expand_dims` then `jnp.repeat`
then a reshape, Hugging Face's `expand` of a new axis. JAX traces each as a chain of layout
operations (`broadcast_in_dim`, `reshape`, `transpose`, `squeeze`) ending in a reshape.

`repeat_of` proves, rather than matches, that such a chain is `jnp.repeat(source, group, axis)`:
it follows where every element of the result is read from in the source, as a list of factors
(size, stride in the source's elements; stride 0 along a copy), through each operation of the
chain, and compares that with what the repeat reads. Any chain that reads the same elements in
the same order is found, whatever operations it is written with; a tile (head h reading KV head
h % KV) or any other layout is not.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from jax.extend import core as jcore

from jamp import jax_compat

#: The layout operations a chain may be made of (one array operand each).
_LAYOUT = ("broadcast_in_dim", "reshape", "transpose", "squeeze")
#: How far back a chain is followed.
_MAX_CHAIN = 8

Factors = list[tuple[int, int]]  # (size, stride in the source's elements), outermost first


def _start(shape) -> list[Factors]:
    strides = [int(np.prod(shape[i + 1 :], dtype=np.int64)) for i in range(len(shape))]
    return [[(int(n), s)] for n, s in zip(shape, strides)]


def _flat(dims: list[Factors]) -> Factors:
    return [f for factors in dims for f in factors if f[0] != 1]


def _reshaped(dims: list[Factors], sizes) -> Optional[list[Factors]]:
    """The factors regrouped into dimensions of `sizes` (row-major), splitting a factor where a
    new boundary falls inside it; None where it cannot be split there."""
    flat = _flat(dims)
    out: list[Factors] = []
    i = 0
    for n in (int(s) for s in sizes):
        group: Factors = []
        have = 1
        while have < n:
            if i >= len(flat):
                return None
            size, stride = flat[i]
            if have * size <= n:
                group.append((size, stride))
                have *= size
                i += 1
                continue
            need = n // have
            if n % have or size % need:
                return None
            group.append((need, stride * (size // need)))  # the outer part of the factor
            flat[i] = (size // need, stride)
            have = n
        if have != n:
            return None
        out.append(group)
    return out if i == len(flat) else None


def _step(eqn, dims: list[Factors]) -> Optional[list[Factors]]:
    name = eqn.primitive.name
    shape = tuple(eqn.outvars[0].aval.shape)
    if name == "broadcast_in_dim":
        placed = [int(d) for d in jax_compat.param(eqn, "broadcast_dimensions")]
        out: list[Factors] = [[(int(n), 0)] for n in shape]
        for j, d in enumerate(placed):
            source = int(np.prod([f[0] for f in dims[j]], dtype=np.int64))
            out[d] = dims[j] if source == shape[d] else [(int(shape[d]), 0)]
        return out
    if name == "transpose":
        return [dims[int(p)] for p in jax_compat.param(eqn, "permutation")]
    if name == "squeeze":
        gone = {int(d) % len(dims) for d in jax_compat.param(eqn, "dimensions")}
        return [f for i, f in enumerate(dims) if i not in gone]
    if name == "reshape" and jax_compat.param(eqn, "dimensions") is None:
        return _reshaped(dims, shape)
    return None


def _canonical(factors: Factors) -> Factors:
    """Adjacent factors that read contiguously (or both copies) merged into one."""
    out: Factors = []
    for size, stride in factors:
        if out and out[-1][1] == stride * size:
            outer = out.pop()
            out.append((outer[0] * size, stride))
        else:
            out.append((size, stride))
    return out


def _repeat_axis(src, out) -> Optional[tuple[int, int]]:
    """(axis, group) if `out` is `src`'s shape with one axis `group` >= 2 times longer."""
    if len(src) != len(out):
        return None
    differ = [a for a, (s, o) in enumerate(zip(src, out)) if s != o]
    if len(differ) != 1:
        return None
    (axis,) = differ
    if src[axis] == 0 or out[axis] % src[axis] or out[axis] // src[axis] < 2:
        return None
    return axis, out[axis] // src[axis]


def _reads_as_repeat(chain, src_shape, axis: int, group: int) -> bool:
    dims: Optional[list[Factors]] = _start(src_shape)
    for eqn in chain:
        dims = _step(eqn, dims) if dims is not None else None
    if dims is None:
        return False
    repeat = _start(src_shape)
    repeat[axis] = repeat[axis] + [(group, 0)]
    return _canonical(_flat(dims)) == _canonical(_flat(repeat))


def repeat_of(eqn, made_by: dict) -> Optional[tuple]:
    """(source var, axis, group) if `eqn`'s result is `jnp.repeat(source, group, axis)`, read
    through a chain of layout operations ending in `eqn` (a reshape); None otherwise.
    `made_by` maps each variable computed so far to its equation."""
    if eqn.primitive.name != "reshape" or jax_compat.param(eqn, "dimensions") is not None:
        return None
    chain = [eqn]
    var = eqn.invars[0]
    while isinstance(var, jcore.Var) and var in made_by and len(chain) < _MAX_CHAIN:
        producer = made_by[var]
        if producer.primitive.name not in _LAYOUT or len(producer.invars) != 1:
            break
        chain.append(producer)
        var = producer.invars[0]
    out = tuple(eqn.outvars[0].aval.shape)
    # The earliest operand first: the KV heads themselves, before any layout work on them.
    for i in range(len(chain) - 1, -1, -1):
        source = chain[i].invars[0]
        if not isinstance(source, jcore.Var):
            continue
        src = tuple(source.aval.shape)  # type: ignore[attr-defined]  # a ShapedArray
        found = _repeat_axis(src, out)
        if found is not None and _reads_as_repeat(chain[i::-1], src, *found):
            return source, found[0], found[1]
    return None
