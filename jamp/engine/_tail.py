"""A loss's tail after a large 16-bit output is widened: recomputed in the backward, not kept.

A wrapped model under `mixed_bfloat16` hands its logits to the loss in the policy's float32
output dtype: one `convert_element_type` from bf16. Differentiated as written, the loss keeps
float32 values of the logits' size for its backward (its `exp(x - max)`, the widened logits
themselves), and `jnp.take_along_axis`'s gather of the label's logit transposes into a scatter
into a float32 zero array of the same size: for GPT-2 small at batch 8 x 1024 x 50304, 1.5 GiB
of float32 alive at the step's peak (XLA's plan for an H200).

`recompute_widened(fn)` traces `fn`, finds each large 16-to-32-bit widening whose consumers
(everything computed from it, transitively) are cheap elementwise work and reductions (no
matmul, no loop, no effect), and evaluates those consumers (the tail) under `jax.checkpoint`:

* what the tail computes much smaller than the widened value (per-position maxima,
  log-normalizers, the picked logits: under `LARGE_FROM` of its elements) is kept, by name, for
  the backward;
* what it computes of about the widened value's size (the value itself, a slice of it such as
  the next-token shift `logits[:, :-1]`, `exp(x - max)`) is recomputed there from the 16-bit
  value, inside the backward's own elementwise kernel: no logits-sized float32 buffer is kept or
  written;
* a gather that picks elements along the last axis (`take_along_axis` of the labels, also over
  a batch with axes of size 1, which it gathers as offsets) stays a gather forward (one element
  read per row: no third pass over the logits beside the log-normalizer's two), and its
  backward is a select where the index hits, fused into the backward's elementwise kernel (no
  scatter into a float32 zero array). Out-of-range indices get
  what the gather's mode gives them (`clip`: the nearest; `fill`: its fill value, NaN by
  default) and no gradient outside `clip`;
* a slice of the positions (any axes but the last), as the next-token shift of Hugging Face's
  Flax recipe writes it (`logits[..., :-1, :]` against `labels[..., 1:]`), is taken last: the
  tail runs at all positions (other operands of the sliced shape padded with zeros), and what
  it computes is sliced only where positions meet (a sum or mean over them, a reshape that moves
  them, an operation not known to keep them apart). The gradient outside the slice is zero, as
  the slice's would be. Through the slice itself (its transpose, a pad, is not elementwise) XLA
  could not give the 16-bit logits' gradient the logits' own buffer: GPT-2 small, one more
  logits-sized bf16 buffer at the peak. A slice of the 16-bit value that is then widened
  (`logits[:, :-1].astype(f32)`) belongs to the tail, as the widening does.

Losses so covered, with the logits shifted or the inputs: optax's cross-entropy on integer or
one-hot labels (`softmax_cross_entropy`, `smooth_labels`), `log_softmax` and a pick, a mean
masked by padding, a z-loss (`logsumexp(logits) ** 2`), the positions flattened first
(`logits.reshape(-1, vocab)`). A slice of the last axis (the vocabulary: `logits[..., :50257]`)
is an ordinary operation of the tail: nothing float32 of the logits' size is kept, but the
gradient is padded.

Values and gradients are those of `fn`, computed by the same operations in the same dtypes
(at more positions, where a slice is taken last). `fn` runs as traced when it has no such tail.
The label picks are `_tail_picks`', the slices of the positions `_tail_positions`'.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from jamp.engine import _guard
from jamp.engine import _tail_picks as P
from jamp.engine import _tail_positions as S
from jamp.engine import _values as V

#: A widening of fewer elements than this is left alone: recomputing its tail saves little.
MIN_ELEMENTS = 1 << 20
#: The name under which the tail's small values are kept for its backward.
KEPT = "jamp_tail_kept"
#: The share of the widened value's elements from which a value of its tail is large (recomputed in
#: the backward, not kept): a slice of the logits (`logits[:, :-1]`, the next-token shift) is
#: large; a row's statistic (one value per position: a vocabulary's share) is small.
LARGE_FROM = 1 / 8

# A tail with any of these inside would be costly (or unsafe) to run twice.
_COSTLY = frozenset(
    {
        "dot_general",
        "conv_general_dilated",
        "ragged_dot",
        "ragged_dot_general",
        "while",
        "scan",
        "pallas_call",
    }
)
_JIT = ("jit", "pjit")


def _size(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def _is_seed(eqn) -> bool:
    """A 16-bit float widened to float32 (or wider), large enough to be worth recomputing."""
    if eqn.primitive.name != "convert_element_type" or not isinstance(eqn.invars[0], jcore.Var):
        return False
    src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype  # type: ignore[attr-defined]
    return (
        V.is_float_dtype(src)
        and V.is_float_dtype(dst)
        and np.dtype(src).itemsize == 2
        and np.dtype(dst).itemsize >= 4
        and _size(eqn.outvars[0].aval) >= MIN_ELEMENTS
    )


def _cheap(eqn) -> bool:
    if eqn.primitive.name in _COSTLY or eqn.effects:
        return False
    return all(_cheap(e) for sub in V.sub_jaxprs(eqn) for e in sub.eqns)


def _closure(eqns, start: int) -> set[int] | None:
    """Indices of the equations computed from equation `start`'s output, or None if one of them
    is not cheap."""
    tainted = set(eqns[start].outvars)
    found = {start}
    for i in range(start + 1, len(eqns)):
        eqn = eqns[i]
        if any(isinstance(v, jcore.Var) and v in tainted for v in eqn.invars):
            if not _cheap(eqn):
                return None
            found.add(i)
            tainted.update(eqn.outvars)
    return found


def _slicing(eqns, seed: int) -> int | None:
    """The equation that slices the value equation `seed` widens (`logits[:, :-1].astype(f32)`),
    if a slice makes it."""
    widened = eqns[seed].invars[0]
    for j in range(seed - 1, -1, -1):
        if widened in eqns[j].outvars:
            return j if eqns[j].primitive.name == "slice" else None
    return None


def find_tail(jaxpr: jcore.Jaxpr) -> tuple[set[int], int]:
    """(indices of the tail's equations, the smallest widened size) of `jaxpr`; empty if none. A
    slice that the widened value is taken from belongs to the tail where all it makes does."""
    tail: set[int] = set()
    smallest = 0
    for i, eqn in enumerate(jaxpr.eqns):
        if i in tail or not _is_seed(eqn):
            continue
        start = _slicing(jaxpr.eqns, i)
        found = None if start is None or start in tail else _closure(jaxpr.eqns, start)
        found = found or _closure(jaxpr.eqns, i)
        if found is not None:
            tail |= found
            size = _size(eqn.outvars[0].aval)
            smallest = min(smallest, size) if smallest else size
    return tail, smallest


@jax.custom_vjp
def _gradient_written(x):
    """`x`, whose gradient is written out whole in its own dtype before anything reads it.

    The gradient of the 16-bit logits is one elementwise kernel over the recomputed tail, read by
    the head's two GEMMs; where a reduction reads it too (a biased head's bias gradient), XLA
    writes the tail's float32 result for that reduction to convert and sum (twice the bytes, a
    float32 logits-sized buffer). Written in 16 bits first, each reader reads that."""
    return x


def _gradient_written_fwd(x):
    return x, None


def _gradient_written_bwd(_, g):
    return (lax.optimization_barrier(g),)


_gradient_written.defvjp(_gradient_written_fwd, _gradient_written_bwd)


@dataclasses.dataclass
class _Program:
    """The part of a jaxpr that `_run` reads (a `jcore.Jaxpr` would want JAX's debug info)."""

    constvars: list
    invars: list
    outvars: list
    eqns: list


def _run(jaxpr, consts, args, keep_below: int) -> list:
    """Evaluates `jaxpr`'s tail: sub-programs inlined, single-element gathers as picks, slices
    of the positions taken last (`Padded`), and every float value smaller than `keep_below`
    elements named `KEPT`. Its results may be `Padded`."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
            if eqn.primitive.name in _JIT:
                closed = eqn.params["jaxpr"]
                outs = _run(closed.jaxpr, closed.consts, invals, keep_below)
            else:
                done = S.positionwise(eqn, invals, keep_below)
                outs = (
                    P.bind(eqn, [S.taken(x) for x in invals], keep_below) if done is None else done
                )
        if eqn.primitive.name in S.REDUCTIONS and np.size(S.whole_of(invals[0])) >= keep_below:
            # A row's statistic of the large value: XLA's Triton softmax fusion would otherwise
            # join it and the elementwise work that reads it into one kernel writing a float32
            # result of the large value's size (log_softmax's, for a one-hot label's product).
            outs = [S.each(lax.optimization_barrier, o) for o in outs]
        for var, out in zip(eqn.outvars, outs):
            if isinstance(var, jcore.DropVar):
                continue
            whole = S.whole_of(out)
            small = 0 < np.size(whole) < keep_below and V.is_float_dtype(V.dtype_of(whole))
            env[var] = S.each(lambda o: checkpoint_name(o, KEPT), out) if small else out
    return [read(v) for v in jaxpr.outvars]


def _evaluate(jaxpr: jcore.Jaxpr, consts, args, tail: set[int], keep_below: int) -> list:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    head = [e for i, e in enumerate(jaxpr.eqns) if i not in tail]
    rest = [e for i, e in enumerate(jaxpr.eqns) if i in tail]
    for eqn in head:
        with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
            outs = V.bind(eqn, [read(v) for v in eqn.invars], eqn.params)
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, jcore.DropVar))
    made = {v for e in rest for v in e.outvars}
    needed = list(
        dict.fromkeys(
            v for e in rest for v in e.invars if isinstance(v, jcore.Var) and v not in made
        )
    )
    outs = [v for v in dict.fromkeys(jaxpr.outvars) if isinstance(v, jcore.Var) and v in made]
    sub = _Program([], needed, outs, rest)

    policy = jax.checkpoint_policies.save_only_these_names(KEPT)
    # No barrier against XLA's common-subexpression elimination: with one, the gradient of the
    # 16-bit logits cannot take the logits' own buffer (H200 program of GPT-2 small: one more
    # bf16 logits-sized buffer, +786 MiB, at the peak); without, nothing float32 is kept either.
    sliced = {e.outvars[0]: e.invars[0] for e in rest if e.primitive.name == "slice"}
    widened = {sliced.get(e.invars[0], e.invars[0]) for e in rest if _is_seed(e)}  # type: ignore[arg-type]  # a seed's operand is a Var
    values = jax.checkpoint(
        lambda *xs: [S.taken(o) for o in _run(sub, [], xs, keep_below)],
        policy=policy,
        prevent_cse=False,
    )(*[_gradient_written(read(v)) if v in widened else read(v) for v in needed])
    env.update(zip(outs, values))
    return [read(v) for v in jaxpr.outvars]


def recompute_widened(fn: Callable, on_trace: Callable | None = None) -> Callable:
    """`fn` with the tail after each large 16-bit widening recomputed in the backward (see the
    module docstring); the same values and gradients. `on_trace(jaxpr)`, if given, sees the
    traced program of `fn` (e.g. to check its dtypes) each time it is traced."""

    def run(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if on_trace is not None:
            on_trace(closed.jaxpr)
        tail, smallest = _guard.attempt(
            "the loss's tail", lambda: "the loss", lambda: find_tail(closed.jaxpr), (set(), 0)
        )
        flat = jax.tree.leaves(args)
        outs = None
        if tail:
            outs = _guard.attempt(
                "the loss's tail",
                lambda: "the loss",
                lambda: _evaluate(
                    closed.jaxpr, closed.consts, flat, tail, int(smallest * LARGE_FROM)
                ),
                None,
            )
        if outs is None:
            outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


__all__ = ["KEPT", "LARGE_FROM", "MIN_ELEMENTS", "find_tail", "recompute_widened"]
