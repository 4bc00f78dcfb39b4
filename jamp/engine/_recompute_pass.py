"""The recompute pass (see `jamp.engine._interpreter`): each activation function that
`jamp.engine._recompute` finds in a program is evaluated under `jax.checkpoint`, so that the
backward recomputes it from its input instead of keeping what is in between."""

from __future__ import annotations

from typing import Optional

import jax
from jax.extend import core as jcore

from jamp.engine import _attention, _guard, _recompute
from jamp.engine._interpreter import Pass, Phase, Program, Visit


class RecomputeRegions(Pass):
    """Settles the equations of each region: those before its last wait for it, and its last
    evaluates them all under `jax.checkpoint`; where that cannot be, they go through the passes
    after this one, one by one."""

    phase = Phase.REGIONS

    def __init__(self, program: Program):
        self.program = program
        self.regions: Optional[dict[int, _recompute.Region]] = None
        self.deferred: set[int] = set()

    @classmethod
    def start(cls, program: Program) -> Optional[Pass]:
        # (not in a program with sharded parameters, whose placements follow each equation)
        return cls(program) if program.ctx.recompute and not program.placed else None

    def _find(self) -> dict[int, _recompute.Region]:
        """The regions, found as the walk starts: after the passes before this one have read
        the program (the attention pass's warnings, if any, come first)."""
        if self.regions is None:
            none: dict[int, _recompute.Region] = {}
            self.regions = _guard.attempt(
                "activation functions recomputed in the backward",
                lambda: self.program.ctx.prefix,
                lambda: _recompute.regions(self.program.jaxpr),
                none,
            )
            self.deferred = {i for r in self.regions.values() for i in r.members[:-1]}
        return self.regions

    def visit(self, visit: Visit) -> bool:
        region = self._find().get(visit.index)
        if visit.index in self.deferred:
            return True  # evaluated with its region's last equation
        if region is None:
            return False
        if not self._recomputed(region):
            for i in region.members:  # (evaluated equation by equation instead)
                self.program.step(i, after=self)
        return True

    def _recomputed(self, region: _recompute.Region) -> bool:
        """Evaluates `region` under jax.checkpoint; False (nothing done) if it cannot be."""
        program = self.program
        ins = [program.read(v) for v in region.inputs]
        if any(isinstance(x, _attention.Sym) for x in ins):
            return False
        eqns = program.jaxpr.eqns

        def body(*xs):
            local = dict(zip(region.inputs, xs))
            for i in region.members:
                e = eqns[i]
                vals = [v.val if isinstance(v, jcore.Literal) else local[v] for v in e.invars]
                outs, outs_weak = program.evaluate(e, vals)
                local.update(zip(e.outvars, outs))
                program.weak_env.update(zip(e.outvars, outs_weak))
            return [local[o] for o in region.outputs]

        outs = _guard.attempt(
            "an activation function recomputed in the backward",
            lambda: program.ctx.module_path(eqns[region.members[-1]]),
            lambda: jax.checkpoint(body, prevent_cse=True)(*ins),
            None,
        )
        if outs is None:
            return False
        program.env.update(zip(region.outputs, outs))
        return True
