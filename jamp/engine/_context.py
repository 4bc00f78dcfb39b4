"""What the engine's rules and passes know beyond one equation (`Context`): the policy's choice
of compute dtype, the name stack above the program, and the tables that passes share across the
programs of one evaluation (fp8 sites, values the backward keeps, repeated keys and values)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

import numpy as np
from jax.extend import core as jcore

from jamp import jax_compat, scopes

ComputeFor = Callable[[jcore.JaxprEqn, Optional[np.dtype]], Optional[np.dtype]]
#: `(jaxpr, consts, args, compute_dtype, ctx, weak, placed=None) -> (outputs, whether each is
#: weak)`: the interpreter (`jamp.engine._core.interpret`), which the rules below it call for
#: sub-programs without importing it.
Interpret = Callable[..., tuple[list, list]]


def _no_interpreter(*args, **kwargs):
    raise AssertionError("a sub-program evaluated outside `jamp.engine._core.eval_jaxpr`")


class Saved:
    """id -> (value, perm): `value` is `transpose(kept, perm)` of a 16-bit array `kept` that the
    backward pass keeps anyway (a fused attention's output): an fp8 matmul reading `kept` itself
    (or a reshape of it) keeps it, not an fp8 copy of it (`jamp.fp8.dot_general`)."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[Any, tuple]] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def perm(self, x) -> Optional[tuple]:
        held = self._held.get(id(x))
        return held[1] if held is not None and held[0] is x else None

    def holds(self, x) -> bool:
        """Whether `x` is a kept array itself (or a reshape of one), not a transpose of it."""
        perm = self.perm(x)
        return perm is not None and perm == tuple(range(len(perm)))

    def save(self, x, perm=None) -> None:
        self._held[id(x)] = (x, tuple(range(np.ndim(x))) if perm is None else tuple(perm))

    def follow(self, eqn, x, out) -> None:
        """Saved values through layout operations: reshapes of the array itself, transposes."""
        perm = self.perm(x)
        if perm is None:
            return
        if eqn.primitive.name == "transpose":
            self.save(out, [perm[a] for a in jax_compat.param(eqn, "permutation")])
        elif eqn.primitive.name in ("reshape", "squeeze", "expand_dims") and self.holds(x):
            self.save(out)  # the same values in another shape: a bitcast in XLA


class Repeats:
    """id -> (value, source, axis, group): `value` is `jnp.repeat(source, group, axis)` (keys or
    values repeated for grouped-query attention, which a fused attention takes ungrouped)."""

    def __init__(self) -> None:
        self._held: dict[int, tuple] = {}

    def note(self, value, source, axis: int, group: int) -> None:
        self._held[id(value)] = (value, source, axis, group)

    def of(self, x) -> Optional[tuple]:
        """`(source, axis, group)` where `x` is a repeat, else None."""
        held = self._held.get(id(x))
        return held[1:] if held is not None and held[0] is x else None


@dataclasses.dataclass(frozen=True)
class Context:
    compute_for: ComputeFor
    lower: bool  # carry float32 activations in the 16-bit compute dtype (`jamp.activations`)
    # fp8: the model's last matmul (its output head), which inherits bfloat16 instead of fp8;
    # whether fp8 matmuls here may read a scaling state (not in re-traced sub-programs, whose
    # closures could not carry it); the name stack above this program; the trace's site tally.
    head: Optional[jcore.JaxprEqn] = None
    stateful: bool = True
    prefix: str = ""
    # run recognised attention as one call (`jamp.attention`): everywhere, nowhere, or where a
    # module path says so (`_rewrite.attention_fusion`)
    fuse_attention: Union[bool, Callable[[str], bool]] = True
    recompute: bool = True  # activation functions recomputed in the backward (`_recompute`)
    sites: dict = dataclasses.field(default_factory=dict, compare=False)
    # the linen module calls recorded while the program was traced: the fp8 sites' params paths
    calls: Optional[scopes.LinenCalls] = dataclasses.field(default=None, compare=False)
    saved: Saved = dataclasses.field(default_factory=Saved, compare=False)
    repeats: Repeats = dataclasses.field(default_factory=Repeats, compare=False)
    interpret: Interpret = dataclasses.field(default=_no_interpreter, compare=False)

    def choose(self, eqn, inherited) -> Optional[np.dtype]:
        """The compute dtype of `eqn`; a choice that reads scope paths (`jamp.autocast`'s
        overrides) also gets the name stack of the programs around this one, which the
        equation's own lacks."""
        compute_for: Callable[..., Optional[np.dtype]] = self.compute_for  # maybe 3 arguments
        if getattr(compute_for, "reads_scope_prefix", False):
            return compute_for(eqn, inherited, self.prefix)
        return compute_for(eqn, inherited)

    def stack(self, eqn) -> str:
        """The name stack of `eqn`, the programs around this one's included."""
        return "/".join(s for s in (self.prefix, str(eqn.source_info.name_stack)) if s)

    def within(self, eqn) -> "Context":
        """The context of a sub-program evaluated in place: its name stack continues the
        equation's."""
        return dataclasses.replace(self, prefix=self.stack(eqn))

    def stateless(self) -> "Context":
        """The context of a re-traced sub-program, whose fp8 matmuls read no scaling state."""
        return dataclasses.replace(self, stateful=False) if self.stateful else self

    def module_path(self, eqn) -> str:
        """An equation's name-scope path without `jnp.einsum`'s own scope (its spec)."""
        return "/".join(p for p in self.stack(eqn).split("/") if p and "->" not in p)
