"""Where attention may start, and constants read while tracing (see `jamp.engine._attention`)."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import jax
import numpy as np
from jax.extend import core as jcore

from jamp.engine import _values as V

#: Operations scanned after a candidate first matmul before giving up on finding its softmax.
_HORIZON = 48
#: The largest constant (elements) evaluated while tracing to read a mask or a fill.
_MAX_CONCRETE = 1 << 24


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
