"""The engine's smaller passes (see `jamp.engine._interpreter`): the operands' placements, the
dtype rules that evaluate each equation, and what follows a value through layout operations
(the params' 16-bit copies, the arrays the backward keeps anyway)."""

from __future__ import annotations

from typing import Optional

from jax.extend import core as jcore

from jamp import copies
from jamp.engine import _values as V
from jamp.engine._interpreter import Pass, Phase, Program, Visit


class FollowPlacements(Pass):
    """The placements of a program's sharded parameters (`_rewrite.placing`), which its matmuls
    read them by, followed through transposes and casts."""

    phase = Phase.OPERANDS

    def __init__(self, placed: dict):
        self.placed = placed

    @classmethod
    def start(cls, program: Program) -> Optional[Pass]:
        return cls(program.placed) if program.placed else None

    def visit(self, visit: Visit) -> bool:
        eqn = visit.eqn
        visit.where = [self.placed.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
        followed = V.follow_placement(eqn, visit.where)
        if followed is not None:
            self.placed[eqn.outvars[0]] = followed
        return False


class DtypeRules(Pass):
    """Evaluates the equation by the dtype rules (`jamp.engine._dtypes`)."""

    phase = Phase.EVALUATE

    def __init__(self, program: Program):
        self.program = program

    @classmethod
    def start(cls, program: Program) -> Optional[Pass]:
        return cls(program)

    def visit(self, visit: Visit) -> bool:
        visit.outs, visit.weak = self.program.evaluate(visit.eqn, visit.invals, visit.where)
        return False


# What a param's ready copy (`jamp.copies.ready_casts`) follows: a kernel transposed or
# reshaped before its matmul is still read from the copy.
_REARRANGE = ("transpose", "reshape")


class FollowCopies(Pass):
    """The params' 16-bit copies that a train step holds ready (`jamp.copies.ready_casts`),
    followed through a kernel's transpose or reshape to the matmul that reads it."""

    phase = Phase.NOTE

    @classmethod
    def start(cls, program: Program) -> Optional[Pass]:
        return cls()

    def visit(self, visit: Visit) -> bool:
        eqn = visit.eqn
        if eqn.primitive.name in _REARRANGE and copies.has_ready():
            assert visit.outs is not None
            rearrange = lambda c: V.bind(eqn, [c], eqn.params)[0]  # noqa: E731
            copies.follow_ready(visit.invals[0], visit.outs[0], rearrange)
        return False


class FollowSaved(Pass):
    """The 16-bit arrays the backward keeps anyway (`Context.saved`: a fused attention's
    output), followed through reshapes and transposes to the fp8 matmuls that read them."""

    phase = Phase.NOTE

    def __init__(self, program: Program):
        self.saved = program.ctx.saved

    @classmethod
    def start(cls, program: Program) -> Optional[Pass]:
        return cls(program)

    def visit(self, visit: Visit) -> bool:
        if self.saved and len(visit.invals) == 1:
            assert visit.outs is not None
            self.saved.follow(visit.eqn, visit.invals[0], visit.outs[0])
        return False
