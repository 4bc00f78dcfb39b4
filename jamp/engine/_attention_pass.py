"""The attention passes (see `jamp.engine._interpreter`): each attention recognised in a program
runs as one call (`jamp.engine._attention`), and keys and values repeated for grouped-query
attention are noted, so that the call takes them grouped (`jamp.engine._repeats`)."""

from __future__ import annotations

from typing import Optional

import jax

from jamp import fp8
from jamp.engine import _attention, _guard, _matmuls, _repeats
from jamp.engine import _values as V
from jamp.engine._interpreter import Pass, Phase, Program, Visit


def _attention_dtype(dtype):
    """Attention's matmuls take two activations: under fp8 they run in the carrier dtype."""
    return None if dtype is None else fp8.carrier(dtype)


def _fuser(program: Program) -> Optional[_attention.Fuser]:
    """The attention recogniser of this program, if attention may be fused in it."""
    ctx = program.ctx
    if ctx.fuse_attention is False:
        return None

    def make() -> _attention.Fuser:
        return _attention.Fuser(
            program.jaxpr,
            program.consts,
            _attention.Engine(
                lambda eqn, invals: program.evaluate(eqn, invals)[0],
                lambda eqn: _attention_dtype(program.dtype_for(eqn)),
                lambda eqn, dtype: _matmuls.out_dtype(eqn, dtype, ctx),
                ctx.saved.save,
                ctx.repeats.of,
            ),
            ctx.module_path,
            ctx.fuse_attention if callable(ctx.fuse_attention) else None,
        )

    fuser = _guard.attempt("attention", lambda: ctx.prefix, make, None)
    return fuser if fuser is not None and fuser.first else None


class FuseAttention(Pass):
    """Settles the steps of a recognised attention: from its first matmul on they are values
    held symbolically (`_attention.Sym`), until its second matmul runs the whole as one call.
    Any other equation reads them computed, as traced."""

    phase = Phase.SETTLE

    def __init__(self, program: Program, fuser: _attention.Fuser):
        self.program, self.fuser = program, fuser

    @classmethod
    def start(cls, program: Program) -> Optional[Pass]:
        fuser = _fuser(program)
        return None if fuser is None else cls(program, fuser)

    def visit(self, visit: Visit) -> bool:
        eqn = visit.eqn
        outs = self._step(eqn, visit.invals)
        if outs is not None:
            self.program.write(eqn.outvars, outs, [False] * len(eqn.outvars))
            return True
        visit.invals = [_attention.real(x) for x in visit.invals]
        return False

    def _step(self, eqn, invals) -> Optional[list]:
        """`eqn` as a step of an attention being recognised, or None to evaluate it as usual
        (also where the recogniser fails: the attention then runs as traced, with a warning)."""
        fuser = self.fuser
        if any(isinstance(x, _attention.Sym) for x in invals):
            with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
                return _guard.attempt(
                    "an attention", lambda: fuser.where(eqn), lambda: fuser.step(eqn, invals), None
                )
        if eqn.primitive is V.DOT:
            weak = [self.program.is_weak(v) for v in eqn.invars]
            return _guard.attempt(
                "an attention",
                lambda: fuser.where(eqn),
                lambda: fuser.start(eqn, invals, weak),
                None,
            )
        return None

    def finish(self, outs: list) -> list:
        return [_attention.real(o) for o in outs]


class NoteRepeats(Pass):
    """Notes each repeat of keys and values (`_repeats.repeat_of`) in `Context.repeats`, where
    the attention pass finds it: only in a program where attention may be fused."""

    phase = Phase.NOTE

    def __init__(self, program: Program):
        self.program = program
        self.made_by: dict = {}  # var -> its equation, for `_repeats.repeat_of`

    @classmethod
    def start(cls, program: Program) -> Optional[Pass]:
        fuses = any(isinstance(p, FuseAttention) for p in program.passes)
        return cls(program) if fuses else None

    def visit(self, visit: Visit) -> bool:
        eqn, ctx = visit.eqn, self.program.ctx
        self.made_by.update((v, eqn) for v in eqn.outvars)
        repeat = _guard.attempt(
            "a repeat of keys and values",
            lambda: ctx.module_path(eqn),
            lambda: _repeats.repeat_of(eqn, self.made_by),
            None,
        )
        if repeat is not None:
            assert visit.outs is not None
            source, axis, group = repeat
            ctx.repeats.note(visit.outs[0], self.program.read(source), axis, group)
        return False
