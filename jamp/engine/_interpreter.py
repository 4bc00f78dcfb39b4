"""The interpreter's state for one program (`Program`: its variables' values and weakness) and
the walk of one equation through the passes (`Pass`), which `jamp.engine._core` registers.

Each pass decides one concern of the engine's for an equation (`Visit`): it may settle the
equation before it is evaluated (it wrote what the equation produced, or will), set what the
evaluation reads (its operands, their placements), evaluate it, or note what it evaluated to;
the passes after one that settles an equation do not see it. The interpreter writes the
results of an equation no pass settled.

Each pass declares its `Phase`, the point of that walk it acts at; `jamp.engine._core` checks
that its passes run in phase order."""

from __future__ import annotations

import enum
import functools
from typing import Any, ClassVar, Optional, Sequence

import jax
from jax.extend import core as jcore

from jamp import fp8, mixed_ops
from jamp.engine import _dtypes
from jamp.engine._context import Context


class Visit:
    """One equation on its way through the passes."""

    def __init__(self, program: "Program", index: int):
        self.program = program
        self.index = index
        self.eqn = program.jaxpr.eqns[index]
        self.where: Optional[list] = None  # the operands' placements on a mesh, or None
        self.outs: Optional[list] = None  # its results, once evaluated
        self.weak: Optional[list] = None  # whether each result is weak

    @functools.cached_property
    def invals(self) -> list:
        """Its operands' values, read when a pass first asks (an equation that a pass defers
        has operands not computed yet)."""
        return [self.program.read(v) for v in self.eqn.invars]


class Phase(enum.IntEnum):
    """Where in an equation's walk a pass acts; the passes run in this order."""

    #: takes whole regions of equations, before any of them is seen one by one
    REGIONS = 0
    #: takes an equation (or the pattern it starts) before it is evaluated
    SETTLE = 1
    #: sets what the evaluation reads (the operands' placements)
    OPERANDS = 2
    #: evaluates it: exactly one pass
    EVALUATE = 3
    #: reads what it evaluated to
    NOTE = 4


class Pass:
    """One concern of the engine's, for one program (made by the registered factory, which
    returns None where the concern has nothing to do in the program)."""

    phase: ClassVar[Phase]

    @classmethod
    def start(cls, program: "Program") -> Optional["Pass"]:
        """The pass for `program`, or None where it has nothing to do there."""
        raise NotImplementedError

    def visit(self, visit: Visit) -> bool:
        """Decides for one equation; True where it settled it (later passes skip it)."""
        return False

    def finish(self, outs: list) -> list:
        """The program's outputs, as this pass leaves them."""
        return outs


class Program:
    """One program under evaluation: its variables' values and whether each is weak (a
    literal, a constant, or made of the weak arguments alone: see `jamp.activations`)."""

    def __init__(
        self,
        jaxpr: jcore.Jaxpr,
        consts,
        args,
        compute_dtype,
        ctx: Context,
        weak: Optional[Sequence[bool]],
        placed: Optional[Sequence[Optional[mixed_ops.Placed]]],
    ):
        self.jaxpr, self.compute_dtype, self.ctx = jaxpr, compute_dtype, ctx
        self.consts = consts
        # per argument, its placement on a mesh (a sharded parameter) or None
        self.placed = {v: p for v, p in zip(jaxpr.invars, placed or ()) if p is not None}
        self.passes: list[Pass] = []
        self.env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        self.weak_env: dict[Any, bool] = {v: True for v in jaxpr.constvars}
        self.env.update(zip(jaxpr.invars, args))
        self.weak_env.update(zip(jaxpr.invars, weak if weak is not None else [False] * len(args)))

    def read(self, v):
        return v.val if isinstance(v, jcore.Literal) else self.env[v]

    def is_weak(self, v) -> bool:
        return True if isinstance(v, jcore.Literal) else self.weak_env[v]

    def write(self, outvars, outs, weak) -> None:
        for var, val, w in zip(outvars, outs, weak):
            if not isinstance(var, jcore.DropVar):
                self.env[var] = val
                self.weak_env[var] = w

    def dtype_for(self, eqn):
        """The compute dtype of `eqn`: under fp8 the output head inherits the carrier dtype; an
        override still decides it."""
        head = eqn is self.ctx.head
        inherited = fp8.carrier(self.compute_dtype) if head else self.compute_dtype
        return self.ctx.choose(eqn, inherited)

    def evaluate(self, eqn, invals, where=None):
        """`eqn` on `invals` by the dtype rules (`_dtypes`); returns its outputs and whether
        each is weak."""
        # Keep the module path of each operation, for profiles and for anyone reading the program.
        with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
            weak = [self.is_weak(v) for v in eqn.invars]
            return _dtypes.evaluate(eqn, invals, weak, self.dtype_for(eqn), self.ctx, where)

    def step(self, index: int, after: Optional[Pass] = None) -> None:
        """The equation at `index` through the passes (those after `after`, if given)."""
        visit = Visit(self, index)
        passes = self.passes if after is None else self.passes[self.passes.index(after) + 1 :]
        for p in passes:
            if p.visit(visit):
                return
        assert visit.outs is not None and visit.weak is not None, "no pass evaluated it"
        self.write(visit.eqn.outvars, visit.outs, visit.weak)

    def results(self) -> tuple[list, list]:
        """The program's outputs (as the passes leave them) and whether each is weak."""
        outs = [self.read(v) for v in self.jaxpr.outvars]
        for p in self.passes:
            outs = p.finish(outs)
        return outs, [self.is_weak(v) for v in self.jaxpr.outvars]
