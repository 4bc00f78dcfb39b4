"""Attention recognised in a traced program and run as one call (`jamp.attention.attend`).

What the engine looks for is attention as programs write it, in any layout:
`softmax(q . k * scale + bias, masked) . v` -- two `dot_general`s around a softmax over the key
axis, with scalings, additive biases, `where(mask, logits, very negative)` and transposes between
the first one and the softmax (Flax linen / NNX `dot_product_attention`, the XLA form of
`jax.nn.dot_product_attention`, Hugging Face's and hand-written attention, grouped-query heads
included). Evaluation is lazy from the first matmul on: its result, and what is computed from it,
are kept as symbolic values (`Sym`) while each operation is one that attention is made of; the
second matmul then runs the whole as one fused call. Any other use of an intermediate (attention
dropout multiplying the weights, a returned score matrix, a softmax over the queries) evaluates it
as traced instead, exactly as if nothing had been recognised, and the reason is recorded.

Masks and fills are read from the program: a mask computed from constants alone (a causal mask
built from `iota`) is evaluated while tracing, and a lower-triangular one becomes cuDNN's causal
mask type instead of a [T, S] array.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jamp import attention, jax_compat, traced_for
from jamp.engine import _values as V

#: Operations scanned after a candidate first matmul before giving up on finding its softmax.
_HORIZON = 48
#: The largest constant (elements) evaluated while tracing to read a mask or a fill.
_MAX_CONCRETE = 1 << 24
#: A fill at or below this is a mask (its exponential is 0 in float32 beside any real logit).
_MASKED = -1e4


# ---------------------------------------------------------------------------------------------
# Which matmuls may start an attention: an exponential downstream, then another matmul.


def _has_exp(jaxpr: jcore.Jaxpr) -> bool:
    return any(
        e.primitive.name == "exp" or any(_has_exp(s) for s in jcore.jaxprs_in_params(e.params))
        for e in jaxpr.eqns
    )


def candidates(jaxpr: jcore.Jaxpr) -> set[int]:
    """ids of the `dot_general`s of `jaxpr` from which an exponential, then another
    `dot_general`, can be reached through at most `_HORIZON` other operations."""
    users: dict[Any, list] = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if isinstance(v, jcore.Var):
                users.setdefault(v, []).append(e)
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive is not V.DOT:
            continue
        frontier, seen, steps = [(v, False) for v in eqn.outvars], set(), 0
        while frontier and steps < _HORIZON:
            var, after_exp = frontier.pop()
            for user in users.get(var, ()):
                if user.primitive is V.DOT:
                    if after_exp:
                        found.add(id(eqn))
                    continue
                if user.primitive is V.CONV or (id(user), after_exp) in seen:
                    continue
                seen.add((id(user), after_exp))
                steps += 1
                exp = after_exp or user.primitive.name == "exp"
                exp = exp or any(_has_exp(s) for s in V.sub_jaxprs(user))
                frontier.extend((o, exp) for o in user.outvars)
    return found


# ---------------------------------------------------------------------------------------------
# Constants read while tracing.


class Scope:
    """A program being evaluated, for reading the value of a variable computed from constants
    alone: its constants, the equation that produced each variable, and (for a sub-program
    evaluated in place) the outer variables its inputs are."""

    def __init__(self, jaxpr, consts, parent: Optional[tuple["Scope", list]] = None):
        self.consts = dict(zip(jaxpr.constvars, consts))
        self.inputs = dict(zip(jaxpr.invars, parent[1])) if parent else {}
        self.parent = parent[0] if parent else None
        self.made_by = {o: e for e in jaxpr.eqns for o in e.outvars}
        self.memo: dict[Any, Optional[np.ndarray]] = {}

    def concrete(self, atom) -> Optional[np.ndarray]:
        """The value of `atom` if it is computed from constants alone, else None."""
        if isinstance(atom, jcore.Literal):
            return np.asarray(atom.val)
        if atom in self.memo:
            return self.memo[atom]
        self.memo[atom] = None  # (a cycle cannot occur; this also bounds the recursion's work)
        value = None
        if atom in self.consts:
            c = self.consts[atom]
            value = None if isinstance(c, jax.core.Tracer) else np.asarray(c)
        elif atom in self.inputs and self.parent is not None:
            value = self.parent.concrete(self.inputs[atom])
        elif atom in self.made_by:
            value = self._evaluate(self.made_by[atom], atom)
        self.memo[atom] = value
        return value

    def _evaluate(self, eqn, atom) -> Optional[np.ndarray]:
        if eqn.effects or any(np.prod(o.aval.shape) > _MAX_CONCRETE for o in eqn.outvars):
            return None
        if "rng" in eqn.primitive.name or "random" in eqn.primitive.name:
            return None
        ins = [self.concrete(v) for v in eqn.invars]
        if any(x is None for x in ins):
            return None
        try:
            with _on_host(), jax.ensure_compile_time_eval():
                outs = V.bind(eqn, ins, eqn.params)
        except Exception:  # anything that cannot run eagerly is simply not a constant
            return None
        for o, val in zip(eqn.outvars, outs):
            self.memo[o] = np.asarray(val)
        return self.memo[atom]


def _on_host():
    """Eager evaluation on the host's CPU, where there is one: the program may be traced for
    devices that are not here (a GPU target compiled on a CPU)."""
    try:
        return jax.default_device(jax.devices("cpu")[0])
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu): the default device
        return contextlib.nullcontext()


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
    masks: list = dataclasses.field(default_factory=list)  # (keep: array, constant or None)


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


def _concrete_of(x, atom, scope: Optional[Scope]):
    if isinstance(x, Sym) and x.kind == "bcast":
        return None if x.scope is None else x.scope.concrete(x.atom)
    if isinstance(x, (np.ndarray, np.generic, int, float, bool)):
        return np.asarray(x)
    return None if scope is None or atom is None else scope.concrete(atom)


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


def _concrete_in_layout(x, atom, scope, sym: Sym) -> Optional[np.ndarray]:
    c = _concrete_of(x, atom, scope)
    if c is None:
        return None
    if isinstance(x, Sym):  # the source of a lazy broadcast: placed as `_small` places it
        src = np.shape(x.value)
        c = c.reshape([src[x.dims.index(i)] if i in x.dims else 1 for i in range(len(x.shape))])
    return _in_layout(c, sym, np)


# ---------------------------------------------------------------------------------------------
# The rules: one operation on symbolic values, or None where it is not attention's.


@dataclasses.dataclass
class Engine:
    """What the rules need from the interpreter: evaluate an equation as the engine would
    (inputs real), the compute dtype an equation runs in (None: as traced), and the dtype its
    matmul result is carried in."""

    evaluate: Callable[[Any, list], list]
    dtype_for: Callable[[Any], Optional[np.dtype]]
    out_dtype: Callable[[Any, np.dtype], np.dtype]


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
    if isinstance(factor, float):
        if not factor > 0:
            return None
        attn.scale *= factor
    else:  # a traced scalar: folded into q, where it scales q . k the same
        if attn.masks:
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
    attn = dataclasses.replace(orig.attn, masks=list(orig.attn.masks))  # values may branch
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
        side = _in_layout(others[0][0], sym)
        if side is None:
            return None
        side = side.astype(np.float32)
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
        known = _concrete_in_layout(pred, pred_atom, scope, sym)
        if i == 1:  # select_n picks case 0 where the predicate is False: the logits are kept there
            keep = jnp.logical_not(keep)
            known = None if known is None else np.logical_not(known)
        attn.masks.append((keep, known))
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


# ---------------------------------------------------------------------------------------------
# The second matmul: the whole attention as one call.


def _to_bnts(x, roles_order, full_sizes, xp=jnp):
    """A side array in the first matmul's output layout -> [B | 1, N | 1, T, S].

    `roles_order` = (b0 axis or None, N-group axes, T axis, S axis); `full_sizes` the output
    shape of the first matmul."""
    b0, group, t, s = roles_order
    x = xp.asarray(x)
    order = ([b0] if b0 is not None else []) + group + [t, s]
    x = xp.transpose(x, order)
    if b0 is None:
        x = x[None]
    n_sizes = [full_sizes[a] for a in group]
    got = list(x.shape[1 : 1 + len(group)])
    if all(g == 1 for g in got):
        n = 1
    else:
        x = xp.broadcast_to(x, x.shape[:1] + tuple(n_sizes) + x.shape[1 + len(group) :])
        n = int(np.prod(n_sizes))
    return x.reshape((x.shape[0], n) + x.shape[-2:])


def _masks(attn: Attn, roles_order, full_sizes):
    """(mask array or None, causal): constant masks that are lower-triangular become the causal
    mask type, constant all-True ones vanish; the rest are combined into one boolean array."""
    known = [c for _, c in attn.masks if c is not None]
    mask = None
    for m, c in attn.masks:
        if c is None:
            m = _to_bnts(m, roles_order, full_sizes)
            mask = m if mask is None else jnp.logical_and(mask, m)
    causal = False
    if known:
        both = np.logical_and.reduce(np.broadcast_arrays(*known)) if len(known) > 1 else known[0]
        combined = _to_bnts(both, roles_order, full_sizes, np)
        first = combined[:1, :1]
        t, s = combined.shape[-2:]
        if (combined == first).all():
            if first.all():
                combined = None
            elif (first[0, 0] == np.tril(np.ones((t, s), bool))).all():
                causal, combined = True, None
        if combined is not None:
            mask = jnp.asarray(combined) if mask is None else jnp.logical_and(mask, combined)
    return mask, causal


def fuse(eqn, vals, engine: Engine, where: str) -> Optional[list]:
    """`eqn`, a `dot_general` of the softmax and the values: the attention as one call."""
    i = 0 if isinstance(vals[0], Sym) else 1
    p, v = vals[i], vals[1 - i]
    if isinstance(v, Sym) or p.kind != "probs" or p.attn.q_is_lhs is None:
        return None
    dtype = engine.dtype_for(eqn)
    if dtype is None or dtype.itemsize >= 4:
        return None
    attn = p.attn
    (c2, b2) = jax_compat.param(eqn, "dimension_numbers")
    p_c, v_c = (c2[0], c2[1]) if i == 0 else (c2[1], c2[0])
    p_b, v_b = (b2[0], b2[1]) if i == 0 else (b2[1], b2[0])
    (c1, b1) = jax_compat.param(attn.first, "dimension_numbers")
    ql = attn.q_is_lhs
    q, k = (attn.q, attn.k) if ql else (attn.k, attn.q)
    q_c, k_c = (c1[0], c1[1]) if ql else (c1[1], c1[0])
    q_b, k_b = (b1[0], b1[1]) if ql else (b1[1], b1[0])
    q_f = [a for a in range(np.ndim(q)) if a not in q_c and a not in q_b]
    (k_s,) = [a for a in range(np.ndim(k)) if a not in k_c and a not in k_b]
    nb, nq = len(q_b), len(q_f)
    # Roles of the first matmul's output axes: batch j, query axis j, the key axis.
    roles = [("b", j) for j in range(nb)]
    roles += (
        [("q", j) for j in range(nq)] + [("s", 0)]
        if ql
        else [("s", 0)] + [("q", j) for j in range(nq)]
    )
    if any(len(g) != 1 for g in p.perm):  # an axis of the weights still merged
        return None
    one = [g[0] for g in p.perm]
    if len(p_c) != 1 or roles[one[p_c[0]]] != ("s", 0) or len(p_b) != nb:
        return None
    v_batch = [None] * nb
    for pa, va in zip(p_b, v_b):
        role = roles[one[pa]]
        if role[0] != "b" or v_batch[role[1]] is not None:
            return None
        v_batch[role[1]] = va
    p_free = [a for a in range(len(p.shape)) if a not in p_c and a not in p_b]
    if sorted(roles[one[a]] for a in p_free) != [("q", j) for j in range(nq)] or nq == 0:
        return None
    v_f = [a for a in range(np.ndim(v)) if a not in v_c and a not in v_b]
    if attn.q_factor is not None:
        q = q * attn.q_factor.astype(q.dtype)
    sizes = [np.shape(q)[a] for a in q_b] + [np.shape(q)[a] for a in q_f]
    heads = int(np.prod(sizes[1:nb] + sizes[nb + 1 :]))
    kv_heads = int(np.prod(sizes[1:nb]))

    def canon(x, b_axes, pos, rest, heads_):
        x = jnp.transpose(x, ([b_axes[0]] if b_axes else []) + [pos] + list(b_axes[1:]) + rest)
        x = x if b_axes else x[None]
        return x.reshape(x.shape[:2] + (heads_, -1))

    q4 = canon(q, list(q_b), q_f[0], q_f[1:] + list(q_c), heads)
    k4 = canon(k, list(k_b), k_s, list(k_c), kv_heads)
    v4 = canon(v, v_batch, v_c[0], v_f, kv_heads)
    pos = {r: a for a, r in enumerate(roles)}
    order = (
        pos[("b", 0)] if nb else None,
        [pos[("b", j)] for j in range(1, nb)] + [pos[("q", j)] for j in range(1, nq)],
        pos[("q", 0)],
        pos[("s", 0)],
    )
    full = attn.first.outvars[0].aval.shape
    bias = None if attn.bias is None else _to_bnts(attn.bias, order, full)
    mask, causal = _masks(attn, order, full)
    out, how, why = attention.attend(
        q4, k4, v4, bias=bias, mask=mask, scale=attn.scale, causal=causal, compute_dtype=dtype
    )
    # [B, T, N, Hv] -> [B, T, batch 1.., query 1.., value free..] -> the matmul's output layout
    b_size = [np.shape(q)[q_b[0]]] if nb else [1]
    out = out.reshape(
        b_size
        + [np.shape(q)[q_f[0]]]
        + sizes[1:nb]
        + sizes[nb + 1 :]
        + [np.shape(v)[a] for a in v_f]
    )
    have = (
        [("b", 0), ("q", 0)] + [("b", j) for j in range(1, nb)] + [("q", j) for j in range(1, nq)]
    )
    have += [("v", j) for j in range(len(v_f))]
    if not nb:
        out, have = out[0], have[1:]
    want = [roles[one[a]] for a in p_b]
    p_side = [roles[one[a]] for a in p_free]
    v_side = [("v", j) for j in range(len(v_f))]
    want += p_side + v_side if i == 0 else v_side + p_side
    out = jnp.transpose(out, [have.index(r) for r in want])
    _record(where, how, why)
    return [out.astype(engine.out_dtype(eqn, dtype))]


def _record(where: str, how: str, why: str) -> None:
    record = traced_for.tracing()
    if record is not None:
        record.attention.append((where, how, why))


# ---------------------------------------------------------------------------------------------
# The driver, one per program the engine evaluates.


def _once(fn):
    memo = []

    def call():
        if not memo:
            memo.append(fn())
        return memo[0]

    return call


def _unreachable():
    raise AssertionError("a value inside an attention's sub-program was read outside it")


class Fuser:
    """Recognises the attentions of one program while the engine evaluates it."""

    def __init__(self, jaxpr, consts, engine: Engine, where: Callable[[Any], str]):
        self.first = candidates(jaxpr)
        self.scope = Scope(jaxpr, consts)
        self.engine = engine
        self.where = where
        self.unfused: set[int] = set()

    def start(self, eqn, invals, weak) -> Optional[list]:
        """At a candidate first matmul of two activations: its result, symbolically."""
        if id(eqn) not in self.first or any(weak) or any(isinstance(x, Sym) for x in invals):
            return None
        dtype = self.engine.dtype_for(eqn)
        if dtype is None or dtype.itemsize >= 4:
            return None
        attn = Attn(eqn, invals[0], invals[1], None, dtype)
        shape = tuple(eqn.outvars[0].aval.shape)
        replay = _once(lambda: self.engine.evaluate(eqn, list(invals))[0])
        return [Sym("logits", shape, attn, tuple((a,) for a in range(len(shape))), replay=replay)]

    def step(self, eqn, invals) -> Optional[list]:
        """An equation with symbolic operands: its symbolic results, or None (then its operands
        are to be computed and it evaluated as traced)."""
        outs = self._rule(eqn, invals, list(eqn.invars), self.scope)
        if outs is None:
            self._note_unfused(eqn, invals)
            return None
        replay = _once(lambda: self.engine.evaluate(eqn, [real(x) for x in invals]))
        return [
            _like(o, replay=lambda j=j: replay()[j]) if isinstance(o, Sym) else o
            for j, o in enumerate(outs)
        ]

    def _note_unfused(self, eqn, invals) -> None:
        for x in invals:
            if isinstance(x, Sym) and x.attn is not None and x.attn.q_is_lhs is not None:
                if id(x.attn.first) not in self.unfused:
                    self.unfused.add(id(x.attn.first))
                    what = "the attention weights" if x.kind == "probs" else "the softmax"
                    why = f"a `{eqn.primitive.name}` on {what} (not attention's: dropout?)"
                    _record(self.where(eqn), "unfused", why)

    def _rule(self, eqn, vals, atoms, scope) -> Optional[list]:
        name = eqn.primitive.name
        if eqn.primitive is V.DOT:
            return fuse(eqn, vals, self.engine, self.where(eqn))
        if name in ("jit", "pjit", "closed_call", "custom_jvp_call"):
            return self._body(eqn, vals, atoms, scope)
        if any(isinstance(x, Sym) and x.kind == "logits" for x in vals):
            return logits_rule(eqn, vals, atoms, scope)
        if any(isinstance(x, Sym) and x.kind != "bcast" for x in vals):
            return softmax_rule(eqn, vals, atoms, scope)
        return None

    def _body(self, eqn, vals, atoms, scope) -> Optional[list]:
        """A sub-program without matmuls (`jnp.where`'s, a custom-JVP softmax), interpreted in
        place with the same rules; its other operations run as traced."""
        key = "call_jaxpr" if eqn.primitive.name in ("closed_call", "custom_jvp_call") else "jaxpr"
        closed = jax_compat.param(eqn, key)
        jaxpr, consts = (closed.jaxpr, closed.consts) if hasattr(closed, "jaxpr") else (closed, ())
        if V.has_matmul(jaxpr):
            return None
        inner = Scope(jaxpr, consts, (scope, atoms))
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, vals))

        def read(a):
            return a.val if isinstance(a, jcore.Literal) else env[a]

        for e in jaxpr.eqns:
            ins = [read(a) for a in e.invars]
            if any(isinstance(x, Sym) and x.kind != "bcast" for x in ins):
                outs = self._rule(e, ins, list(e.invars), inner)
                if outs is None:
                    return None
            elif e.primitive.name == "broadcast_in_dim" and len(ins) == 1:
                dims = tuple(int(d) for d in jax_compat.param(e, "broadcast_dimensions"))
                aval = e.outvars[0].aval
                if _is_bcast(ins[0]):  # a broadcast of a broadcast: one, from the first source
                    src = ins[0]
                    outs = [
                        _like(src, shape=tuple(aval.shape), dims=tuple(dims[d] for d in src.dims))
                    ]
                    env.update(zip(e.outvars, outs))
                    continue
                outs = [
                    Sym(
                        "bcast",
                        tuple(aval.shape),
                        value=ins[0],
                        dims=dims,
                        scope=inner,
                        atom=e.invars[0],
                        replay=_unreachable,
                    )
                ]
            else:
                real = [_force(x) for x in ins]
                outs = V.bind(e, V.as_traced(e, real), e.params)
            env.update(zip(e.outvars, outs))
        return [_force(read(a)) if _is_bcast(read(a)) else read(a) for a in jaxpr.outvars]


def _is_bcast(x) -> bool:
    return isinstance(x, Sym) and x.kind == "bcast"


def _force(x):
    """A lazy broadcast computed; anything else as it is."""
    if _is_bcast(x):
        return jax.lax.broadcast_in_dim(x.value, x.shape, x.dims)
    return x
