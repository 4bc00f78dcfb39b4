"""What a program does with a language model's logits: formed whole, or kept in float32 for the
backward. Each finding is a hazard of `jamp.inspect.precision_report`, as a tuple of its fields
(kind, path, phase, detail, amount)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jamp.inspect import _paths

#: A value of at least this many classes along its last axis, of at least ELEMENTS values, is a
#: language model's logits (or what a loss computes of their size).
CLASSES = 8192
ELEMENTS = 1 << 24


def _size(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def _logits_sized(aval) -> bool:
    shape: tuple = tuple(getattr(aval, "shape", ()))
    return len(shape) >= 2 and shape[-1] >= CLASSES and _size(aval) >= ELEMENTS


def formed(jaxpr) -> list[tuple]:
    """Each large softmax over a vocabulary (a maximum over the last axis of a logits-sized
    array) whose input the program forms whole: what jamp recomputes or keeps in 16 bits
    (`make_train_step`), but cannot chunk without knowing the head; the hazard names
    `jamp.losses.fused_linear_cross_entropy`, which applies the head in chunks."""
    found: dict[tuple, int] = {}

    def visit(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name not in ("scan", "while"):  # a loop's body is a chunk of it
                for sub in jcore.jaxprs_in_params(eqn.params):
                    visit(sub)
            if eqn.primitive.name != "reduce_max" or not hasattr(eqn.invars[0], "aval"):
                continue
            aval = eqn.invars[0].aval
            if tuple(eqn.params.get("axes", ())) == (aval.ndim - 1,) and _logits_sized(aval):
                found[(tuple(aval.shape), np.dtype(aval.dtype).name)] = _size(aval)

    visit(jaxpr)
    return [
        (
            "logits formed",
            "",
            "",
            f"a softmax over {shape[-1]} classes reads {dtype}{list(shape)}, formed whole; "
            "jamp.losses.fused_linear_cross_entropy(hidden, kernel, labels) applies the output "
            "head and the loss in chunks without it",
            size,
        )
        for (shape, dtype), size in found.items()
    ]


def _widens(eqn) -> bool:
    """A 16-bit value of the logits' size widened to float32: where the logits of a 16-bit head
    become float32."""
    if eqn.primitive.name != "convert_element_type" or not isinstance(eqn.invars[0], jcore.Var):
        return False
    src = np.dtype(eqn.invars[0].aval.dtype)  # type: ignore[attr-defined]  # a ShapedArray
    f16 = jnp.issubdtype(src, jnp.floating) and src.itemsize == 2
    return f16 and _large_f32(eqn.outvars[0])


def kept(jaxpr) -> list[tuple]:
    """Each float32 value of the logits' size, computed from the function's float inputs (the
    params: not labels made one-hot, which XLA makes again where they are read), that the
    forward computes and the backward reads: kept alive from one to the other (its bytes at the
    step's peak, unless XLA recomputes it). Where 16-bit logits are widened, `make_train_step`
    recomputes the loss's tail from them so that none is kept
    (`jamp.engine.recompute_widened`): what is found after a widening is a form it does not
    take (a matmul, a loop or an effect after it)."""
    found: dict[tuple, tuple] = {}
    floats = {v for v in jaxpr.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
    visit = _Visit(found)
    visit(jaxpr, floats, set())
    return [
        (
            "float32 logits kept",
            "",
            "backward",
            f"f32{list(shape)} ({size / 2**30:.2f} GiB), made by {where or 'the loss'}, is kept "
            f"for the backward, which reads it in `{reader}`: " + _CAUSES[widened],
            size,
        )
        for (shape, where), (reader, size, widened) in found.items()
    ]


_CAUSES = {
    True: "the loss's tail after the 16-bit logits are widened is not recomputed in this form "
    "(jamp recomputes elementwise work, reductions, label picks and slices of the positions; "
    "not a matmul, a loop or an effect after the widening)",
    False: "the logits are float32 here (a float32 head; or activations in float32, as on a "
    "CPU: jamp.activations), so there are no 16-bit logits to recompute the loss from",
}


class _Visit:
    """Walks a program: which values depend on float inputs (`live`) and on a 16-bit widening
    (`wide`), and which of the large float32 ones the forward makes and the backward reads."""

    def __init__(self, found: dict):
        self.found = found

    def __call__(self, jx, live: set, wide: set) -> None:
        made: dict = {}
        for eqn in jx.eqns:
            reads = [v for v in eqn.invars if isinstance(v, jcore.Var)]
            hot = any(v in live for v in reads)
            widened = _widens(eqn) or any(v in wide for v in reads)
            for sub in jcore.jaxprs_in_params(eqn.params):
                inner_live = self._inner(sub, eqn, reads, live, hot)
                inner_wide = self._inner(sub, eqn, reads, wide, widened)
                self(sub, inner_live, inner_wide)
                outs = [o for o in sub.outvars if isinstance(o, jcore.Var)]
                widened = widened or any(o in inner_wide for o in outs)  # (made inside)
            backward = _paths.is_backward(str(eqn.source_info.name_stack))
            if backward:
                for v in reads:
                    if v in made:
                        made_in = _paths.module_path(str(made[v].source_info.name_stack))
                        key = (tuple(v.aval.shape), made_in)  # type: ignore[attr-defined]  # a ShapedArray
                        self.found.setdefault(
                            key, (eqn.primitive.name, _size(v.aval) * 4, v in wide)
                        )
            if hot:
                live.update(eqn.outvars)
            if widened:
                wide.update(eqn.outvars)
            if hot and not backward:
                made.update((v, eqn) for v in eqn.outvars if _large_f32(v))

    @staticmethod
    def _inner(sub, eqn, reads, outer: set, hot: bool) -> set:
        """The sub-program's inputs in `outer`: by position where it takes the equation's
        operands (jit's), else all of them where any operand is."""
        if len(sub.invars) == len(eqn.invars):
            return {w for w, v in zip(sub.invars, eqn.invars) if v in reads and v in outer}
        return set(sub.invars) if hot else set()


def _large_f32(v) -> bool:
    aval = getattr(v, "aval", None)
    return aval is not None and aval.dtype == np.float32 and _logits_sized(aval)
