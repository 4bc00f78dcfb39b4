"""A slice of the positions of a loss's widened logits (the next-token shift `logits[:, :-1]`),
taken last in a recomputed tail (see `jamp.engine._tail`): the tail runs at all positions and
what it computes is sliced only where positions meet."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp.engine import _tail_picks as P
from jamp.engine import _values as V

REDUCTIONS = frozenset(
    {"reduce_max", "reduce_min", "reduce_sum", "reduce_prod", "argmax", "argmin"}
)
# Operations element by element (operands of the result's shape, of size 1 along an axis, or
# scalars): computed at all positions where an operand is (`_Padded`).
_ELEMENTWISE = frozenset(
    """abs add add_any and ceil clamp convert_element_type copy cos div eq erf erf_inv erfc exp
    exp2 expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg not
    or pow reduce_precision rem round rsqrt select_n sign sin sqrt square stop_gradient sub tan
    tanh xor""".split()
)


@dataclasses.dataclass(frozen=True)
class Region:
    """The positions a slice of the widened value keeps (its axes but the last, the vocabulary):
    `starts` to `limits` of `whole`. `flat`: a value's positions merged into its first axis, as
    `logits.reshape(-1, vocab)` merges them."""

    whole: tuple[int, ...]
    starts: tuple[int, ...]
    limits: tuple[int, ...]
    flat: bool = False

    @property
    def lead(self) -> int:  # a value's axes that are positions
        return 1 if self.flat else len(self.whole)

    def _shape(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        return (int(np.prod(sizes, dtype=np.int64)),) if self.flat else sizes

    def kept(self) -> tuple[int, ...]:
        return self._shape(tuple(b - a for a, b in zip(self.starts, self.limits)))

    def spread(self, shape) -> tuple[int, ...]:
        """`shape` (of a value at the kept positions) over all positions."""
        return self._shape(self.whole) + tuple(shape[self.lead :])

    def take(self, x):
        """The kept positions of `x` (a value over all positions)."""
        rest = tuple(x.shape[self.lead :])
        x = x.reshape(self.whole + rest)
        x = lax.slice(x, self.starts + (0,) * len(rest), self.limits + rest)
        return x.reshape(self.kept() + rest)

    def put(self, x):
        """`x` (a value at the kept positions) over all positions, zeros at the others."""
        rest = tuple(x.shape[self.lead :])
        x = x.reshape(tuple(b - a for a, b in zip(self.starts, self.limits)) + rest)
        edges = [(a, w - b, 0) for a, b, w in zip(self.starts, self.limits, self.whole)]
        x = lax.pad(x, jnp.zeros((), x.dtype), edges + [(0, 0, 0)] * len(rest))
        return x.reshape(self._shape(self.whole) + rest)

    def mask(self, shape):
        """True at the kept positions of an array of `shape` (over all positions, not flat)."""
        keep = jnp.ones(shape, bool)
        for axis, (a, b) in enumerate(zip(self.starts, self.limits)):
            at = lax.broadcasted_iota(np.int32, shape, axis)
            keep = keep & (at >= a) & (at < b)
        return keep


@dataclasses.dataclass(frozen=True)
class Padded:
    """A value of the tail at the positions `region` keeps, held as `whole`, the same computed at
    all positions: a slice of the widened value (the next-token shift `logits[:, :-1]`) is taken
    of the values computed from it only where positions meet (a sum over them, a reshape that
    moves them), so the backward reads and writes the logits whole. XLA gives the 16-bit
    logits' gradient the logits' own buffer then; through a slice it cannot (its transpose, a
    pad, is not elementwise): one more 16-bit logits-sized buffer at the step's peak."""

    whole: Any
    region: Region


def _within(x, region: Region):
    """`x`, whose gradient is zero outside the positions `region` keeps (what a slice's transpose
    gives; what the tail computes there is not the program's, and may not be finite)."""

    @jax.custom_vjp
    def within(x):
        return x

    def backward(_, g):
        return (jnp.where(region.mask(g.shape), g, jnp.zeros((), g.dtype)),)

    within.defvjp(lambda x: (x, None), backward)
    return within(x)


def _shift(eqn, x, keep_below: int) -> Padded | None:
    """A slice of the positions (not the last axis) of a large value, kept for last."""
    if eqn.primitive.name != "slice" or isinstance(x, Padded) or np.size(x) < keep_below:
        return None
    starts, limits = tuple(eqn.params["start_indices"]), tuple(eqn.params["limit_indices"])
    strides = eqn.params.get("strides")
    if (strides and any(s != 1 for s in strides)) or (starts[-1], limits[-1]) != (0, x.shape[-1]):
        return None
    region = Region(tuple(x.shape[:-1]), starts[:-1], limits[:-1])
    return Padded(_within(x, region), region)


def _spread_operand(x, region: Region):
    """An operand of an elementwise operation over all positions: None if it cannot be."""
    if isinstance(x, Padded):
        return x.whole if x.region == region else None
    shape = np.shape(x)
    if not shape or all(d == 1 for d in shape[: region.lead]):  # the same at every position
        return x
    return region.put(x) if tuple(shape[: region.lead]) == region.kept() else None


def _picks_at(invals, region: Region) -> bool:
    """A pick's operand `Padded`, its indices at the positions `region` keeps."""
    operand, indices = invals
    return (
        isinstance(operand, Padded)
        and operand.region == region
        and not isinstance(indices, Padded)
        and tuple(np.shape(indices)[: region.lead]) == region.kept()
    )


def _layout(eqn, x: Padded):
    """A reshape, broadcast or squeeze of `x` that keeps its positions, over all of them; None
    for one that moves them."""
    name, region, shape = eqn.primitive.name, x.region, eqn.outvars[0].aval.shape
    lead = region.lead
    if name == "reshape" and eqn.params.get("dimensions") is not None:
        return None
    if name == "reshape" and not region.flat and shape[1:] == np.shape(x.whole)[lead:]:
        if len(shape) and shape[0] == int(np.prod(region.kept(), dtype=np.int64)):
            flat = dataclasses.replace(region, flat=True)  # the positions merged into one axis
            return Padded(x.whole.reshape(flat.spread(shape)), flat)
    if tuple(shape[:lead]) != region.kept():
        return None
    if name == "reshape":
        return Padded(x.whole.reshape(region.spread(shape)), region)
    if name == "broadcast_in_dim" and tuple(eqn.params["broadcast_dimensions"][:lead]) == tuple(
        range(lead)
    ):
        params = dict(eqn.params, shape=region.spread(shape))
        return Padded(V.bind(eqn, [x.whole], params)[0], region)
    if name == "squeeze" and min(eqn.params["dimensions"]) >= lead:
        return Padded(V.bind(eqn, [x.whole], eqn.params)[0], region)
    return None


def positionwise(eqn, invals, keep_below: int) -> list | None:
    """`eqn` at all positions where an operand is `Padded` (its results `Padded` too); None
    where it mixes positions (a sum over them) or is not known to keep them apart."""
    if not invals:
        return None
    if (shifted := _shift(eqn, invals[0], keep_below)) is not None:
        return [shifted]
    padded = [x for x in invals if isinstance(x, Padded)]
    if not padded:
        return None
    name, region = eqn.primitive.name, padded[0].region
    if name in ("reshape", "broadcast_in_dim", "squeeze") and len(invals) == 1:
        out = _layout(eqn, padded[0])
        return None if out is None else [out]
    if any(tuple(v.aval.shape[: region.lead]) != region.kept() for v in eqn.outvars):
        return None  # a result without the positions: they meet
    if name in _ELEMENTWISE:
        args = [_spread_operand(x, region) for x in invals]
        if any(a is None for a in args):
            return None
        outs = V.bind(eqn, args, eqn.params)
    elif name in REDUCTIONS and all(a >= region.lead for a in eqn.params["axes"]):
        outs = V.bind(eqn, [padded[0].whole], eqn.params)
    elif P.pick_form(eqn, eqn.invars[0].aval) == "batched" and _picks_at(invals, region):
        outs = P.bind(eqn, [padded[0].whole, region.put(invals[1])], keep_below)
    else:
        return None
    return [Padded(o, region) for o in outs]


def taken(x):
    """The program's value of `x`: its kept positions if it is `Padded`."""
    return x.region.take(x.whole) if isinstance(x, Padded) else x


def whole_of(x):
    return x.whole if isinstance(x, Padded) else x


def each(f, out):
    return Padded(f(out.whole), out.region) if isinstance(out, Padded) else f(out)
