"""The engine's interpreter: evaluates a traced program again, equation by equation, under a
compute dtype (see `jamp.engine`).

The interpreter itself (`jamp.engine._interpreter`) only walks a program: it keeps each
variable's value and weakness and hands every equation to the passes below, in their order;
each pass decides one concern. Sub-programs come back here through `Context.interpret`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import jax.numpy as jnp
from jax.extend import core as jcore

from jamp import activations as act
from jamp import fp8, mixed_ops, scopes
from jamp.engine import _attention_pass, _passes, _recompute_pass
from jamp.engine import _values as V
from jamp.engine._context import ComputeFor, Context
from jamp.engine._interpreter import Pass, Phase, Program

__all__ = ["ComputeFor", "PASSES", "eval_jaxpr", "in_phase_order", "interpret"]

Factory = Callable[[Program], Optional[Pass]]


def in_phase_order(factories: Sequence[Factory]) -> tuple[Factory, ...]:
    """`factories` (each a `Pass` subclass's `start`), checked to run their passes in `Phase`
    order with exactly one that evaluates; raises ValueError naming the first pass out of order."""
    passes = [start.__self__ for start in factories]  # type: ignore[attr-defined]  # classmethods
    for before, after in zip(passes, passes[1:]):
        if after.phase < before.phase:
            raise ValueError(
                f"engine pass {after.__name__} ({after.phase.name}) runs after "
                f"{before.__name__} ({before.phase.name}): passes run in Phase order"
            )
    evaluators = [p.__name__ for p in passes if p.phase == Phase.EVALUATE]
    if len(evaluators) != 1:
        raise ValueError(f"one engine pass evaluates each equation, not {evaluators}")
    return tuple(factories)


#: The passes, as factories of a program's (None: nothing to do in it), in the order each
#: equation meets them, which their phases fix (`Phase`, checked as the module loads): a region
#: recomputed in the backward takes its equations before anything else sees them; an attention's
#: steps are held symbolically before they could be evaluated; the placements are read before
#: the evaluation that uses them; and what follows values through layout operations (copies,
#: saved arrays, repeats) reads what the evaluation produced. Within a phase the order is free.
PASSES: tuple[Factory, ...] = in_phase_order(
    (
        _recompute_pass.RecomputeRegions.start,  # activation functions recomputed in the backward
        _attention_pass.FuseAttention.start,  # attention as one call
        _passes.FollowPlacements.start,  # the sharded parameters' placements
        _passes.DtypeRules.start,  # evaluates: the compute dtype, the dtypes values are carried in
        _passes.FollowCopies.start,  # the params' 16-bit copies a train step holds ready
        _passes.FollowSaved.start,  # the 16-bit arrays the backward keeps (fp8 reads them)
        _attention_pass.NoteRepeats.start,  # keys and values repeated for grouped-query attention
    )
)


def interpret(
    jaxpr,
    consts,
    args,
    compute_dtype,
    ctx: Context,
    weak: Optional[Sequence[bool]],
    placed: Optional[Sequence[Optional[mixed_ops.Placed]]] = None,
):
    """Evaluates `jaxpr`; returns its outputs (possibly lowered) and whether each is weak.

    `placed` gives, per argument, its placement on a mesh (a sharded parameter) or None."""
    program = Program(jaxpr, consts, args, compute_dtype, ctx, weak, placed)
    for start in PASSES:
        made = start(program)
        if made is not None:
            program.passes.append(made)
    for index in range(len(jaxpr.eqns)):
        program.step(index)
    return program.results()


def eval_jaxpr(
    jaxpr: jcore.Jaxpr,
    consts,
    args,
    compute_dtype,
    compute_for: ComputeFor,
    *,
    activations: str = "float32",
    weak: Optional[Sequence[bool]] = None,
    placed: Optional[Sequence[Optional[mixed_ops.Placed]]] = None,
    head_in_fp8: bool = False,
    fuse_attention: Union[bool, Callable[[str], bool]] = True,
    calls: Optional[scopes.LinenCalls] = None,
):
    """Evaluate `jaxpr` on `args`, with matmuls in the dtype that `compute_for` picks per equation.

    Args:
      jaxpr: the program to evaluate.
      consts: values of its constvars.
      args: values of its invars (arrays or tracers).
      compute_dtype: the dtype in force where no equation says otherwise (None: as traced).
      compute_for: `(eqn, inherited_dtype) -> dtype or None`.
      activations: "float32" keeps every value in its traced dtype; "compute" lets float32 values
        between operations be carried in a 16-bit compute dtype (see `jamp.activations`);
        "auto" picks per platform.
      weak: per argument, whether it takes the dtype of what it is combined with (e.g. the
        model's variables); see `jamp.activations`.
      placed: per argument, a `jamp.mixed_ops.Placed` (a sharded parameter) or None.
      fuse_attention: run each attention recognised in the program (softmax(q k^T) v, see
        `jamp.engine._attention`) under a 16-bit compute dtype as one call (`jamp.attention`):
        cuDNN's fused kernel on NVIDIA GPUs; or a function of the attention's module path that
        says where.
      head_in_fp8: under fp8 matmuls (`jamp.fp8.MATMUL_MARKER`), whether the program's last
        matmul (a model's output head) is fp8 too; by default it inherits bfloat16 (in
        `jamp.fp8.head_outside`, the program has no head: it is fp8).
      calls: the linen module calls recorded while `jaxpr` was traced, which name its fp8 sites
        by their modules' params paths (`jamp.fp8.site_name`).

    Returns:
      The list of output values, in the dtypes the program was traced with.
    """
    head = None if head_in_fp8 or fp8.head_is_outside() else V.last_dot(jaxpr)
    form = act.resolve(activations)
    act.note(form, compute_dtype)
    ctx = Context(
        compute_for,
        form == "compute",
        head,
        fuse_attention=fuse_attention,
        calls=calls,
        interpret=interpret,
    )
    outs, _ = interpret(jaxpr, consts, args, compute_dtype, ctx, weak, placed)
    # A literal output (e.g. a constant returned by an inlined jit) comes back as an array.
    return [
        jnp.asarray(o, v.aval.dtype) if isinstance(v, jcore.Literal) else V.cast(o, v.aval.dtype)  # type: ignore[attr-defined]  # a ShapedArray
        for o, v in zip(outs, jaxpr.outvars)
    ]
