"""Values known by their form, not element by element: the masks of long sequences.

A causal mask over 65,536 positions has 4.3G elements; evaluated while tracing, it exhausted a
24 GiB host (and past 4096 x 4096 it was not evaluated, so the attention computed every score).
Built from `iota`, though, it has a form that any length shares: `Affine` is an index
expression `offset + sum(coef[d] * i_d)` over the axes of a value's shape, and `Split` a value
that is `yes` where an integer `Affine` is >= 0 and `no` elsewhere, either possibly `UNKNOWN`
(data: what a mask of data and constants holds whatever the data is, as `Scope.partial` reads on
arrays). A comparison of two index expressions is a `Split`; operations element by element on
`Split`s of one predicate act on their two values; broadcasts, transposes, reshapes of size-1
axes and slices act on the predicate. `Scope.symbolic` reads a program so
(`jamp.engine._attention_scope`); `causal` says whether a predicate is the causal one.
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
    """`yes` where `pred` >= 0, `no` elsewhere (0-d arrays, or `UNKNOWN`); `pred` normalised, so
    that equal predicates compare equal (coefficients without a common factor)."""

    pred: Affine
    yes: Any
    no: Any

    def known(self) -> bool:
        return self.yes is not UNKNOWN and self.no is not UNKNOWN


def _is_scalar(x) -> bool:
    return isinstance(x, np.ndarray) and x.ndim == 0


def half_plane(a: Affine, strict: bool) -> Optional[Affine]:
    """The normalised predicate of `a >= 0` (`a > 0` when strict), None where it is constant."""
    if strict:
        a = Affine(a.coef, a.offset - 1)  # integers: a > 0 is a - 1 >= 0
    g = math.gcd(*a.coef)
    if g == 0:
        return None
    # (a / g) . i >= -offset / g  <=>  (a / g) . i + floor(offset / g) >= 0, for integer i
    return Affine(tuple(c // g for c in a.coef), a.offset // g)


def split(pred: Optional[Affine], yes, no, constant_truth: bool) -> Any:
    """`Split(pred, yes, no)`, or the one value it is where the predicate is constant."""
    if pred is None:
        return yes if constant_truth else no
    return Split(pred, yes, no)


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
    pred = splits[0].pred
    if any(s.pred != pred for s in splits):
        return None  # two predicates: a region no form here has
    branches = []
    for side in ("yes", "no"):
        vals = [getattr(x, side) if isinstance(x, Split) else x for x in ins]
        branches.append(_branch(name, vals, bind))
    return Split(pred, branches[0], branches[1])


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
        pred = half_plane(diff.canon(shape), strict)
        truth = diff.offset - (1 if strict else 0) >= 0
        return split(pred, np.asarray(True), np.asarray(False), truth)
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
        pred = move(x.pred)
        if pred is None:
            return None
        norm = half_plane(pred, False)
        return split(norm, x.yes, x.no, pred.offset >= 0)
    return x  # 0-d arrays and UNKNOWN: the same everywhere


def causal(pred: Affine, t: int, s: int) -> Optional[bool]:
    """Over a [.., T, .., S] layout (query axis `t`, key axis `s`): True where `pred` is the
    causal one, `i_t >= i_s` (a query sees keys up to itself), False where it is its complement
    (`i_s > i_t`), None otherwise."""
    rank = len(pred.coef)
    lower = Affine(tuple(1 if k == t else -1 if k == s else 0 for k in range(rank)), 0)
    upper = Affine(tuple(-c for c in lower.coef), -1)
    return True if pred == lower else False if pred == upper else None
