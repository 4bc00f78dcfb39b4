"""Where attention may start, and constants read while tracing (see `jamp.engine._attention`)."""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Optional

import jax
import numpy as np
from jax.extend import core as jcore

from jamp import jax_compat
from jamp.engine import _attention_forms as F
from jamp.engine import _values as V

#: Operations scanned after a candidate first matmul before giving up on finding its softmax.
_HORIZON = 48
#: The largest constant (elements, compressed: see `Scope`) evaluated while tracing to read a
#: mask or a fill: a causal mask of up to 4096 x 4096 is evaluated; longer ones are read by
#: their form (`Scope.symbolic`).
_MAX_CONCRETE = 1 << 24
#: The most values `Scope.values` keeps of a variable.
_FEW = 4


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


#: Operations that act element by element (operands of the result's shape, or scalars): their
#: constants are computed on the compressed operands (see `Scope`).
_ELEMENTWISE = frozenset(
    """abs add and ceil clamp convert_element_type copy copy_p cos div eq exp exp2 floor ge gt
    integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not or pow rem
    round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sqrt
    square sub tan tanh xor""".split()
)
_CALLS = ("jit", "pjit", "closed_call")
#: Operations that only lay values out anew (see `Scope._compressed`).
_LAYOUT = frozenset(("broadcast_in_dim", "transpose", "reshape", "squeeze"))


def _to(x, shape):
    return x if np.ndim(x) == 0 else np.broadcast_to(x, shape)


def compressed(x: np.ndarray) -> np.ndarray:
    """`x` with every axis along which it is constant cut to size 1 (it broadcasts back)."""
    x = np.asarray(x)
    for axis in range(x.ndim):
        if x.shape[axis] > 1:
            first = x.take([0], axis=axis)
            if (x == first).all():
                x = first
    return x


class Scope:
    """A program being evaluated, for reading the value of a variable computed from constants
    alone: its constants, the equation that produced each variable, and (for a sub-program
    evaluated in place) the outer variables its inputs are.

    Values are kept compressed (`compressed`: size 1 along the axes they are constant on), and
    element-wise operations, broadcasts and transposes work on them so: a causal mask broadcast
    over a batch of 32 sequences of 1024 is a [1, 1, 1024, 1024] array, not 33M elements. Other
    operations run on the full values; nothing larger than `_MAX_CONCRETE` elements is computed.
    Past that, `symbolic` reads a value by its form (`_attention_forms`: a causal mask over
    65,536 positions is the predicate `i_q - i_k >= 0`, not 4.3G elements)."""

    def __init__(self, jaxpr, consts, parent: Optional[tuple["Scope", list]] = None):
        self.consts = dict(zip(jaxpr.constvars, consts))
        self.inputs = dict(zip(jaxpr.invars, parent[1])) if parent else {}
        self.parent = parent[0] if parent else None
        self.made_by = {o: e for e in jaxpr.eqns for o in e.outvars}
        self.memo: dict[Any, Optional[np.ndarray]] = {}
        # per reading of variables other than constants ("partial", "symbolic", "values")
        self.readings: dict[str, dict[Any, Any]] = {"partial": {}, "symbolic": {}, "values": {}}

    def concrete(self, atom) -> Optional[np.ndarray]:
        """The value of `atom` if it is computed from constants alone, else None; compressed (it
        broadcasts to `atom`'s shape)."""
        if isinstance(atom, jcore.Literal):
            return np.asarray(atom.val)
        if atom in self.memo:
            return self.memo[atom]
        self.memo[atom] = None  # (a cycle cannot occur; this also bounds the recursion's work)
        value = None
        if atom in self.consts:
            c = self.consts[atom]
            value = None if isinstance(c, jax.core.Tracer) else compressed(np.asarray(c))
        elif atom in self.inputs and self.parent is not None:
            value = self.parent.concrete(self.inputs[atom])
        elif atom in self.made_by:
            value = self._evaluate(self.made_by[atom], atom)
        self.memo[atom] = value
        return value

    def _evaluate(self, eqn, atom) -> Optional[np.ndarray]:
        name = eqn.primitive.name
        if eqn.effects or "rng" in name or "random" in name:
            return None
        body = self._body(eqn)
        if body is not None:  # a jitted function of constants: its body, compressed likewise
            for o, v in zip(eqn.outvars, body.outvars):
                self.memo[o] = body.scope.concrete(v)
            return self.memo[atom]
        found = [self.concrete(v) for v in eqn.invars]
        ins = [x for x in found if x is not None]
        if len(ins) != len(found):
            return None
        try:
            outs = self._compressed(eqn, ins)
            if outs is None:  # on the full values
                full = [np.broadcast_to(x, v.aval.shape) for x, v in zip(ins, eqn.invars)]
                sizes = [x.size for x in full] + [np.prod(o.aval.shape) for o in eqn.outvars]
                if max(sizes) > _MAX_CONCRETE:
                    return None
                outs = [compressed(np.asarray(x)) for x in self._bind(eqn, full)]
        except Exception:  # anything that cannot run eagerly is simply not a constant
            return None
        if any(np.size(val) > _MAX_CONCRETE for val in outs):  # (a causal mask past 4096^2)
            return None
        for o, val in zip(eqn.outvars, outs):
            self.memo[o] = val
        return self.memo[atom]

    def partial(self, atom) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(values, known): what is known of `atom` whatever the program's inputs are, both
        compressed; `values` holds where `known` does. None where nothing is known.

        E.g. Hugging Face's attention bias `select(and(ne(attention_mask, 0), causal) > 0, 0,
        min)`, with the attention mask an input: `min` above the diagonal whatever the mask."""
        return self._read("partial", atom, None)

    def _read(self, reading: str, atom, unknown) -> Any:
        """One reading of `atom` (`partial`, `symbolic`, `values`), memoised: a constant's from
        its value (`of_constant`), a sub-program input's as the enclosing scope reads it, a
        computed variable's by `_<reading>` on its equation; `unknown` where none is (also
        while `atom` is being read: a cycle cannot occur, and this bounds the work)."""
        shape = atom.aval.shape
        if isinstance(atom, jcore.Literal):
            return of_constant(reading, np.asarray(atom.val), shape)
        memo = self.readings[reading]
        if atom in memo:
            return memo[atom]
        memo[atom] = unknown
        c = self.concrete(atom)
        value = unknown
        if c is not None:
            value = of_constant(reading, c, shape)
        elif atom in self.inputs and self.parent is not None:
            value = getattr(self.parent, reading)(self.inputs[atom])
        elif atom in self.made_by:
            eqn = self.made_by[atom]
            try:
                body = None if eqn.effects else self._body(eqn)
                if body is not None:  # a jitted call: its body, read in place
                    for o, v in zip(eqn.outvars, body.outvars):
                        memo[o] = getattr(body.scope, reading)(v)
                    return memo[atom]
                value = unknown if eqn.effects else getattr(self, "_" + reading)(eqn, atom)
            except Exception:  # anything that cannot run eagerly is simply not known
                value = unknown
        memo[atom] = value
        return value

    def _partial(self, eqn, atom) -> Optional[tuple[np.ndarray, np.ndarray]]:
        name = eqn.primitive.name
        if len(eqn.outvars) != 1 or name not in _ELEMENTWISE | _LAYOUT:
            return None
        parts = []
        for v in eqn.invars:
            part = self.partial(v)
            if part is None:  # unknown: any value
                ones = (1,) * len(v.aval.shape)
                part = (np.zeros(ones, v.aval.dtype), np.zeros(ones, bool))
            parts.append(part)
        if not any(known.any() for _, known in parts):
            return None
        if name in _LAYOUT:
            laid = [self._compressed(eqn, [parts[0][j]]) for j in (0, 1)]
            return None if laid[0] is None or laid[1] is None else (laid[0][0], laid[1][0])
        out_rank = len(eqn.outvars[0].aval.shape)
        arrays = [a for part in parts for a in part]
        if any(np.ndim(a) not in (0, out_rank) for a in arrays):
            return None
        small = np.broadcast_shapes(*(np.shape(a) for a in arrays if np.ndim(a)))
        if np.prod(small) > _MAX_CONCRETE:
            return None  # (a long sequence's mask: see `symbolic`)
        values = [_to(x, small) for x, _ in parts]
        knowns = [_to(k, small) for _, k in parts]
        out = self._bind(eqn, values)[0]
        known = functools.reduce(np.logical_and, knowns)
        boolean = all(np.dtype(x.dtype) == np.dtype(bool) for x in values)
        if name in ("and", "or") and boolean and len(values) == 2:  # one operand may decide
            decides = [np.logical_not(x) if name == "and" else x for x in values]
            known = known | (knowns[0] & decides[0]) | (knowns[1] & decides[1])
        if name == "select_n" and len(values) == 3 and np.dtype(values[0].dtype) == bool:
            pred, case0, case1 = values
            chosen = knowns[0] & np.where(pred, knowns[2], knowns[1])
            known = chosen | (knowns[1] & knowns[2] & (case0 == case1))
        known = compressed(np.broadcast_to(known, np.shape(out)))
        out = compressed(out)
        return (out, known) if known.any() and out.size <= _MAX_CONCRETE else None

    def symbolic(self, atom) -> Any:
        """The form of `atom` (`jamp.engine._attention_forms`): a 0-d array, `UNKNOWN`, an
        index expression (`Affine`) or a `Split` of an index predicate, at any size."""
        return self._read("symbolic", atom, F.UNKNOWN)

    def _symbolic(self, eqn, atom) -> Any:
        name = eqn.primitive.name
        out_shape = tuple(atom.aval.shape)
        if name == "iota":
            rank, dim = len(out_shape), jax_compat.param(eqn, "dimension")
            index = F.Affine(tuple(int(k == dim) for k in range(rank)), 0).canon(out_shape)
            return index if F.exact_in(index, out_shape, atom.aval.dtype) else F.UNKNOWN
        if len(eqn.outvars) != 1:
            return F.UNKNOWN
        if name in _ELEMENTWISE:
            ins = [self.symbolic(v) for v in eqn.invars]
            bind = lambda vals: self._bind(eqn, vals)[0]  # noqa: E731
            out = F.elementwise(name, ins, out_shape, atom.aval.dtype, bind)
            return F.UNKNOWN if out is None else out
        x = self.symbolic(eqn.invars[0]) if eqn.invars else F.UNKNOWN
        if not isinstance(x, (F.Affine, F.Split)):
            return x if x is F.UNKNOWN or _layout_only(name) else F.UNKNOWN
        move = self._move(eqn, out_shape)
        return F.UNKNOWN if move is None else F.laid_out(x, move)

    def _move(self, eqn, out_shape):
        """A layout operation as a function of index expressions, or None."""
        name = eqn.primitive.name
        in_shape = tuple(eqn.invars[0].aval.shape)
        if name == "broadcast_in_dim":
            dims = tuple(jax_compat.param(eqn, "broadcast_dimensions"))
            source = {d: j for j, d in enumerate(dims)}
            return lambda a: F.relaid(
                a, lambda k: a.coef[source[k]] if k in source else 0, 0, out_shape
            )
        if name == "transpose":
            perm = tuple(jax_compat.param(eqn, "permutation"))
            return lambda a: F.relaid(a, lambda k: a.coef[perm[k]], 0, out_shape)
        if name in ("reshape", "squeeze", "expand_dims"):  # only size-1 axes come or go
            if name == "reshape" and jax_compat.param(eqn, "dimensions") is not None:
                return None
            if [n for n in in_shape if n != 1] != [n for n in out_shape if n != 1]:
                return None
            kept_in = [j for j, n in enumerate(in_shape) if n != 1]
            kept_out = [k for k, n in enumerate(out_shape) if n != 1]
            source = dict(zip(kept_out, kept_in))
            return lambda a: F.relaid(
                a, lambda k: a.coef[source[k]] if k in source else 0, 0, out_shape
            )
        if name in ("slice", "dynamic_slice"):
            if name == "slice":
                starts = [int(i) for i in jax_compat.param(eqn, "start_indices")]
                strides = eqn.params.get("strides") or (1,) * len(in_shape)
            else:
                found = [self.concrete(v) for v in eqn.invars[1:]]
                if any(c is None or np.size(c) != 1 for c in found):
                    return None
                starts = [  # (JAX clamps a start so that the slice fits)
                    min(max(int(np.reshape(c, ())), 0), n - m)
                    for c, n, m in zip(found, in_shape, out_shape)
                ]
                strides = (1,) * len(in_shape)

            def sliced(a):
                shift = sum(c * i for c, i in zip(a.coef, starts))
                return F.relaid(a, lambda k: a.coef[k] * int(strides[k]), shift, out_shape)

            return sliced
        return None

    def values(self, atom) -> Optional[np.ndarray]:
        """The values `atom` can take whatever the program's inputs are, where they are few (at
        most `_FEW`; a superset, sorted, 1-d), else None. E.g. Hugging Face's attention bias
        `select(mask > 0, 0, min)` of a mask of data: [min, 0]."""
        return self._read("values", atom, None)

    def _values(self, eqn, atom) -> Optional[np.ndarray]:
        name = eqn.primitive.name
        if len(eqn.outvars) != 1:
            return None
        if name == "select_n":  # whichever case the predicate picks
            found = [self.values(v) for v in eqn.invars[1:]]
            cases = [c for c in found if c is not None]
            return None if len(cases) != len(found) else _few(np.unique(np.concatenate(cases)))
        if _layout_only(name):
            return self.values(eqn.invars[0])
        if name not in _ELEMENTWISE:
            return None
        found = [self.values(v) for v in eqn.invars]
        ins = [x for x in found if x is not None]
        if len(ins) != len(found) or np.prod([x.size for x in ins]) > _FEW**2:
            return None
        grids = np.meshgrid(*ins, indexing="ij")  # every combination of the operands' values
        return _few(np.unique(self._bind(eqn, [g.reshape(-1) for g in grids])[0]))

    def _body(self, eqn) -> Optional[Any]:
        """A jitted call's body (`.scope`, its `.outvars`) to read in place, or None (another
        operation, or a body with matmuls: those run whole, on full values)."""
        name = eqn.primitive.name
        if name not in _CALLS:
            return None
        closed = jax_compat.param(eqn, "call_jaxpr" if name == "closed_call" else "jaxpr")
        inner, consts = (closed.jaxpr, closed.consts) if hasattr(closed, "jaxpr") else (closed, ())
        if V.has_matmul(inner):
            return None
        scope = Scope(inner, consts, (self, list(eqn.invars)))
        return types.SimpleNamespace(scope=scope, outvars=inner.outvars)

    @staticmethod
    def _bind(eqn, ins):
        with _on_host(), jax.ensure_compile_time_eval():
            return [np.asarray(x) for x in V.bind(eqn, ins, eqn.params)]

    def _compressed(self, eqn, ins) -> Optional[list]:
        """The results of `eqn` on compressed operands, compressed; None where the operation
        needs its operands whole."""
        name = eqn.primitive.name
        out_shape = tuple(eqn.outvars[0].aval.shape)
        if name in _ELEMENTWISE and len(eqn.outvars) == 1:
            if any(np.ndim(x) not in (0, len(out_shape)) for x in ins):
                return None
            small = np.broadcast_shapes(*(np.shape(x) for x in ins if np.ndim(x)))
            if np.prod(small) > _MAX_CONCRETE:
                return None  # (then too large whole as well: see `_evaluate`)
            ins = [x if np.ndim(x) == 0 else np.broadcast_to(x, small) for x in ins]
            return [compressed(self._bind(eqn, ins)[0])]
        if name == "iota":  # along one axis, constant along the others
            dim, dtype = jax_compat.param(eqn, "dimension"), jax_compat.param(eqn, "dtype")
            shape = [n if d == dim else 1 for d, n in enumerate(out_shape)]
            return [np.arange(out_shape[dim], dtype=dtype).reshape(shape)]
        if name == "broadcast_in_dim":
            (x,) = ins[:1]
            dims = tuple(jax_compat.param(eqn, "broadcast_dimensions"))
            shape = [1] * len(out_shape)
            for j, d in enumerate(dims):
                shape[d] = np.shape(x)[j]
            return [np.reshape(x, shape)]
        if name == "transpose":
            return [np.transpose(ins[0], tuple(jax_compat.param(eqn, "permutation")))]
        if name in ("reshape", "squeeze", "expand_dims"):  # only size-1 axes come or go
            x, in_shape = ins[0], tuple(eqn.invars[0].aval.shape)
            if name == "reshape" and jax_compat.param(eqn, "dimensions") is not None:
                return None
            if [n for n in in_shape if n != 1] != [n for n in out_shape if n != 1]:
                return None
            kept = [np.shape(x)[i] for i, n in enumerate(in_shape) if n != 1]
            it = iter(kept)
            return [np.reshape(x, [next(it) if n != 1 else 1 for n in out_shape])]
        return None


def of_constant(reading: str, c: np.ndarray, shape) -> Any:
    """What a reading of `Scope` (`concrete`, `partial`, `symbolic`, `values`) says of a constant
    `c` (compressed or whole: it broadcasts to `shape`)."""
    if reading == "concrete":
        return c
    if reading == "partial":
        return c, np.ones((1,) * np.ndim(c), bool)
    if reading == "symbolic":
        return F.from_array(c, shape)
    return _few(np.unique(c))


def _few(values: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """`values` where they are few (at most `_FEW`), else None."""
    return None if values is None or values.size > _FEW else values


def _layout_only(name: str) -> bool:
    """Whether an operation's result holds its first operand's values, moved: a constant
    stays that constant."""
    return name in _LAYOUT or name in ("squeeze", "expand_dims", "slice", "dynamic_slice")


def _on_host():
    """Eager evaluation on the host's CPU, where there is one: the program may be traced for
    devices that are not here (a GPU target compiled on a CPU)."""
    try:
        return jax.default_device(jax.devices("cpu")[0])
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu): the default device
        return contextlib.nullcontext()
