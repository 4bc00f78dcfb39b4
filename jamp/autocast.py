"""Op-level autocast for JAX functions: rewrite a traced program so its matmuls use a compute dtype.

`autocast(fn, policy)` is the public form (`jamp.autocast`): any JAX function (a plain function,
a Haiku or Equinox apply, an Equinox module) under a policy, with overrides by name-scope path.
The engine beneath it, and beneath `jamp.wrap`, is `rewrite(fn, compute_dtype)`: it traces `fn` to a jaxpr and evaluates it again, replacing every
`dot_general` and `conv_general_dilated` whose floating operands are not already in the compute
dtype by its mixed-precision form (`jamp.mixed_ops`). With `activations="float32"` every other
operation runs exactly as traced, so reductions, softmax, normalization and the loss keep their
float32 numerics and every intermediate dtype is unchanged; with `activations="compute"` the
values between matmuls may be carried in the 16-bit compute dtype, operation by operation as
`jamp.activations` decides. Either way the function's inputs and outputs keep their dtypes.

Working on the traced program rather than on module attributes is what lets a policy reach matmuls
that no `dtype=` argument controls: layers that hard-code `dtype=jnp.float32`, raw `x @ param`
products, shared submodules, and matmuls inside `jit`, `scan`, `cond`, `while_loop` and `remat`.
Custom-derivative functions (`jax.custom_jvp` / `custom_vjp`) are the exception: their primal is
rewritten, but under differentiation their own rules run as written, matmuls included. Kernels
(`pallas_call`) run as written; `shard_map` bodies are rewritten and mapped again. A higher-order
primitive not in `REWRITTEN_INSIDE`, with matmuls inside to rewrite, is an
`UnsupportedProgramError` at trace time; what differs between JAX releases is read through
`jamp.jax_compat`. When nothing would change (float32 everywhere), `fn` runs as written.

Where an equation runs is decided by `compute_for(eqn, inherited)`, which returns the compute dtype
for that equation (or None to leave it as traced); `inherited` is the dtype chosen for the enclosing
equation when the interpreter descends into a sub-program. `jamp.wrap` uses the name stack that
Flax module calls leave on each equation to give submodules policies of their own.

Example::

  loss = rewrite(lambda w, x: jnp.tanh(x @ w).sum(), jnp.bfloat16)(w, x)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jamp import activations as act
from jamp import fp8, jax_compat, mixed_ops, precision

ComputeFor = Callable[[jcore.JaxprEqn, Optional[np.dtype]], Optional[np.dtype]]
#: `(key_path, shape) -> (sharding, gathered) or None`: where a leaf of a weak argument (a
#: model's variables) lives on a mesh, and where a matmul reads it (None: where XLA picks);
#: `key_path` is the leaf's `jax.tree_util` key path within its argument.
PlacementFor = Callable[
    [tuple, tuple], Optional[tuple[jax.sharding.Sharding, Optional[jax.sharding.Sharding]]]
]

_PLACEMENT: contextvars.ContextVar[Optional[PlacementFor]] = contextvars.ContextVar(
    "jamp_autocast_placement", default=None
)


@contextlib.contextmanager
def placing(placement_for: PlacementFor):
    """While a function is traced in this context, `autocast` treats the weak-argument leaves that
    `placement_for` places as sharded parameters: each matmul casts them to the compute dtype on
    their own shard and reads them gathered as `placement_for` says, so the gather moves 16-bit
    values (once, for forward and backward), and hands their gradients back in the reduce dtype,
    constrained to the same sharding (see `jamp.mixed_ops.Placed`).
    Values are unchanged: shardings only say where they live. `jamp.sharding`'s steps set it."""
    token = _PLACEMENT.set(placement_for)
    try:
        yield
    finally:
        _PLACEMENT.reset(token)


_DOT = lax.dot_general_p
_CONV = lax.conv_general_dilated_p


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _needs_rewrite(invals, compute_dtype) -> bool:
    lhs, rhs = invals
    if compute_dtype is None or not (_is_float(lhs) and _is_float(rhs)):
        return False
    if lhs.dtype != compute_dtype or rhs.dtype != compute_dtype:
        return True
    # Already in the compute dtype: a 16-bit product still gains from fp32 accumulation (and on
    # CPU from the fast bf16 kernels); a float32 one is left bit-identical.
    return compute_dtype.itemsize < 4


#: Higher-order primitives whose sub-programs are ordinary programs that the interpreter rewrites
#: (keeping each sub-program's signature). Kernels (`jax_compat.is_kernel`) run as written; any
#: other primitive with a matmul to rewrite inside is an `UnsupportedProgramError`.
REWRITTEN_INSIDE = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "scan",
        "while",
        "cond",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "shard_map",
    }
)


def _sub_jaxprs(eqn):
    """The sub-programs the interpreter may look into: none of a kernel's."""
    return [] if jax_compat.is_kernel(eqn) else jcore.jaxprs_in_params(eqn.params)


def _has_matmul(jaxpr: jcore.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive in (_DOT, _CONV):
            return True
        if any(_has_matmul(sub) for sub in _sub_jaxprs(eqn)):
            return True
    return False


def _choose(ctx: "_Ctx", eqn, inherited):
    """The compute dtype of `eqn`; a choice that reads scope paths (`jamp.autocast`'s overrides)
    also gets the name stack of the programs around this one, which the equation's own lacks."""
    if getattr(ctx.compute_for, "reads_scope_prefix", False):
        return ctx.compute_for(eqn, inherited, ctx.prefix)
    return ctx.compute_for(eqn, inherited)


def _changes(jaxpr: jcore.Jaxpr, compute_dtype, ctx: "_Ctx") -> bool:
    """Whether evaluating `jaxpr` under `compute_dtype` would run anything differently than traced."""
    for eqn in jaxpr.eqns:
        dtype = _choose(ctx, eqn, compute_dtype)
        if dtype is not None and ctx.lower and dtype.itemsize < 4:
            return True  # activations may be carried in 16 bits from here on
        if eqn.primitive in (_DOT, _CONV) and _needs_rewrite([v.aval for v in eqn.invars], dtype):
            return True
        if any(_changes(sub, dtype, _within(ctx, eqn)) for sub in _sub_jaxprs(eqn)):
            return True
    return False


def _spec(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


@dataclasses.dataclass(frozen=True)
class _Ctx:
    compute_for: ComputeFor
    lower: bool  # carry float32 activations in the 16-bit compute dtype (`jamp.activations`)
    # fp8: the model's last matmul (its output head), which inherits bfloat16 instead of fp8;
    # whether fp8 matmuls here may read a scaling state (not in re-traced sub-programs, whose
    # closures could not carry it); the name stack above this program; the trace's site tally.
    head: Optional[jcore.JaxprEqn] = None
    stateful: bool = True
    prefix: str = ""
    sites: dict = dataclasses.field(default_factory=dict, compare=False)


def _stateless(ctx: _Ctx) -> _Ctx:
    return dataclasses.replace(ctx, stateful=False) if ctx.stateful else ctx


def _last_dot(jaxpr: jcore.Jaxpr) -> Optional[jcore.JaxprEqn]:
    """The program's last `dot_general`, sub-programs included (in evaluation order)."""
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive is _DOT:
            return eqn
        for sub in reversed(list(_sub_jaxprs(eqn))):
            found = _last_dot(sub)
            if found is not None:
                return found
    return None


def _placed_for(placed, compute_dtype):
    """The operands' placements for one matmul: a float32 matmul (a module kept in float32)
    keeps its gradients float32 across the wire too."""
    if placed is None:
        return mixed_ops._UNPLACED
    if compute_dtype.itemsize >= 4:
        return tuple(
            None if p is None else dataclasses.replace(p, reduce_dtype=np.dtype(np.float32))
            for p in placed
        )
    return tuple(placed)


def _follow_placement(eqn, placed):
    """The placement of a transpose's or a float cast's result, from its operand's."""
    (p,) = placed if len(placed) == 1 else (None,)
    if p is None or not isinstance(p.sharding, jax.sharding.NamedSharding):
        return None
    name = eqn.primitive.name
    if name == "convert_element_type" and _is_float_dtype(eqn.outvars[0].aval.dtype):
        return p
    if name == "transpose":
        perm, ndim = jax_compat.param(eqn, "permutation"), eqn.invars[0].aval.ndim

        def permuted(sharding):
            if not isinstance(sharding, jax.sharding.NamedSharding):
                return None
            spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
            return jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(*(spec[d] for d in perm))
            )

        return dataclasses.replace(p, sharding=permuted(p.sharding), gathered=permuted(p.gathered))
    return None


def _cast(x, dtype):
    """`x` as `dtype`; only float values are ever carried in another dtype than traced."""
    if not _is_float_dtype(dtype) or _dtype(x) == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):  # a literal: stays a constant
        return np.asarray(x, dtype)
    return lax.convert_element_type(x, dtype)


def _as_traced(eqn, invals):
    """The operands in the dtypes the equation was traced with (a no-op unless some were lowered)."""
    return [_cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)]


def _is_float_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _dtype(x) -> np.dtype:
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def _rewrite_closed(
    closed: jcore.ClosedJaxpr, compute_dtype, ctx: _Ctx, weak=None
) -> jcore.ClosedJaxpr:
    """The sub-program with its matmuls rewritten and its signature (dtypes included) unchanged."""

    ctx = _stateless(ctx)

    def run(*args):
        outs, _ = _eval(closed.jaxpr, closed.consts, args, compute_dtype, ctx, weak)
        return [_cast(o, v.aval.dtype) for o, v in zip(outs, closed.jaxpr.outvars)]

    return jax.make_jaxpr(run)(*[_spec(v.aval) for v in closed.jaxpr.invars])


def _rewrite_param(value, compute_dtype, ctx: _Ctx, weak=None):
    """Rewrite one equation parameter if it is (a tuple of) sub-programs containing matmuls.

    `weak` gives, per input of the sub-program, whether it is weak (None: none is).
    """
    if isinstance(value, jcore.ClosedJaxpr):
        if not _has_matmul(value.jaxpr):
            return value
        return _rewrite_closed(value, compute_dtype, ctx, weak)
    if isinstance(value, jcore.Jaxpr):
        if not _has_matmul(value):
            return value
        closed = _rewrite_closed(jcore.ClosedJaxpr(value, ()), compute_dtype, ctx, weak)
        # An open sub-program (e.g. remat's) has no slot for constants; keep the original if the
        # rewrite needed any, rather than changing the equation's signature.
        return value if closed.consts else closed.jaxpr
    if isinstance(value, tuple) and value and all(isinstance(v, jcore.ClosedJaxpr) for v in value):
        return tuple(_rewrite_param(v, compute_dtype, ctx, weak) for v in value)
    return value


def _body_weak(eqn, weak) -> dict:
    """param name -> which inputs of that sub-program are weak: the loop-invariant operands
    (a layer's variables) keep their weakness, the carried state is strong."""
    name = eqn.primitive.name
    if name in ("jit", "pjit"):
        return {"jaxpr": list(weak)}
    if name in ("closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"):
        return {"call_jaxpr": list(weak)}  # the sub-program takes the equation's operands
    if name == "scan":
        consts, carry = jax_compat.scan_split(eqn)
        return {"jaxpr": weak[:consts] + [False] * carry + weak[consts + carry :]}
    if name == "cond":
        return {"branches": weak[1:]}  # after the branch index
    if name == "while":
        nc, nb = jax_compat.while_split(eqn)
        carry = [False] * (len(weak) - nc - nb)
        return {"cond_jaxpr": weak[:nc] + carry, "body_jaxpr": weak[nc : nc + nb] + carry}
    return {}


def _eval_shard_map(eqn, invals, compute_dtype, ctx: _Ctx):
    """A `shard_map` with its body rewritten: the body's collectives need the mapping's axes, so it
    is mapped again rather than re-traced on its own."""
    jaxpr = jax_compat.param(eqn, "jaxpr")
    if not _has_matmul(jaxpr):
        return _bind(eqn, invals, eqn.params)
    ctx = _stateless(_within(ctx, eqn))

    def body(*xs):
        outs, _ = _eval(jaxpr, (), xs, compute_dtype, ctx, None)
        return tuple(_cast(o, v.aval.dtype) for o, v in zip(outs, jaxpr.outvars))

    return list(jax_compat.shard_map_like(eqn, body)(*invals))


def _check_rewritable(eqn, compute_dtype, ctx: _Ctx) -> None:
    """An unknown higher-order primitive with matmuls to rewrite inside fails here, at trace time:
    rewriting its sub-programs without knowing how it uses them could silently mis-lower it."""
    name = eqn.primitive.name
    if name in REWRITTEN_INSIDE or jax_compat.is_kernel(eqn):
        return
    for sub in jcore.jaxprs_in_params(eqn.params):
        if _has_matmul(sub) and _changes(sub, compute_dtype, ctx):
            raise jax_compat.unsupported(
                name, "it is a higher-order primitive with matmuls inside that jamp does not know"
            )


def _bind(eqn, invals, params):
    # `eqn.ctx` carries per-equation settings recorded at trace time (e.g. compute placement).
    with jax_compat.bind_context(eqn):
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    return out if eqn.primitive.multiple_results else [out]


def _matmul_out_dtype(eqn, compute_dtype, ctx: _Ctx):
    traced = eqn.outvars[0].aval.dtype
    lowered = ctx.lower and compute_dtype.itemsize < 4 and act.is_lowerable(traced)
    return fp8.carrier(compute_dtype) if lowered else traced


def _fp8_dot(eqn, invals, compute_dtype, ctx: _Ctx, placed):
    site = None
    if ctx.stateful:
        stack = "/".join(s for s in (ctx.prefix, str(eqn.source_info.name_stack)) if s)
        site = fp8.site_name(stack, fp8.site_counts(ctx.sites))
    out_dtype = _matmul_out_dtype(eqn, compute_dtype, ctx)
    dims = jax_compat.param(eqn, "dimension_numbers")
    return [fp8.dot_general(*invals, dims, out_dtype, site, _placed_for(placed, compute_dtype))]


def _eval_as_traced(eqn, invals, compute_dtype, ctx: _Ctx, weak=None, placed=None):
    """The equation with its matmuls rewritten and everything else as traced."""
    # The mixed matmuls cast their operands themselves: a 16-bit activation goes in as it is, and
    # its gradient comes back 16-bit.
    if eqn.primitive not in (_DOT, _CONV) or not _needs_rewrite(invals, compute_dtype):
        invals = _as_traced(eqn, invals)
    if (
        eqn.primitive is _DOT
        and fp8.is_fp8(compute_dtype)
        and _needs_rewrite(invals, compute_dtype)
    ):
        # A layer's matmul (activation x weight: one operand made of the weak arguments, the
        # variables, alone) is fp8; one of two activations (attention's scores and mix) stays
        # bfloat16, as in Transformer Engine, and so does a weight x weight product (LoRA's A @ B).
        if weak is not None and sum(map(bool, weak)) == 1:
            return _fp8_dot(eqn, invals, compute_dtype, ctx, placed)
        compute_dtype = fp8.CARRIER
    if eqn.primitive is _DOT and _needs_rewrite(invals, compute_dtype):
        out_dtype = _matmul_out_dtype(eqn, compute_dtype, ctx)
        dims = jax_compat.param(eqn, "dimension_numbers")
        where = _placed_for(placed, compute_dtype)
        return [mixed_ops.mixed_dot_general(*invals, dims, compute_dtype, out_dtype, where)]
    if eqn.primitive is _CONV and _needs_rewrite(invals, compute_dtype):
        out_dtype = _matmul_out_dtype(eqn, compute_dtype, ctx)
        where = _placed_for(placed, compute_dtype)
        conv_dtype = fp8.carrier(compute_dtype)  # fp8 is for matmuls only
        return [mixed_ops.mixed_conv(*invals, eqn.params, conv_dtype, out_dtype, where)]
    if jax_compat.is_kernel(eqn):  # a kernel runs as written, on its traced operand dtypes
        return _bind(eqn, invals, eqn.params)
    if eqn.primitive.name == "shard_map":
        return _eval_shard_map(eqn, invals, compute_dtype, ctx)
    _check_rewritable(eqn, compute_dtype, ctx)
    tracks_weak = ctx.lower or fp8.is_fp8(compute_dtype)  # fp8 tells weights by weakness
    body_weak = _body_weak(eqn, list(weak)) if tracks_weak and weak is not None else {}
    inner = _within(ctx, eqn)  # the sub-programs' name stacks continue this equation's
    params = {
        k: _rewrite_param(v, compute_dtype, inner, body_weak.get(k)) for k, v in eqn.params.items()
    }
    return _bind(eqn, invals, params)


def _saturate(x, dtype):
    """`x` as `dtype` with finite values clipped to its range: a weak fill such as Flax's
    `finfo(float32).min` mask value must stay finite (-inf would make a fully masked softmax row
    NaN); infinities and NaN pass unchanged."""
    info = jnp.finfo(dtype)
    if isinstance(x, (np.ndarray, np.generic)):  # a literal: clipped now, not in the program
        x = np.asarray(x)
        return np.where(np.isfinite(x), np.clip(x, info.min, info.max), x).astype(dtype)
    clipped = jnp.clip(x, float(info.min), float(info.max))
    return jnp.where(jnp.isfinite(x), clipped, x).astype(dtype)


def _eval_polymorphic(eqn, invals, weak):
    """A shape or elementwise operation, in the dtype `jamp.activations.run_dtype` picks."""
    traced = [v.aval.dtype for v in eqn.invars]
    target = act.run_dtype(traced, [_dtype(x) for x in invals], weak)
    cast = []
    for x, t, w in zip(invals, traced, weak):
        if target is None or not act.is_lowerable(t):
            cast.append(_cast(x, t))
        elif w and _dtype(x) != target:
            cast.append(_saturate(x, target))
        else:
            cast.append(_cast(x, target))
    return _bind(eqn, cast, eqn.params)


def _eval_custom_jvp(eqn, invals, weak, compute_dtype, ctx: _Ctx):
    """A custom-JVP function (e.g. `jax.nn.relu`) on 16-bit operands, keeping its derivative rule.

    The primal runs in the activation dtypes; the rule, as traced, runs on operands cast back.
    """
    call = jax_compat.param(eqn, "call_jaxpr")
    traced = [v.aval.dtype for v in eqn.invars]
    ctx = _stateless(ctx)

    def body(*xs):
        return _eval(call.jaxpr, call.consts, xs, compute_dtype, ctx, weak)[0]

    specs = [jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in invals]
    out_dtypes = [o.dtype for o in jax.eval_shape(body, *specs)]

    def down(values):
        return [_cast(x, d) for x, d in zip(values, out_dtypes)]

    def rule(primals, tangents):
        up = _as_traced(eqn, primals)
        up_t = [_cast(t, d) if _is_float_dtype(t.dtype) else t for t, d in zip(tangents, traced)]
        outs, out_t = jax.jvp(lambda *a: _bind(eqn, a, eqn.params), up, up_t)
        return down(outs), down(out_t)

    fn = jax.custom_jvp(body)
    fn.defjvp(rule)
    return fn(*invals)


def _eval_remat(eqn, invals, weak, compute_dtype, ctx: _Ctx):
    """A `remat` re-applied to its rewritten body: a closure, so fp8 sites inside it can read
    the scaling state (a re-traced sub-program could not carry it)."""
    jaxpr = jax_compat.param(eqn, "jaxpr")

    def body(*xs):
        return _eval(jaxpr, (), xs, compute_dtype, _within(ctx, eqn), weak)[0]

    prevent_cse, policy = (jax_compat.param(eqn, k) for k in ("prevent_cse", "policy"))
    return list(jax.checkpoint(body, prevent_cse=prevent_cse, policy=policy)(*invals))


def _eval_lowered(eqn, invals, weak, compute_dtype, ctx: _Ctx, placed=None):
    """One equation where activations may be 16-bit; returns (outputs, whether each is weak)."""
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    lowered = any(_dtype(x) != v.aval.dtype for x, v in zip(invals, eqn.invars))
    all_weak = all(weak)  # e.g. a gather of a weak table by data indices is data: strong
    squares = name == "mul" and eqn.invars[0] is eqn.invars[1]  # x * x, as in jnp.linalg.norm
    made_of_weights = [all_weak and fp8.is_fp8(compute_dtype)] * n_out  # see _eval_eqn
    if act.runs_in_fp32("square" if squares else name, compute_dtype):
        return _eval_as_traced(eqn, invals, compute_dtype, ctx), made_of_weights
    if lowered and name in ("jit", "pjit"):  # inlined, so that its 16-bit results stay 16-bit
        closed = jax_compat.param(eqn, "jaxpr")
        return _eval(closed.jaxpr, closed.consts, invals, compute_dtype, _within(ctx, eqn), weak)
    if name in act.POLYMORPHIC_PRIMITIVES:
        return _eval_polymorphic(eqn, invals, weak), [all_weak] * n_out
    if name == "convert_element_type":
        (x,), (v,) = invals, eqn.invars
        if _dtype(x) != v.aval.dtype and jax_compat.param(eqn, "new_dtype") == v.aval.dtype:
            return [x], list(weak)  # a no-op conversion of a lowered value (e.g. weak-type only)
        return _bind(eqn, [x], eqn.params), list(weak)
    if lowered and name == "custom_jvp_call":
        return _eval_custom_jvp(eqn, invals, weak, compute_dtype, ctx), [False] * n_out
    if name == "remat2":  # re-applied, so that its 16-bit results stay 16-bit
        return _eval_remat(eqn, invals, weak, compute_dtype, ctx), [False] * n_out
    # Anything else (sub-programs, matmuls, unknown operations): as traced.
    return _eval_as_traced(eqn, invals, compute_dtype, ctx, weak, placed), made_of_weights


def _within(ctx: _Ctx, eqn) -> _Ctx:
    """The context of a sub-program evaluated in place: its name stack continues the equation's."""
    stack = "/".join(s for s in (ctx.prefix, str(eqn.source_info.name_stack)) if s)
    return dataclasses.replace(ctx, prefix=stack)


def _eval_eqn(eqn, invals, weak, compute_dtype, ctx: _Ctx, placed=None):
    if ctx.lower and compute_dtype is not None and compute_dtype.itemsize < 4:
        return _eval_lowered(eqn, invals, weak, compute_dtype, ctx, placed)
    if fp8.is_fp8(compute_dtype):
        # Evaluated in place (a closure), so that fp8 sites inside can read the scaling state.
        if eqn.primitive.name == "remat2":
            outs = _eval_remat(eqn, invals, weak, compute_dtype, ctx)
            return outs, [False] * len(outs)
        if eqn.primitive.name in ("jit", "pjit"):
            closed = jax_compat.param(eqn, "jaxpr")
            return _eval(
                closed.jaxpr, closed.consts, invals, compute_dtype, _within(ctx, eqn), weak
            )
    outs = _eval_as_traced(eqn, invals, compute_dtype, ctx, weak, placed)
    # fp8 tells a layer's matmul by its weight: a value made of the variables alone (a cast
    # kernel, W + A @ B, a weight-normalized kernel) is one.
    poly = eqn.primitive.name in act.POLYMORPHIC_PRIMITIVES or fp8.is_fp8(compute_dtype)
    return outs, [poly and all(weak)] * len(outs)


def _eval(
    jaxpr,
    consts,
    args,
    compute_dtype,
    ctx: _Ctx,
    weak: Optional[Sequence[bool]],
    placed: Optional[Sequence[Optional[mixed_ops.Placed]]] = None,
):
    """Evaluates `jaxpr`; returns its outputs (possibly lowered) and whether each is weak.

    `placed` gives, per argument, its placement on a mesh (a sharded parameter) or None."""
    env: dict[Any, Any] = {}
    weak_env: dict[Any, bool] = {}
    place_env: dict[Any, mixed_ops.Placed] = {
        v: p for v, p in zip(jaxpr.invars, placed or ()) if p is not None
    }

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    def is_weak(v):
        return True if isinstance(v, jcore.Literal) else weak_env[v]

    env.update(zip(jaxpr.constvars, consts))
    weak_env.update((v, True) for v in jaxpr.constvars)
    env.update(zip(jaxpr.invars, args))
    weak_env.update(zip(jaxpr.invars, weak if weak is not None else [False] * len(args)))
    for eqn in jaxpr.eqns:
        # Under fp8 the output head inherits the carrier dtype; an override still decides it.
        inherited = fp8.carrier(compute_dtype) if eqn is ctx.head else compute_dtype
        eqn_dtype = _choose(ctx, eqn, inherited)
        # Keep the module path of each operation, for profiles and for anyone reading the program.
        where = None
        if place_env:
            where = [place_env.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
            followed = _follow_placement(eqn, where)
            if followed is not None:
                place_env[eqn.outvars[0]] = followed
        with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
            outs, outs_weak = _eval_eqn(
                eqn,
                [read(v) for v in eqn.invars],
                [is_weak(v) for v in eqn.invars],
                eqn_dtype,
                ctx,
                where,
            )
        for var, val, w in zip(eqn.outvars, outs, outs_weak):
            if not isinstance(var, jcore.DropVar):
                env[var] = val
                weak_env[var] = w
    return [read(v) for v in jaxpr.outvars], [is_weak(v) for v in jaxpr.outvars]


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
      head_in_fp8: under fp8 matmuls (`jamp.fp8.MATMUL_MARKER`), whether the program's last
        matmul (a model's output head) is fp8 too; by default it inherits bfloat16.

    Returns:
      The list of output values, in the dtypes the program was traced with.
    """
    head = None if head_in_fp8 else _last_dot(jaxpr)
    form = act.resolve(activations)
    act.note(form, compute_dtype)
    ctx = _Ctx(compute_for, form == "compute", head)
    outs, _ = _eval(jaxpr, consts, args, compute_dtype, ctx, weak, placed)
    # A literal output (e.g. a constant returned by an inlined jit) comes back as an array.
    return [
        jnp.asarray(o, v.aval.dtype) if isinstance(v, jcore.Literal) else _cast(o, v.aval.dtype)
        for o, v in zip(outs, jaxpr.outvars)
    ]


def _inherit(eqn, inherited):
    del eqn
    return inherited


def _is_traceable(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def rewrite(
    fn: Callable,
    compute_dtype,
    compute_for: ComputeFor = _inherit,
    *,
    activations: str = "auto",
    weak_argnums: Sequence[int] = (),
    reduce_dtype=np.float32,
    head_in_fp8: bool = False,
) -> Callable:
    """Return `fn` with its matmuls and convolutions run in `compute_dtype`.

    Array arguments (and array leaves of pytree arguments) are traced; every other leaf (Python
    numbers, strings, flags) is passed through unchanged, as a static value.

    Args:
      fn: any JAX-traceable function returning a pytree of arrays.
      compute_dtype: dtype of matmul and convolution operands (None leaves them as traced);
        `jamp.fp8.MATMUL_MARKER` (`float8_e4m3fn`) runs layer matmuls in fp8
        (`jamp.fp8.dot_general`: E4M3 forward, E5M2 gradients) and everything else,
        convolutions included, in bfloat16. A layer matmul is one with exactly one operand made
        of the `weak_argnums` arguments alone (the weights): without `weak_argnums` no matmul is
        fp8.
      compute_for: optional per-equation choice of compute dtype (see the module docstring).
      activations: where float32 values between operations live: "float32" (as traced),
        "compute" (in a 16-bit compute dtype where `jamp.activations` allows) or "auto" (float32
        on CPUs, compute elsewhere).
      weak_argnums: positional arguments whose leaves are weak in the sense of
        `jamp.activations` (a model's variables): combined with a 16-bit activation they take its
        dtype instead of promoting it to float32.
      reduce_dtype: the dtype that the gradient of a sharded parameter (see `placing`) leaves its
        16-bit matmul in, and so is summed across devices in.
      head_in_fp8: with `compute_dtype` `jamp.fp8.MATMUL_MARKER` (fp8 matmuls, bfloat16 between
        them), whether the function's last matmul (a model's output head) is fp8 as well; by
        default it runs in bfloat16.

    Returns:
      A function with `fn`'s signature and output dtypes.
    """
    compute_dtype = None if compute_dtype is None else np.dtype(compute_dtype)
    reduce_dtype = np.dtype(reduce_dtype)
    act.resolve(activations)  # a bad value fails here, not at the first call

    def wrapped(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        traced = [_is_traceable(leaf) for leaf in leaves]
        weak_leaves = [False] * len(leaves)
        placed_leaves: list[Optional[mixed_ops.Placed]] = [None] * len(leaves)
        placement_for = _PLACEMENT.get()
        offset = 0
        for i, arg in enumerate(args):
            flat = jax.tree_util.tree_flatten_with_path(arg)[0]
            if i in weak_argnums:
                weak_leaves[offset : offset + len(flat)] = [True] * len(flat)
                if placement_for is not None:
                    for j, (path, leaf) in enumerate(flat, offset):
                        where = placement_for(tuple(path), tuple(np.shape(leaf)))
                        if where is not None:
                            lives, read = where
                            placed_leaves[j] = mixed_ops.Placed(lives, reduce_dtype, read)
            offset += len(flat)

        def flat_fn(*arrays):
            it = iter(arrays)
            full = [next(it) if t else leaf for leaf, t in zip(leaves, traced)]
            a, kw = jax.tree.unflatten(treedef, full)
            return fn(*a, **kw)

        arrays = [leaf for leaf, t in zip(leaves, traced) if t]
        weak = [w for w, t in zip(weak_leaves, traced) if t]
        placed = [p for p, t in zip(placed_leaves, traced) if t]
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
        form = act.resolve(activations)
        act.note(form, compute_dtype)
        ctx = _Ctx(compute_for, form == "compute")
        if not _changes(closed.jaxpr, compute_dtype, ctx):
            # Nothing to rewrite (e.g. the float32 policy on a float32 model): run it as written,
            # which is bit-identical also where re-evaluating the program eagerly would not be.
            return fn(*args, **kwargs)
        outs = eval_jaxpr(
            closed.jaxpr,
            closed.consts,
            arrays,
            compute_dtype,
            compute_for,
            activations=activations,
            weak=weak,
            placed=placed,
            head_in_fp8=head_in_fp8,
        )
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


#: A name scope named like a normalization layer ("eqx.nn.LayerNorm", "rms_norm",
#: "vmap(BatchNorm)": letters only, any case) runs in float32 unless an override matches first.
NORM_SCOPE_SUFFIXES = ("batchnorm", "layernorm", "groupnorm", "rmsnorm", "instancenorm")
_NORM_SCOPES = object()  # the override key of that rule


def _scope_matches(key, parts) -> bool:
    if key is _NORM_SCOPES:
        letters = "".join(c for c in parts[-1].lower() if c.isalpha())
        return letters.endswith(NORM_SCOPE_SUFFIXES)
    return fnmatch.fnmatchcase("/".join(parts), key)


def _scope_rules(pairs) -> ComputeFor:
    """`compute_for` from (name-scope pattern, policy) pairs: an equation runs under the first
    pair that matches its innermost scope path, or an enclosing one (the longest path is tried
    first); otherwise it inherits its enclosing equation's choice."""
    chosen: dict[str, Any] = {}

    def choose(eqn, inherited, prefix=""):
        stack = "/".join(s for s in (prefix, str(eqn.source_info.name_stack)) if s)
        if stack not in chosen:
            parts = stack.split("/") if stack else []
            chosen[stack] = next(
                (
                    precision.autocast_dtype(policy)
                    for n in range(len(parts), 0, -1)
                    for key, policy in pairs
                    if _scope_matches(key, parts[:n])
                ),
                _INHERIT,
            )
        dtype = chosen[stack]
        return inherited if dtype is _INHERIT else dtype

    choose.reads_scope_prefix = True
    return choose


_INHERIT = object()


def _array_leaves(tree) -> bool:
    leaves = jax.tree.leaves(tree)
    return not (len(leaves) == 1 and leaves[0] is tree) and any(map(_is_traceable, leaves))


def autocast(
    fn: Callable,
    policy,
    *,
    overrides=None,
    activations: str = "auto",
    params_argnums: Sequence[int] = (),
) -> Callable:
    """Return `fn`, any JAX function, running under a precision policy.

    Every matmul and convolution in the traced program, forward and backward, takes its operands
    in the policy's compute dtype and accumulates in float32; gradients reach float32 inputs in
    float32; sums, exponentials, normalization statistics and the other fragile operations stay
    float32 (`jamp.activations`); the function's float outputs are cast to the policy's output
    dtype. This reaches what no `dtype=` argument controls: matmuls inside `jit`, `scan`, `cond`,
    `while_loop`, `remat` and `shard_map`, and layers that hard-code their dtype. Under the
    float32 policy a float32 function runs exactly as written.

    Args:
      fn: a function of arrays and pytrees of arrays (other leaves are passed through as static
        values); or a callable pytree with array leaves, such as an Equinox module, whose leaves
        are then the parameters (as if passed at a `params_argnums` position).
      policy: a `jmp.Policy` or any spec `jamp.get_policy` accepts, e.g. "mixed_bfloat16".
      overrides: maps name-scope path patterns to policies: an operation whose `jax.named_scope`
        path (e.g. "decoder/head/dense"), or an enclosing part of it ("decoder/head"), matches a
        pattern (fnmatch, e.g. "*/head") runs under that pattern's policy; the first pattern in
        the mapping wins, the innermost scope before the outer ones. Where `fn` sets no name
        scopes there is nothing to match. After these, a scope named like a normalization layer
        (`NORM_SCOPE_SUFFIXES`: Equinox's "eqx.nn.LayerNorm", "rms_norm", ...) runs in float32.
      activations: where the float32 values between matmuls live under a 16-bit compute dtype:
        "float32" (as traced), "compute" (16-bit where `jamp.activations` allows) or "auto"
        (float32 on CPUs, compute elsewhere).
      params_argnums: the positional arguments that hold parameters: fp8 policies take a matmul
        with exactly one operand made of them alone as a layer's (fp8; without parameters no
        matmul is fp8), and with 16-bit activations they take the dtype of the activations they
        meet instead of promoting them.

    Returns:
      A function with `fn`'s signature.

    Example::

      loss = jamp.autocast(lambda w, x: jnp.tanh(x @ w).sum(), "mixed_bfloat16")(w, x)
    """
    policy = precision.get_policy(policy)
    pairs = []
    for pattern, p in (overrides or {}).items():
        if not isinstance(pattern, str):
            raise TypeError(
                f"jamp.autocast override key {pattern!r}: expected a name-scope path pattern "
                '(a string such as "*/head"); module classes are keys of jamp.wrap.'
            )
        pairs.append((pattern, precision.get_policy(p)))
    pairs.append((_NORM_SCOPES, precision.get_policy("float32")))
    argnums = tuple(params_argnums)
    if any(not isinstance(i, int) or i < 0 for i in argnums):
        raise ValueError(f"params_argnums must be non-negative ints, got {params_argnums!r}.")
    if not callable(fn):
        raise TypeError(f"jamp.autocast expects a callable, got {type(fn).__name__}.")
    act.resolve(activations)  # a bad value fails here, with the accepted ones
    engine = functools.partial(rewrite, compute_for=_scope_rules(pairs))
    options = dict(activations=activations, reduce_dtype=precision.reduce_dtype(policy))
    compute = precision.autocast_dtype(policy)

    def run(*args, **kwargs):
        if _array_leaves(fn):  # a callable pytree (an Equinox module): its leaves are parameters
            call = engine(
                lambda module, *a, **kw: module(*a, **kw),
                compute,
                weak_argnums=(0,) + tuple(i + 1 for i in argnums),
                **options,
            )
            out = call(fn, *args, **kwargs)
        else:
            out = engine(fn, compute, weak_argnums=argnums, **options)(*args, **kwargs)
        return policy.cast_to_output(out)

    return functools.update_wrapper(run, fn, updated=())  # not an Equinox module's fields
