"""The symbolic values attention is made of and the rules that step them through one operation
each (see `jamp.engine._attention`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax.numpy as jnp
import numpy as np

from jamp import jax_compat
from jamp.engine import _attention_forms as F
from jamp.engine._attention_scope import Scope, of_constant

#: A fill at or below this is a mask (its exponential is 0 in float32 beside any real logit).
_MASKED = -1e4


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


def _in_layout(x, sym: Sym, xp=jnp):
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


def _one(sym: Sym, i: int) -> Optional[int]:
    """The first matmul's output axis that axis i of `sym` is, if it is one axis."""
    group = sym.perm[i]
    return group[0] if len(group) == 1 else None


def _regroup(sym: Sym, shape) -> Optional[tuple]:
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


def _scalar(x, atom, scope) -> Optional[Any]:
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
    return _in_layout(c, sym, np)


def _concrete_in_layout(x, atom, scope, sym: Sym) -> Optional[np.ndarray]:
    c = _concrete_of(x, atom, scope)
    return None if c is None else _placed(c, x, sym)


def _few_values(x, atom, scope: Optional[Scope]) -> Optional[np.ndarray]:
    """The few values side value `x` can take whatever the inputs are (`Scope.values`)."""
    return _side(x, atom, scope, "values")


def _mask_values(values: np.ndarray) -> bool:
    """Whether a bias of these values is a mask: each 0 or very negative, some of them that."""
    hides = values <= _MASKED
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


def _known_form(x, atom, scope, sym: Sym) -> Optional[F.Split]:
    """A side value known everywhere by its form (a long sequence's constant mask), placed."""
    form = _form_of(x, atom, scope)
    if form is None or not form.known():
        return None
    placed = _form_placed(form, x, sym)
    return placed if isinstance(placed, F.Split) else None


def _surely(x, atom, scope, sym: Sym, where) -> Any:
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


# ---------------------------------------------------------------------------------------------
# The rules: one operation on symbolic values, or None where it is not attention's.


@dataclasses.dataclass
class Engine:
    """What the rules need from the interpreter: evaluate an equation as the engine would
    (inputs real), the compute dtype an equation runs in (None: as traced), the dtype its
    matmul result is carried in, and where to say that a result is one the backward pass keeps
    anyway (a fused kernel's output, which its own backward reads)."""

    evaluate: Callable[[Any, list], list]
    dtype_for: Callable[[Any], Optional[np.dtype]]
    out_dtype: Callable[[Any, np.dtype], np.dtype]
    saved: Callable[[Any, list], None] = lambda x, perm: None  # x = transpose(kept, perm)
    # (source, axis, group) where x = jnp.repeat(source, group, axis), else None
    repeated: Callable[[Any], Optional[tuple]] = lambda x: None


def _like(sym: Sym, **changes) -> Sym:
    return dataclasses.replace(sym, **changes)


def _free(dims, rank) -> list[int]:
    (c, _), (b, _) = dims
    return [i for i in range(rank) if i not in c and i not in b]


def _softmax_axis(attn: Attn, axis: int) -> bool:
    """Fixes which operand of the first matmul holds the queries from the softmax axis (an
    output axis of that matmul): the keys' only free axis. False if it is no such axis."""
    dims = jax_compat.param(attn.first, "dimension_numbers")
    lhs, rhs = (v.aval for v in attn.first.invars)
    (_, _), (lb, _) = dims
    lf, rf = (
        _free(dims, lhs.ndim),
        _free(((dims[0][1], dims[0][0]), (dims[1][1], dims[1][0])), rhs.ndim),
    )
    nb = len(lb)
    if nb + len(lf) <= axis and len(rf) == 1:
        q_is_lhs = True
    elif nb <= axis < nb + len(lf) and len(lf) == 1:
        q_is_lhs = False
    else:
        return False
    if attn.q_is_lhs not in (None, q_is_lhs):
        return False
    attn.q_is_lhs = q_is_lhs
    return True


def _scaled(sym: Sym, factor) -> Optional[Sym]:
    attn = sym.attn
    assert attn is not None  # the scores'
    if isinstance(factor, float):
        if not factor > 0:
            return None
        attn.scale *= factor
    else:  # a traced scalar: folded into q, where it scales q . k the same
        if attn.masks or attn.hidden:
            return None  # (its sign, which decides whether masked stays masked, is unknown)
        attn.q_factor = factor if attn.q_factor is None else attn.q_factor * factor
    if attn.bias is not None:
        attn.bias = attn.bias * factor
    return _like(sym)


def logits_rule(eqn, vals, atoms, scope) -> Optional[list]:
    """An operation on the (scaled, biased, masked) scores."""
    name = eqn.primitive.name
    i = next(j for j, x in enumerate(vals) if isinstance(x, Sym) and x.kind == "logits")
    orig = vals[i]
    attn = dataclasses.replace(  # values may branch
        orig.attn, masks=list(orig.attn.masks), hidden=list(orig.attn.hidden)
    )
    sym = _like(orig, attn=attn)
    others = [(x, a) for j, (x, a) in enumerate(zip(vals, atoms)) if j != i]
    if name == "sub" and i == 0 and isinstance(vals[1], Sym) and vals[1].kind == "max":
        if vals[1].src is orig and vals[1].kept:
            return [Sym("shifted", sym.shape, vals[1].attn, sym.perm, vals[1].axis, src=orig)]
    if any(isinstance(x, Sym) and x.kind != "bcast" for x, _ in others):
        return None
    if name == "convert_element_type" or name == "copy" or name == "copy_p":
        return [_like(sym)]
    if name in ("transpose", "reshape"):
        return _relaid(sym, eqn)
    if name in ("mul", "div") and len(others) == 1:
        if name == "div" and i != 0:
            return None
        factor = _scalar(*others[0], scope)
        if factor is None:
            return None
        if name == "div":
            factor = 1.0 / factor
        return None if _scaled(sym, factor) is None else [_like(sym)]
    if name in ("add", "add_any", "sub") and len(others) == 1:
        if name == "sub" and i != 0:
            return None
        sign = -1.0 if name == "sub" else 1.0
        known = _concrete_in_layout(*others[0], scope, sym)
        if known is not None:  # a constant bias of 0 and very negative values is a mask
            known = np.asarray(known, np.float32) * sign
            hidden = known <= _MASKED
            if (hidden | (known == 0)).all():
                attn.masks.append((None, np.logical_not(hidden)))
                return [_like(sym)]
        form = None if known is not None else _known_form(*others[0], scope, sym)
        if form is not None:  # the same, known by its form (a long sequence's)
            hides = [float(v) * sign <= _MASKED for v in (form.yes, form.no)]
            if all(h or float(v) == 0 for h, v in zip(hides, (form.yes, form.no))):
                side = _in_layout(others[0][0], sym)
                if side is None:
                    return None
                keep = side.astype(np.float32) * sign > _MASKED  # (used if the form is not read)
                attn.masks.append((keep, F.Split(form.region, not hides[0], not hides[1])))
                return [_like(sym)]
        side = _in_layout(others[0][0], sym)
        if side is None:
            return None
        # Where the bias hides the scores whatever the inputs (Hugging Face's causal mask made a
        # bias together with the attention mask it is given): see `_attention._masks`.
        surely = _surely(
            *others[0], scope, sym, lambda b: np.asarray(b, np.float32) * sign <= _MASKED
        )
        if surely is not None:
            attn.hidden.append(surely)
        side = side.astype(np.float32)
        few = _few_values(*others[0], scope)
        if few is not None and _mask_values(few.astype(np.float32) * sign):
            # A bias that is 0 or very negative whatever the data (Hugging Face's, made of the
            # attention mask it is given) is that mask: cuDNN then computes no bias gradient.
            attn.masks.append((side * sign > _MASKED, None))
            return [_like(sym)]
        side = -side if name == "sub" else side
        attn.bias = side if attn.bias is None else attn.bias + side
        return [_like(sym)]
    if name == "select_n" and len(vals) == 3 and i in (1, 2):
        pred, pred_atom = vals[0], atoms[0]
        fill, fill_atom = vals[3 - i], atoms[3 - i]
        if (
            isinstance(pred, Sym)
            and pred.kind != "bcast"
            or np.dtype(eqn.invars[0].aval.dtype) != np.dtype(bool)
        ):
            return None
        value = _scalar(fill, fill_atom, scope)
        if not isinstance(value, float) or not value <= _MASKED:
            return None
        keep = _in_layout(pred, sym)
        if keep is None:
            return None
        constant: Any = _concrete_in_layout(pred, pred_atom, scope, sym)
        if constant is None:  # a long sequence's, known by its form
            constant = _known_form(pred, pred_atom, scope, sym)
        kept_where = i == 2  # select_n picks case 1 where the predicate is True
        if i == 1:
            keep = jnp.logical_not(keep)
            if isinstance(constant, F.Split):
                constant = F.Split(constant.region, not constant.yes, not constant.no)
            elif constant is not None:
                constant = np.logical_not(constant)
        if constant is None:  # a mask of data and constants: where it hides whatever the data
            surely = _surely(
                pred, pred_atom, scope, sym, lambda p: np.asarray(p, bool) != kept_where
            )
            if surely is not None:
                attn.hidden.append(surely)
        attn.masks.append((keep, constant))
        return [_like(sym)]
    if name == "reduce_max":
        (axis,) = (
            jax_compat.param(eqn, "axes") if len(jax_compat.param(eqn, "axes")) == 1 else (None,)
        )
        first_axis = None if axis is None else _one(sym, axis)
        if first_axis is None or not _softmax_axis(attn, first_axis):
            return None
        return [Sym("max", eqn.outvars[0].aval.shape, attn, sym.perm, first_axis, src=orig)]
    return None


def _relaid(sym: Sym, eqn) -> Optional[list]:
    """A transpose or reshape of the scores or the weights: the same values, laid out anew."""
    shape = tuple(eqn.outvars[0].aval.shape)
    if eqn.primitive.name == "transpose":
        perm = jax_compat.param(eqn, "permutation")
        return [_like(sym, perm=tuple(sym.perm[p] for p in perm), shape=shape)]
    if jax_compat.param(eqn, "dimensions") is not None:
        return None
    groups = _regroup(sym, shape)
    return None if groups is None else [_like(sym, perm=groups, shape=shape)]


def _kept_axis(sym: Sym, eqn) -> bool:
    """Whether `eqn` (a broadcast or reshape of a reduction) puts the reduced axis back."""
    src = sym.src
    assert src is not None  # a reduction's
    where = src.perm.index((sym.axis,))
    out = tuple(eqn.outvars[0].aval.shape)
    want = src.shape[:where] + (1,) + src.shape[where + 1 :]
    full = tuple(src.shape)
    if eqn.primitive.name == "reshape":
        return out == want
    dims = tuple(jax_compat.param(eqn, "broadcast_dimensions"))
    return out in (want, full) and dims == tuple(d for d in range(len(out)) if d != where)


def softmax_rule(eqn, vals, atoms, scope) -> Optional[list]:
    """An operation of the softmax over the key axis (`jax.nn.softmax` as traced)."""
    name = eqn.primitive.name
    syms = [x for x in vals if isinstance(x, Sym)]
    sym = syms[0]
    if sym.kind in ("max", "sum") and not sym.kept:
        if name == "max" and len(syms) == 1:  # max(x_max, -inf): the initial value
            other = vals[1] if vals[0] is sym else vals[0]
            value = _scalar(other, atoms[vals.index(other)], scope)
            return [_like(sym)] if isinstance(value, float) and value <= _MASKED else None
        if name in ("broadcast_in_dim", "reshape") and _kept_axis(sym, eqn):
            return [_like(sym, kept=True)]
        return None
    if sym.kind in ("max", "sum") and name == "stop_gradient":
        return [_like(sym)]
    if sym.kind == "shifted" and name == "exp":
        return [_like(sym, kind="exp")]
    if sym.kind == "exp" and name == "reduce_sum":
        axes = tuple(jax_compat.param(eqn, "axes"))
        if axes != (sym.perm.index((sym.axis,)),):
            return None
        return [Sym("sum", eqn.outvars[0].aval.shape, sym.attn, sym.perm, sym.axis, src=sym)]
    if name == "div" and len(syms) == 2 and vals[0].kind == "exp" and vals[1].kind == "sum":
        if vals[1].src is vals[0] and vals[1].kept:
            return [_like(vals[0], kind="probs")]
    if sym.kind == "probs" and name in ("convert_element_type", "copy"):
        return [_like(sym)]
    if sym.kind == "probs" and name in ("transpose", "reshape"):
        return _relaid(sym, eqn)
    return None
