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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from jamp.engine import _guard
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
_REDUCTIONS = frozenset(
    {"reduce_max", "reduce_min", "reduce_sum", "reduce_prod", "argmax", "argmin"}
)
# Operations element by element (operands of the result's shape, of size 1 along an axis, or
# scalars): computed at all positions where an operand is (`_Padded`).
_ELEMENTWISE = frozenset(
    """abs add add_any and ceil clamp convert_element_type copy cos div eq erf erf_inv erfc exp
    exp2 expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg not
    or pow reduce_precision rem round rsqrt select_n sign sin sqrt square stop_gradient sub tan
    tanh xor""".split()
)


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


def _pick_form(eqn, operand) -> str | None:
    """How a gather picks elements along its operand's last axis: "batched" (every other axis a
    batching axis, one or more picks per row: `jnp.take_along_axis(x, idx, axis=-1)`), "rows"
    (one pick per row, the operand's axes of size 1 taken as offsets, as `take_along_axis` does
    for them: a batch of one sequence), or None for any other gather."""
    if eqn.primitive.name != "gather":
        return None
    dn = eqn.params["dimension_numbers"]
    nd = np.ndim(operand)
    if (
        nd < 1
        or tuple(dn.collapsed_slice_dims) != (nd - 1,)
        or tuple(dn.start_index_map) != (nd - 1,)
        or any(s != 1 for s in eqn.params["slice_sizes"])
        or eqn.invars[1].aval.shape[-1] != 1
    ):
        return None
    on = tuple(getattr(dn, "operand_batching_dims", ()))
    among = tuple(getattr(dn, "start_indices_batching_dims", ()))
    batch = tuple(range(nd - 1))
    if tuple(dn.offset_dims) == () and on == batch and among == batch:
        return "batched"
    shape = np.shape(operand)
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if (
        all(shape[d] == 1 for d in batch if d not in on)
        and list(on) == sorted(on)
        and list(among) == sorted(among)
        and _size(eqn.outvars[0].aval) == rows
    ):  # the axes that are not batching axes have size 1: picks and rows in the same order
        return "rows"
    return None


def _pick(eqn, form: str, x, indices):
    """The gather `eqn`, of elements along `x`'s last axis (`form`: see `_pick_form`): the gather
    itself forward (it reads one element per pick), and as its transpose a select of the
    cotangent where the index hits (fused into the backward's elementwise kernel), not a scatter
    into zeros."""
    vocab = x.shape[-1]
    mode = eqn.params.get("mode")
    clipped = "CLIP" in str(mode) or "PROMISE" in str(mode)

    @jax.custom_vjp
    def pick(x, indices):
        return V.bind(eqn, [x, indices], eqn.params)[0]

    def forward(x, indices):
        return pick(x, indices), indices

    def backward(indices, g):
        if form == "rows":  # one pick per row, in the rows' order
            indices, g = indices.reshape(x.shape[:-1] + (1,)), g.reshape(x.shape[:-1])
        idx = indices[..., 0]  # [*batch, *extra]
        extra = idx.ndim - (x.ndim - 1)
        if clipped:
            idx = jnp.clip(idx, 0, vocab - 1)  # out of range outside `clip`: no element is hit
        hit = lax.broadcasted_iota(idx.dtype, idx.shape + (vocab,), idx.ndim) == idx[..., None]
        spread = jnp.where(hit, g[..., None].astype(x.dtype), jnp.zeros((), x.dtype))
        axes = tuple(range(x.ndim - 1, x.ndim - 1 + extra))
        return (jnp.sum(spread, axis=axes) if axes else spread), None

    pick.defvjp(forward, backward)
    return pick(x, indices)


@dataclasses.dataclass(frozen=True)
class _Region:
    """The positions a slice of the widened value keeps (its axes but the last, the vocabulary):
    `starts` to `limits` of `whole`. `flat`: a value's positions merged into its first axis, as
    `logits.reshape(-1, vocab)` merges them."""

    whole: tuple[int, ...]
    starts: tuple[int, ...]
    limits: tuple[int, ...]
    flat: bool = False

    @property
    def lead(self) -> int:  # a value's axes that are positions
        return 1 if self.flat else len(self.whole)

    def _shape(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        return (int(np.prod(sizes, dtype=np.int64)),) if self.flat else sizes

    def kept(self) -> tuple[int, ...]:
        return self._shape(tuple(b - a for a, b in zip(self.starts, self.limits)))

    def spread(self, shape) -> tuple[int, ...]:
        """`shape` (of a value at the kept positions) over all positions."""
        return self._shape(self.whole) + tuple(shape[self.lead :])

    def take(self, x):
        """The kept positions of `x` (a value over all positions)."""
        rest = tuple(x.shape[self.lead :])
        x = x.reshape(self.whole + rest)
        x = lax.slice(x, self.starts + (0,) * len(rest), self.limits + rest)
        return x.reshape(self.kept() + rest)

    def put(self, x):
        """`x` (a value at the kept positions) over all positions, zeros at the others."""
        rest = tuple(x.shape[self.lead :])
        x = x.reshape(tuple(b - a for a, b in zip(self.starts, self.limits)) + rest)
        edges = [(a, w - b, 0) for a, b, w in zip(self.starts, self.limits, self.whole)]
        x = lax.pad(x, jnp.zeros((), x.dtype), edges + [(0, 0, 0)] * len(rest))
        return x.reshape(self._shape(self.whole) + rest)

    def mask(self, shape):
        """True at the kept positions of an array of `shape` (over all positions, not flat)."""
        keep = jnp.ones(shape, bool)
        for axis, (a, b) in enumerate(zip(self.starts, self.limits)):
            at = lax.broadcasted_iota(np.int32, shape, axis)
            keep = keep & (at >= a) & (at < b)
        return keep


@dataclasses.dataclass(frozen=True)
class _Padded:
    """A value of the tail at the positions `region` keeps, held as `whole`, the same computed at
    all positions: a slice of the widened value (the next-token shift `logits[:, :-1]`) is taken
    of the values computed from it only where positions meet (a sum over them, a reshape that
    moves them), so the backward reads and writes the logits whole. XLA gives the 16-bit
    logits' gradient the logits' own buffer then; through a slice it cannot (its transpose, a
    pad, is not elementwise): one more 16-bit logits-sized buffer at the step's peak."""

    whole: Any
    region: _Region


def _within(x, region: _Region):
    """`x`, whose gradient is zero outside the positions `region` keeps (what a slice's transpose
    gives; what the tail computes there is not the program's, and may not be finite)."""

    @jax.custom_vjp
    def within(x):
        return x

    def backward(_, g):
        return (jnp.where(region.mask(g.shape), g, jnp.zeros((), g.dtype)),)

    within.defvjp(lambda x: (x, None), backward)
    return within(x)


def _shift(eqn, x, keep_below: int) -> _Padded | None:
    """A slice of the positions (not the last axis) of a large value, kept for last."""
    if eqn.primitive.name != "slice" or isinstance(x, _Padded) or np.size(x) < keep_below:
        return None
    starts, limits = tuple(eqn.params["start_indices"]), tuple(eqn.params["limit_indices"])
    strides = eqn.params.get("strides")
    if (strides and any(s != 1 for s in strides)) or (starts[-1], limits[-1]) != (0, x.shape[-1]):
        return None
    region = _Region(tuple(x.shape[:-1]), starts[:-1], limits[:-1])
    return _Padded(_within(x, region), region)


def _spread_operand(x, region: _Region):
    """An operand of an elementwise operation over all positions: None if it cannot be."""
    if isinstance(x, _Padded):
        return x.whole if x.region == region else None
    shape = np.shape(x)
    if not shape or all(d == 1 for d in shape[: region.lead]):  # the same at every position
        return x
    return region.put(x) if tuple(shape[: region.lead]) == region.kept() else None


def _picks_at(invals, region: _Region) -> bool:
    """A pick's operand `_Padded`, its indices at the positions `region` keeps."""
    operand, indices = invals
    return (
        isinstance(operand, _Padded)
        and operand.region == region
        and not isinstance(indices, _Padded)
        and tuple(np.shape(indices)[: region.lead]) == region.kept()
    )


def _layout(eqn, x: _Padded):
    """A reshape, broadcast or squeeze of `x` that keeps its positions, over all of them; None
    for one that moves them."""
    name, region, shape = eqn.primitive.name, x.region, eqn.outvars[0].aval.shape
    lead = region.lead
    if name == "reshape" and eqn.params.get("dimensions") is not None:
        return None
    if name == "reshape" and not region.flat and shape[1:] == np.shape(x.whole)[lead:]:
        if len(shape) and shape[0] == int(np.prod(region.kept(), dtype=np.int64)):
            flat = dataclasses.replace(region, flat=True)  # the positions merged into one axis
            return _Padded(x.whole.reshape(flat.spread(shape)), flat)
    if tuple(shape[:lead]) != region.kept():
        return None
    if name == "reshape":
        return _Padded(x.whole.reshape(region.spread(shape)), region)
    if name == "broadcast_in_dim" and tuple(eqn.params["broadcast_dimensions"][:lead]) == tuple(
        range(lead)
    ):
        params = dict(eqn.params, shape=region.spread(shape))
        return _Padded(V.bind(eqn, [x.whole], params)[0], region)
    if name == "squeeze" and min(eqn.params["dimensions"]) >= lead:
        return _Padded(V.bind(eqn, [x.whole], eqn.params)[0], region)
    return None


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


def _positionwise(eqn, invals, keep_below: int) -> list | None:
    """`eqn` at all positions where an operand is `_Padded` (its results `_Padded` too); None
    where it mixes positions (a sum over them) or is not known to keep them apart."""
    if not invals:
        return None
    if (shifted := _shift(eqn, invals[0], keep_below)) is not None:
        return [shifted]
    padded = [x for x in invals if isinstance(x, _Padded)]
    if not padded:
        return None
    name, region = eqn.primitive.name, padded[0].region
    if name in ("reshape", "broadcast_in_dim", "squeeze") and len(invals) == 1:
        out = _layout(eqn, padded[0])
        return None if out is None else [out]
    if any(tuple(v.aval.shape[: region.lead]) != region.kept() for v in eqn.outvars):
        return None  # a result without the positions: they meet
    if name in _ELEMENTWISE:
        args = [_spread_operand(x, region) for x in invals]
        if any(a is None for a in args):
            return None
        outs = V.bind(eqn, args, eqn.params)
    elif name in _REDUCTIONS and all(a >= region.lead for a in eqn.params["axes"]):
        outs = V.bind(eqn, [padded[0].whole], eqn.params)
    elif _pick_form(eqn, eqn.invars[0].aval) == "batched" and _picks_at(invals, region):
        outs = _bind(eqn, [padded[0].whole, region.put(invals[1])], keep_below)
    else:
        return None
    return [_Padded(o, region) for o in outs]


def _taken(x):
    """The program's value of `x`: its kept positions if it is `_Padded`."""
    return x.region.take(x.whole) if isinstance(x, _Padded) else x


def _bind(eqn, invals, keep_below: int) -> list:
    """`eqn` on `invals`; a single-element gather of a large value as a pick."""
    if invals and (form := _pick_form(eqn, invals[0])) and np.size(invals[0]) >= keep_below:
        return [_pick(eqn, form, *invals)]
    return V.bind(eqn, invals, eqn.params)


def _whole(x):
    return x.whole if isinstance(x, _Padded) else x


def _each(f, out):
    return _Padded(f(out.whole), out.region) if isinstance(out, _Padded) else f(out)


def _run(jaxpr, consts, args, keep_below: int) -> list:
    """Evaluates `jaxpr`'s tail: sub-programs inlined, single-element gathers as picks, slices
    of the positions taken last (`_Padded`), and every float value smaller than `keep_below`
    elements named `KEPT`. Its results may be `_Padded`."""
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
                done = _positionwise(eqn, invals, keep_below)
                outs = _bind(eqn, [_taken(x) for x in invals], keep_below) if done is None else done
        if eqn.primitive.name in _REDUCTIONS and np.size(_whole(invals[0])) >= keep_below:
            # A row's statistic of the large value: XLA's Triton softmax fusion would otherwise
            # join it and the elementwise work that reads it into one kernel writing a float32
            # result of the large value's size (log_softmax's, for a one-hot label's product).
            outs = [_each(lax.optimization_barrier, o) for o in outs]
        for var, out in zip(eqn.outvars, outs):
            if isinstance(var, jcore.DropVar):
                continue
            whole = _whole(out)
            small = 0 < np.size(whole) < keep_below and V.is_float_dtype(V.dtype_of(whole))
            env[var] = _each(lambda o: checkpoint_name(o, KEPT), out) if small else out
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
        lambda *xs: [_taken(o) for o in _run(sub, [], xs, keep_below)],
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
