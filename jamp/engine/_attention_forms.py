"""Values known by their form, not element by element: the masks of long sequences.

A causal mask over 65,536 positions has 4.3G elements; evaluated while tracing, it exhausted a
24 GiB host (and past 4096 x 4096 it was not evaluated, so the attention computed every score).
Built from `iota`, though, it has a form that any length shares: `Affine` is an index
expression `offset + sum(coef[d] * i_d)` over the axes of a value's shape, and `Split` a value
that is `yes` inside a region (where each of its integer `Affine`s is >= 0: one half-plane for
a causal mask, two for a causal mask with a sliding window) and `no` outside, either possibly
`UNKNOWN` (data: what a mask of data and constants holds whatever the data is, as
`Scope.partial` reads on arrays). A comparison of two index expressions is a `Split`;
operations element by element on `Split`s of one region act on their two values, an `and` of
masks false outside their regions is one of the intersection; broadcasts, transposes, reshapes
of size-1 axes and slices act on the region. `Scope.symbolic` reads a program so
(`jamp.engine._attention_scope`); `causal_window` says whether a region is the causal mask, and
its window.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import numpy as np

#: The exact integers of a float dtype: |n| up to 2**(mantissa bits + 1).
_EXACT_BITS = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


#: A value nothing is known of (data), element by element.
UNKNOWN: Any = _Unknown()


@dataclasses.dataclass(frozen=True)
class Affine:
    """`offset + sum(coef[d] * i_d)` at index `i` of a value of rank `len(coef)`; every value an
    integer (coefficients and offset are Python ints), whatever dtype carries it exactly."""

    coef: tuple
    offset: int

    def canon(self, shape) -> "Affine":
        """The same values, with the coefficient of every size-1 axis 0 (it multiplies 0)."""
        return Affine(tuple(0 if n == 1 else c for c, n in zip(self.coef, shape)), self.offset)

    def bounds(self, shape) -> tuple[int, int]:
        """The smallest and the largest value over a value of `shape`."""
        spans = [c * (n - 1) for c, n in zip(self.coef, shape)]
        low = self.offset + sum(min(0, x) for x in spans)
        return low, self.offset + sum(max(0, x) for x in spans)

    def minus(self, other: "Affine") -> "Affine":
        coef = tuple(a - b for a, b in zip(self.coef, other.coef))
        return Affine(coef, self.offset - other.offset)


@dataclasses.dataclass(frozen=True)
class Split:
    """`yes` inside `region`, `no` outside (0-d arrays, or `UNKNOWN`): the region is where
    every one of its integer index expressions is >= 0 (one half-plane: a causal mask; two: a
    causal mask and a sliding window), each normalised and the tuple sorted, so that equal
    regions compare equal."""

    region: tuple
    yes: Any
    no: Any

    def known(self) -> bool:
        return self.yes is not UNKNOWN and self.no is not UNKNOWN


def half_plane(a: Affine, strict: bool) -> Optional[Affine]:
    """The normalised predicate of `a >= 0` (`a > 0` when strict), None where it is constant."""
    if strict:
        a = Affine(a.coef, a.offset - 1)  # integers: a > 0 is a - 1 >= 0
    g = math.gcd(*a.coef)
    if g == 0:
        return None
    # (a / g) . i >= -offset / g  <=>  (a / g) . i + floor(offset / g) >= 0, for integer i
    return Affine(tuple(c // g for c in a.coef), a.offset // g)


def negated(h: Affine) -> Affine:
    """The half-plane outside `h`: not (a >= 0) is -a - 1 >= 0, for integers."""
    return Affine(tuple(-c for c in h.coef), -h.offset - 1)


def region_split(planes, yes, no) -> Any:
    """`Split` of the region where every one of `planes` (normalised half-planes, or None for one
    that is constant: `(None, truth)` pairs) holds; the one value it is where the region is
    everywhere or nowhere."""
    kept = []
    for plane, truth in planes:
        if plane is None:
            if not truth:
                return no
            continue
        kept.append(plane)
    if not kept:
        return yes
    return Split(tuple(sorted(set(kept), key=lambda h: (h.coef, h.offset))), yes, no)


def from_array(c: np.ndarray, shape) -> Any:
    """A compressed constant (size 1 along the axes it is constant on) as a form: a 0-d array,
    an `Affine` where its values are integers that are one, else `UNKNOWN` (known, but no form
    here can carry it: sound wherever values are read as unknown)."""
    if c.size == 1:
        return np.asarray(c).reshape(())
    if c.dtype == bool or np.ndim(c) != len(shape):
        return UNKNOWN
    if not np.issubdtype(c.dtype, np.integer):
        if not np.issubdtype(c.dtype, np.floating) or not np.array_equal(c, np.round(c)):
            return UNKNOWN
    origin = int(c.reshape(-1)[0])
    coef = []
    for d, n in enumerate(c.shape):
        if n == 1:
            coef.append(0)
            continue
        at = [0] * c.ndim
        at[d] = 1
        coef.append(int(c[tuple(at)]) - origin)
    rebuilt = origin + sum(
        np.arange(n).reshape([n if j == d else 1 for j in range(c.ndim)]) * k
        for d, (k, n) in enumerate(zip(coef, c.shape))
    )
    return Affine(tuple(coef), origin) if np.array_equal(rebuilt, c) else UNKNOWN


def exact_in(a: Affine, shape, dtype) -> bool:
    """Whether every value of `a` over `shape` is exact in `dtype`."""
    dtype = np.dtype(dtype)
    low, high = a.bounds(shape)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return info.min <= low and high <= info.max
    bits = _EXACT_BITS.get(dtype.name)
    return bits is not None and max(-low, high) <= 2**bits


_COMPARE = {"ge": (False, False), "gt": (False, True), "le": (True, False), "lt": (True, True)}


def elementwise(name: str, ins: list, shape: tuple, out_dtype, bind: Callable) -> Any:
    """The form of an element-by-element operation's result (of `shape`, `out_dtype`), or None
    where no form here is.

    `ins` are forms (0-d arrays, `UNKNOWN`, `Affine`, `Split`) of operands of `shape`, or of
    the same rank with size-1 axes, or 0-d; `bind` runs the operation on 0-d arrays (the two
    values of `Split`s)."""
    affine = [x for x in ins if isinstance(x, Affine)]
    splits = [x for x in ins if isinstance(x, Split)]
    if affine and splits:
        return None
    if affine:
        return _on_affine(name, ins, shape, out_dtype)
    if not splits:
        return None  # (scalars and unknowns: what `Scope.concrete` and `Scope.partial` read)
    region = splits[0].region
    if any(x.region != region for x in splits):
        # Regions differ: an `and` of masks false outside their regions (a causal mask and a
        # window, with data inside) is one outside the intersection; no other form is here.
        if (
            name != "and"
            or len(splits) != len(ins)
            or any(x.no is UNKNOWN or bool(x.no) for x in splits)
        ):
            return None
        planes = [(h, True) for x in splits for h in x.region]
        yes = _branch(name, [x.yes for x in splits], bind)
        return region_split(planes, yes, np.asarray(False))
    branches = []
    for side in ("yes", "no"):
        vals = [getattr(x, side) if isinstance(x, Split) else x for x in ins]
        branches.append(_branch(name, vals, bind))
    return Split(region, branches[0], branches[1])


def _branch(name: str, vals: list, bind: Callable) -> Any:
    """One value of an operation whose operands are 0-d arrays or `UNKNOWN`: `and` / `or` /
    `select_n` decided by the operands that are known."""
    known = [v for v in vals if v is not UNKNOWN]
    if len(known) == len(vals):
        return np.asarray(bind(vals)).reshape(())
    booleans = all(v.dtype == bool for v in known)
    if name == "and" and booleans and any(not v for v in known):
        return np.asarray(False)
    if name == "or" and booleans and any(bool(v) for v in known):
        return np.asarray(True)
    if name == "select_n":
        pred, cases = vals[0], vals[1:]
        if pred is not UNKNOWN:
            return cases[int(pred)]
        if all(c is not UNKNOWN for c in cases) and all(c == cases[0] for c in cases):
            return cases[0]
    return UNKNOWN


def _on_affine(name: str, ins: list, shape: tuple, out_dtype) -> Any:
    if any(x is UNKNOWN or isinstance(x, Split) for x in ins):
        return UNKNOWN if name not in _COMPARE else None
    rank = len(shape)
    forms = []
    for x in ins:
        if isinstance(x, Affine):
            forms.append(x)
        elif np.issubdtype(x.dtype, np.integer):
            forms.append(Affine((0,) * rank, int(x)))
        elif np.issubdtype(x.dtype, np.floating) and np.isfinite(x) and x == np.round(x):
            forms.append(Affine((0,) * rank, int(x)))
        else:
            return None
    if name in _COMPARE:
        a, b = forms
        flip, strict = _COMPARE[name]
        diff = b.minus(a) if flip else a.minus(b)
        truth = diff.offset - (1 if strict else 0) >= 0
        plane = (half_plane(diff.canon(shape), strict), truth)
        return region_split([plane], np.asarray(True), np.asarray(False))
    if name in ("add", "sub"):
        a, b = forms
        out = a.minus(Affine(tuple(-c for c in b.coef), -b.offset)) if name == "add" else a.minus(b)
    elif name == "neg":
        out = Affine(tuple(-c for c in forms[0].coef), -forms[0].offset)
    elif name == "mul" and sum(isinstance(x, Affine) for x in ins) == 1:
        a, k = (forms[0], forms[1]) if isinstance(ins[0], Affine) else (forms[1], forms[0])
        out = Affine(tuple(c * k.offset for c in a.coef), a.offset * k.offset)
    elif name in ("convert_element_type", "copy", "copy_p"):
        out = forms[0]
    else:
        return None
    return out if exact_in(out, shape, out_dtype) else None


def relaid(a: Affine, coef_of: Callable[[int], int], offset: int, shape) -> Affine:
    """`a` laid out anew: output axis k's coefficient `coef_of(k)`, `offset` added."""
    return Affine(tuple(coef_of(k) for k in range(len(shape))), a.offset + offset).canon(shape)


def laid_out(x: Any, move: Callable[[Affine], Optional[Affine]]) -> Any:
    """A layout operation (`move`, on index expressions) applied to a form."""
    if isinstance(x, Affine):
        return move(x)
    if isinstance(x, Split):
        planes = []
        for h in x.region:
            moved = move(h)
            if moved is None:
                return None
            planes.append((half_plane(moved, False), moved.offset >= 0))
        return region_split(planes, x.yes, x.no)
    return x  # 0-d arrays and UNKNOWN: the same everywhere


def lower(rank: int, t: int, s: int) -> Affine:
    """`i_t - i_s >= 0` over a [.., T, .., S] layout (query axis `t`, key axis `s`): a query
    sees the keys up to itself, the causal mask."""
    return Affine(tuple(1 if k == t else -1 if k == s else 0 for k in range(rank)), 0)


def causal_window(region: tuple, t: int, s: int) -> Optional[tuple[bool, Optional[int]]]:
    """(True, window) where `region` is the causal mask (`window` None) or the causal mask and
    a sliding window in which query i sees keys i - window .. i; None for any other region."""
    if not region:
        return None
    rank = len(region[0].coef)
    causal = lower(rank, t, s)
    if causal not in region:
        return None
    rest = [h for h in region if h != causal]
    if not rest:
        return True, None
    (h,) = rest if len(rest) == 1 else (None,)
    if h is None or h.coef != negated(causal).coef or h.offset < 0:
        return None
    return True, h.offset  # i_s - i_t + window >= 0


def covers_upper(region: tuple, yes: bool, no: bool, t: int, s: int) -> bool:
    """Whether a value that is `yes` inside `region` and `no` outside holds wherever a causal
    mask hides (key after query, `i_s > i_t`)."""
    if yes and no:
        return True
    if not region:
        return False
    causal = lower(len(region[0].coef), t, s)
    return (no and causal in region) or (yes and region == (negated(causal),))
