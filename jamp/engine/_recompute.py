"""Activation functions recomputed in the backward from their input, not kept.

Differentiated as written, `gelu(x)` (tanh form) keeps `tanh(...)` for its backward beside `x`
and its output, one more activation-sized array per MLP and layer, alive from the forward to the
backward. For GPT-2 small at batch 8 that is 576 MiB of
bf16 at the step's peak (12 x [8192, 3072]; XLA's plan for an H200).

`regions(jaxpr)` finds each such function as the program computes it: the elementwise
operations of one shape around a `tanh`, `erf` or `erfc`, grown through elementwise
producers used only inside and elementwise consumers whose other operands come from outside or
are scalars; the engine evaluates each region under `jax.checkpoint`. What the backward keeps is
then the region's inputs and outputs (the matmul results around it, kept anyway); everything in
between is recomputed inside the backward's own elementwise kernel, which reads the input where
it read the intermediate. XLA's common-subexpression elimination is kept from merging the
recomputation with the forward's (which would keep the intermediate again) by the checkpoint's
barrier.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax.extend import core as jcore

#: Operations that make an activation function worth recomputing: their output is what its
#: backward would otherwise keep (GELU's two forms, tanh). Not `logistic` (SiLU, sigmoid): XLA
#: recomputes it in the backward already, and the checkpoint's barrier would make it write the
#: gate and up projections out of their merged GEMM's result (H200 program of the Llama-style
#: decoder, 12 x 768: +300 MiB at the peak).
SEEDS = frozenset({"tanh", "erf", "erfc"})
_ELEMENTWISE = frozenset(
    {
        "add", "add_any", "sub", "mul", "div", "neg", "integer_pow", "pow", "square", "sqrt",
        "rsqrt", "exp", "exp2", "expm1", "log", "log1p", "max", "min", "abs", "sign", "tanh",
        "logistic", "erf", "erfc", "convert_element_type", "select_n", "cbrt", "copy",
    }
)  # fmt: skip
#: Regions smaller than this (elements per value) are left alone.
MIN_ELEMENTS = 1 << 16


@dataclasses.dataclass(frozen=True)
class Region:
    """Equations (indices into the program, in order) evaluated as one recomputed function."""

    members: tuple[int, ...]
    inputs: tuple[Any, ...]  # vars read from outside
    outputs: tuple[Any, ...]  # vars read outside or returned


def _shape(v) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def _fits(eqn, shape) -> bool:
    """Elementwise over `shape`: every operand of that shape or a scalar, every result of it."""
    if eqn.primitive.name not in _ELEMENTWISE or eqn.effects:
        return False
    return all(_shape(o) == shape for o in eqn.outvars) and all(
        isinstance(v, jcore.Literal) or _shape(v) in (shape, ()) for v in eqn.invars
    )


def _grow(jaxpr, seed: int, users, producer) -> set[int]:
    eqns = jaxpr.eqns
    shape = _shape(eqns[seed].outvars[0])
    members = {seed}
    changed = True
    while changed:
        changed = False
        for m in sorted(members):
            for v in eqns[m].invars:  # producers used only inside
                p = producer.get(v) if isinstance(v, jcore.Var) else None
                if p is None or p in members or not _fits(eqns[p], shape):
                    continue
                if all(u in members for o in eqns[p].outvars for u in users.get(o, ())):
                    members.add(p)
                    changed = True
            for o in eqns[m].outvars:  # consumers
                for u in users.get(o, ()):
                    if u not in members and _fits(eqns[u], shape):
                        members.add(u)
                        changed = True
    return members


def _region(jaxpr, members: set[int], users, returned) -> Region | None:
    eqns = jaxpr.eqns
    order = tuple(sorted(members))
    made = {o for i in order for o in eqns[i].outvars}
    inputs = tuple(
        dict.fromkeys(
            v for i in order for v in eqns[i].invars if isinstance(v, jcore.Var) and v not in made
        )
    )
    outputs = []
    last = order[-1]
    for i in order:
        for o in eqns[i].outvars:
            outside = [u for u in users.get(o, ()) if u not in members]
            if any(u < last for u in outside):
                return None  # read outside before the region is complete
            if outside or o in returned:
                outputs.append(o)
    internal = [o for i in order for o in eqns[i].outvars if o not in outputs]
    if not internal or not outputs:
        return None
    return Region(order, inputs, tuple(outputs))


def regions(jaxpr: jcore.Jaxpr) -> dict[int, Region]:
    """The recomputed regions of `jaxpr`, by the index of each one's last equation."""
    eqns = jaxpr.eqns
    users: dict[Any, list[int]] = {}
    producer: dict[Any, int] = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if isinstance(v, jcore.Var):
                users.setdefault(v, []).append(i)
        for o in e.outvars:
            producer[o] = i
    returned = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    taken: set[int] = set()
    found: dict[int, Region] = {}
    for i, e in enumerate(eqns):
        if i in taken or e.primitive.name not in SEEDS:
            continue
        out = e.outvars[0]
        if np.prod(_shape(out), dtype=np.int64) < MIN_ELEMENTS:
            continue
        members = _grow(jaxpr, i, users, producer)
        if members & taken:
            continue
        region = _region(jaxpr, members, users, returned)
        if region is not None:
            taken |= members
            found[region.members[-1]] = region
    return found


__all__ = ["MIN_ELEMENTS", "Region", "SEEDS", "regions"]
