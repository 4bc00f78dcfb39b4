"""The symbolic values attention is made of (`Sym`, `Attn`), and what is known of the side
values combined with them (scales, biases, masks), in the first matmul's output layout (see
`jamp.engine._attention`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax.numpy as jnp
import numpy as np

from jamp.engine import _attention_forms as F
from jamp.engine._attention_scope import Scope, of_constant

#: A fill at or below this is a mask (its exponential is 0 in float32 beside any real logit).
MASKED = -1e4


# ---------------------------------------------------------------------------------------------
# The symbolic values.


@dataclasses.dataclass(eq=False)
class Attn:
    """What one attention is made of so far (arrays in the first matmul's output layout)."""

    first: Any  # the first dot_general equation
    q: Any
    k: Any
    q_is_lhs: Optional[bool]  # which operand holds the queries: known once the softmax axis is
    compute_dtype: np.dtype
    scale: float = 1.0
    q_factor: Any = None  # a traced scalar folded into q (a scale that is not a constant)
    bias: Any = None
    # (keep: array, or None where known; known: a constant (bools), a `Split` of bools, or None)
    masks: list = dataclasses.field(default_factory=list)
    # where some mask or bias hides the scores whatever the program's inputs (constant bools,
    # or a `Split` of bools: a long sequence's)
    hidden: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Sym:
    """A value that attention is made of, not computed yet.

    kind: "logits" (the scores, scaled, biased, masked), "max" / "sum" (a reduction of logits /
    of exp over the softmax axis, `kept` whether that axis is still there with size 1),
    "shifted" (logits - max), "exp", "probs" (the softmax), "bcast" (a side value broadcast
    lazily: `value` into `shape` along `dims`).
    `perm[i]` is the tuple of the first matmul's output axes that axis i is made of (one, or
    several merged by a reshape, in order); `axis` the softmax axis (an output axis of the first
    matmul); `src` the value a reduction or a step came from.
    `replay()` computes the value as traced (memoised), for any use that is not attention.
    """

    kind: str
    shape: tuple
    attn: Optional[Attn] = None
    perm: tuple = ()
    axis: Optional[int] = None
    src: Optional["Sym"] = None
    kept: bool = False
    value: Any = None
    dims: tuple = ()
    scope: Optional[Scope] = None
    atom: Any = None
    replay: Callable[[], Any] = dataclasses.field(default=lambda: None, repr=False)


def real(x):
    return x.replay() if isinstance(x, Sym) else x


def _small(x):
    """A side value as an array; a lazy broadcast as its source with size-1 axes (so a mask
    broadcast over heads or queries stays small)."""
    if isinstance(x, Sym):
        src_shape = np.shape(x.value)
        return jnp.reshape(
            x.value,
            [src_shape[x.dims.index(i)] if i in x.dims else 1 for i in range(len(x.shape))],
        )
    return jnp.asarray(x)


def in_layout(x, sym: Sym, xp=jnp):
    """A side value combined with `sym` (same rank or a scalar) in the first matmul's output
    layout: its merged axes split, transposed back from `sym`'s layout; None if it cannot be
    (a side value that varies within a merged axis in another way)."""
    assert sym.attn is not None  # an attention's value, not a broadcast side value
    x = _small(x) if xp is jnp else np.asarray(x)
    if x.ndim == 0:
        return x.reshape((1,) * len(sym.attn.first.outvars[0].aval.shape))
    full = sym.attn.first.outvars[0].aval.shape
    shape = []
    for size, group in zip(x.shape, sym.perm):
        if size == 1:
            shape += [1] * len(group)
        elif size == int(np.prod([full[a] for a in group])):
            shape += [full[a] for a in group]
        else:
            return None
    order = [a for group in sym.perm for a in group]
    return xp.transpose(x.reshape(shape), tuple(int(i) for i in np.argsort(order)))


def one(sym: Sym, i: int) -> Optional[int]:
    """The first matmul's output axis that axis i of `sym` is, if it is one axis."""
    group = sym.perm[i]
    return group[0] if len(group) == 1 else None


def regroup(sym: Sym, shape) -> Optional[tuple]:
    """The layout of `sym` reshaped to `shape`, if the reshape only merges or splits its axes
    along the first matmul's output axes (a reshape of heads into groups and back)."""
    assert sym.attn is not None  # an attention's value, not a broadcast side value
    full = sym.attn.first.outvars[0].aval.shape
    atoms = [a for group in sym.perm for a in group]
    groups, at = [], 0
    for size in shape:
        group, n = [], 1
        while n < size and at < len(atoms):
            group.append(atoms[at])
            n *= full[atoms[at]]
            at += 1
        while at < len(atoms) and full[atoms[at]] == 1 and n == size and size != 1:
            group.append(atoms[at])  # a size-1 axis rides along with its neighbour
            at += 1
        if n != size:
            return None
        groups.append(tuple(group))
    return tuple(groups) if at == len(atoms) else None


def _side(x, atom, scope: Optional[Scope], reading: str) -> Any:
    """Side value `x` (of variable `atom`) as a `Scope` reads it (`concrete`, `partial`,
    `symbolic`, `values`): a lazy broadcast's source as its own scope reads it, a constant array
    by its value; None where no scope reads it."""
    if isinstance(x, Sym) and x.kind == "bcast":
        scope, atom = x.scope, x.atom
    elif isinstance(x, (np.ndarray, np.generic, int, float, bool)):
        return of_constant(reading, np.asarray(x), np.shape(x))
    return None if scope is None or atom is None else getattr(scope, reading)(atom)


def _concrete_of(x, atom, scope: Optional[Scope]):
    return _side(x, atom, scope, "concrete")


def scalar(x, atom, scope) -> Optional[Any]:
    """A side value that is one number: its concrete value (a Python float) or the traced one."""
    if isinstance(x, Sym):
        if x.kind != "bcast" or np.size(x.value) != 1:
            return None
        c = _concrete_of(x, atom, scope)
        return float(c.reshape(())) if c is not None else jnp.reshape(x.value, ())
    if np.size(x) != 1:
        return None
    c = _concrete_of(x, atom, scope)
    return float(np.reshape(c, ())) if c is not None else jnp.reshape(x, ())


def _placed(c: np.ndarray, x, sym: Sym) -> Optional[np.ndarray]:
    """A constant of side value `x` (compressed: size 1 along the axes it is constant on, which
    stay so) in the first matmul's output layout."""
    if isinstance(x, Sym):  # the source of a lazy broadcast: placed as `_small` places it
        c = np.reshape(c, (1,) * np.ndim(x.value)) if np.ndim(c) == 0 else c
        c = c.reshape([c.shape[x.dims.index(i)] if i in x.dims else 1 for i in range(len(x.shape))])
    return in_layout(c, sym, np)


def concrete_in_layout(x, atom, scope, sym: Sym) -> Optional[np.ndarray]:
    c = _concrete_of(x, atom, scope)
    return None if c is None else _placed(c, x, sym)


def few_values(x, atom, scope: Optional[Scope]) -> Optional[np.ndarray]:
    """The few values side value `x` can take whatever the inputs are (`Scope.values`)."""
    return _side(x, atom, scope, "values")


def mask_values(values: np.ndarray) -> bool:
    """Whether a bias of these values is a mask: each 0 or very negative, some of them that."""
    hides = values <= MASKED
    return bool((hides | (values == 0)).all() and hides.any())


def _form_of(x, atom, scope: Optional[Scope]) -> Any:
    """The form of side value `x` (`Scope.symbolic`) where it is a `Split`, else None."""
    form = _side(x, atom, scope, "symbolic")
    return form if isinstance(form, F.Split) else None


def _form_placed(form: F.Split, x, sym: Sym) -> Any:
    """A `Split` of side value `x` with its region over the first matmul's output axes (as
    `_placed` places arrays: a merged axis is the index expression of the axes it merges); the
    one value it is where the region is everywhere or nowhere there; None where it cannot be."""
    assert sym.attn is not None  # an attention's value, not a broadcast side value
    full = sym.attn.first.outvars[0].aval.shape
    planes = []
    for h in form.region:
        coef = list(h.coef)
        if isinstance(x, Sym):  # the source of a lazy broadcast
            coef = [coef[x.dims.index(i)] if i in x.dims else 0 for i in range(len(x.shape))]
        if len(coef) != len(sym.perm):
            return None
        out = [0] * len(full)
        for c, group in zip(coef, sym.perm):
            stride = 1
            for a in reversed(group):
                out[a] += c * stride
                stride *= full[a]
        placed = F.Affine(tuple(out), h.offset).canon(full)
        planes.append((F.half_plane(placed, False), placed.offset >= 0))
    return F.region_split(planes, form.yes, form.no)


def known_form(x, atom, scope, sym: Sym) -> Optional[F.Split]:
    """A side value known everywhere by its form (a long sequence's constant mask), placed."""
    form = _form_of(x, atom, scope)
    if form is None or not form.known():
        return None
    placed = _form_placed(form, x, sym)
    return placed if isinstance(placed, F.Split) else None


def surely(x, atom, scope, sym: Sym, where) -> Any:
    """Where `where(values)` holds of side value `x` whatever the program's inputs are (see
    `Scope.partial`), in the first matmul's output layout (bools, or a `Split` of them where
    only its form is known); None where nowhere."""
    part = _side(x, atom, scope, "partial")
    if part is None:
        form = _form_of(x, atom, scope)
        if form is None:
            return None
        hits = [v is not F.UNKNOWN and bool(where(v)) for v in (form.yes, form.no)]
        placed = _form_placed(F.Split(form.region, *hits), x, sym) if any(hits) else None
        return placed if isinstance(placed, F.Split) else None
    values, known = part
    hit = np.logical_and(known, where(values))
    return _placed(hit, x, sym) if hit.any() else None


def like(sym: Sym, **changes) -> Sym:
    return dataclasses.replace(sym, **changes)
