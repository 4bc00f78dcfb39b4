"""The engine's interpreter: evaluates a traced program again, equation by equation, under a
compute dtype (see `jamp.engine`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jamp import activations as act
from jamp import copies, fp8, grouped, jax_compat, mixed_ops, overrides, scopes
from jamp.engine import _attention, _broadcast, _guard, _recompute, _repeats
from jamp.engine import _values as V

ComputeFor = Callable[[jcore.JaxprEqn, Optional[np.dtype]], Optional[np.dtype]]


def _choose(ctx: "_Ctx", eqn, inherited):
    """The compute dtype of `eqn`; a choice that reads scope paths (`jamp.autocast`'s overrides)
    also gets the name stack of the programs around this one, which the equation's own lacks."""
    compute_for: Callable[..., Optional[np.dtype]] = ctx.compute_for  # maybe with a third argument
    if getattr(compute_for, "reads_scope_prefix", False):
        return compute_for(eqn, inherited, ctx.prefix)
    return compute_for(eqn, inherited)


def _changes(jaxpr: jcore.Jaxpr, compute_dtype, ctx: "_Ctx") -> bool:
    """Whether evaluating `jaxpr` under `compute_dtype` would run anything differently than traced."""
    for eqn in jaxpr.eqns:
        dtype = _choose(ctx, eqn, compute_dtype)
        if dtype is not None and ctx.lower and dtype.itemsize < 4:
            return True  # activations may be carried in 16 bits from here on
        if eqn.primitive.name in V.MATMULS and V.needs_rewrite([v.aval for v in eqn.invars], dtype):
            return True
        if any(_changes(sub, dtype, _within(ctx, eqn)) for sub in V.sub_jaxprs(eqn)):
            return True
    return False


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
    # run recognised attention as one call (`jamp.attention`): everywhere, nowhere, or where a
    # module path says so (`_rewrite.attention_fusion`)
    fuse_attention: Union[bool, Callable[[str], bool]] = True
    recompute: bool = True  # activation functions recomputed in the backward (`_recompute`)
    sites: dict = dataclasses.field(default_factory=dict, compare=False)
    # the linen module calls recorded while the program was traced: the fp8 sites' params paths
    calls: Optional[scopes.LinenCalls] = dataclasses.field(default=None, compare=False)
    # id -> (value, perm): `value` is `transpose(kept, perm)` of a 16-bit array `kept` that the
    # backward pass keeps anyway (a fused attention's output): an fp8 matmul reading `kept`
    # itself (or a reshape of it) keeps it, not an fp8 copy of it (`jamp.fp8.dot_general`)
    saved: dict = dataclasses.field(default_factory=dict, compare=False)
    # id -> (value, source, axis, group): `value` is `jnp.repeat(source, group, axis)` (keys or
    # values repeated for grouped-query attention, which a fused attention takes ungrouped)
    repeats: dict = dataclasses.field(default_factory=dict, compare=False)

    def repeated(self, x) -> Optional[tuple]:
        held = self.repeats.get(id(x))
        return held[1:] if held is not None and held[0] is x else None

    def saved_perm(self, x) -> Optional[tuple]:
        held = self.saved.get(id(x))
        return held[1] if held is not None and held[0] is x else None

    def is_saved(self, x) -> bool:
        perm = self.saved_perm(x)
        return perm is not None and perm == tuple(range(len(perm)))

    def save(self, x, perm=None) -> None:
        self.saved[id(x)] = (x, tuple(range(np.ndim(x))) if perm is None else tuple(perm))

    def follow(self, eqn, x, out) -> None:
        """Saved values through layout operations: reshapes of the array itself, transposes."""
        perm = self.saved_perm(x)
        if perm is None:
            return
        if eqn.primitive.name == "transpose":
            self.save(out, [perm[a] for a in jax_compat.param(eqn, "permutation")])
        elif eqn.primitive.name in ("reshape", "squeeze", "expand_dims") and self.is_saved(x):
            self.save(out)  # the same values in another shape: a bitcast in XLA


def _stateless(ctx: _Ctx) -> _Ctx:
    return dataclasses.replace(ctx, stateful=False) if ctx.stateful else ctx


def _rewrite_closed(
    closed: jcore.ClosedJaxpr, compute_dtype, ctx: _Ctx, weak=None
) -> jcore.ClosedJaxpr:
    """The sub-program with its matmuls rewritten and its signature (dtypes included) unchanged."""

    ctx = _stateless(ctx)

    def run(*args):
        outs, _ = _eval(closed.jaxpr, closed.consts, args, compute_dtype, ctx, weak)
        return [V.cast(o, v.aval.dtype) for o, v in zip(outs, closed.jaxpr.outvars)]

    return jax.make_jaxpr(run)(*[V.spec(v.aval) for v in closed.jaxpr.invars])


def _rewrite_param(value, compute_dtype, ctx: _Ctx, weak=None):
    """Rewrite one equation parameter if it is (a tuple of) sub-programs containing matmuls.

    `weak` gives, per input of the sub-program, whether it is weak (None: none is).
    """
    if isinstance(value, jcore.ClosedJaxpr):
        if not V.has_matmul(value.jaxpr):
            return value
        return _rewrite_closed(value, compute_dtype, ctx, weak)
    if isinstance(value, jcore.Jaxpr):
        if not V.has_matmul(value):
            return value
        closed = _rewrite_closed(jcore.ClosedJaxpr(value, ()), compute_dtype, ctx, weak)
        # An open sub-program (e.g. remat's) has no slot for constants; keep the original if the
        # rewrite needed any, rather than changing the equation's signature.
        return value if closed.consts else closed.jaxpr
    if isinstance(value, tuple) and value and all(isinstance(v, jcore.ClosedJaxpr) for v in value):
        return tuple(_rewrite_param(v, compute_dtype, ctx, weak) for v in value)
    return value


def _eval_shard_map(eqn, invals, compute_dtype, ctx: _Ctx):
    """A `shard_map` with its body rewritten: the body's collectives need the mapping's axes, so it
    is mapped again rather than re-traced on its own."""
    jaxpr = jax_compat.param(eqn, "jaxpr")
    if not V.has_matmul(jaxpr):
        return V.bind(eqn, invals, eqn.params)
    ctx = _stateless(_within(ctx, eqn))

    def body(*xs):
        outs, _ = _eval(jaxpr, (), xs, compute_dtype, ctx, None)
        return tuple(V.cast(o, v.aval.dtype) for o, v in zip(outs, jaxpr.outvars))

    return list(jax_compat.shard_map_like(eqn, body)(*invals))


def _check_rewritable(eqn, compute_dtype, ctx: _Ctx) -> None:
    """An unknown higher-order primitive with matmuls to rewrite inside fails here, at trace time:
    rewriting its sub-programs without knowing how it uses them could silently mis-lower it."""
    name = eqn.primitive.name
    if name in V.REWRITTEN_INSIDE or jax_compat.is_kernel(eqn):
        return
    for sub in jcore.jaxprs_in_params(eqn.params):
        if V.has_matmul(sub) and _changes(sub, compute_dtype, ctx):
            raise jax_compat.unsupported(
                name, "it is a higher-order primitive with matmuls inside that jamp does not know"
            )


def _matmul_out_dtype(eqn, compute_dtype, ctx: _Ctx):
    traced = eqn.outvars[0].aval.dtype
    lowered = ctx.lower and compute_dtype.itemsize < 4 and act.is_lowerable(traced)
    return fp8.carrier(compute_dtype) if lowered else traced


_WARNED: set[str] = set()  # the uncovered contractions warned of, once each per process


def _warn_uncovered(eqn, invals, compute_dtype) -> None:
    """A float32 contraction the engine leaves as traced, under a 16-bit policy: said once."""
    name = eqn.primitive.name
    if name not in V.UNCOVERED_CONTRACTIONS or name in _WARNED:
        return
    if compute_dtype is None or compute_dtype.itemsize >= 4:
        return
    if any(V.is_float_dtype(V.dtype_of(x)) and V.dtype_of(x).itemsize >= 4 for x in invals):
        _WARNED.add(name)
        _guard.uncovered(name)


def _fp8_dot(eqn, invals, compute_dtype, ctx: _Ctx, placed):
    site = None
    if ctx.stateful:
        stack = "/".join(s for s in (ctx.prefix, str(eqn.source_info.name_stack)) if s)
        site = fp8.site_name(stack, fp8.site_counts(ctx.sites), ctx.calls)
    out_dtype = _matmul_out_dtype(eqn, compute_dtype, ctx)
    dims = jax_compat.param(eqn, "dimension_numbers")
    lhs, rhs = invals
    return [
        fp8.dot_general(
            lhs,
            rhs,
            dims,
            out_dtype,
            site,
            V.placed_for(placed, compute_dtype),
            keep_lhs=ctx.is_saved(lhs),
        )
    ]


def _eval_as_traced(eqn, invals, compute_dtype, ctx: _Ctx, weak=None, placed=None):
    """The equation with its matmuls rewritten and everything else as traced."""
    # The mixed matmuls cast their operands themselves: a 16-bit activation goes in as it is, and
    # its gradient comes back 16-bit.
    if eqn.primitive.name not in V.MATMULS or not V.needs_rewrite(invals, compute_dtype):
        invals = V.as_traced(eqn, invals)
    if (
        eqn.primitive is V.DOT
        and fp8.is_fp8(compute_dtype)
        and V.needs_rewrite(invals, compute_dtype)
    ):
        # A layer's matmul (activation x weight: one operand made of the weak arguments, the
        # variables, alone) is fp8; one of two activations (attention's scores and mix) stays
        # bfloat16, as in Transformer Engine, and so does a weight x weight product (LoRA's A @ B).
        if weak is not None and sum(map(bool, weak)) == 1:
            return _fp8_dot(eqn, invals, compute_dtype, ctx, placed)
        compute_dtype = fp8.CARRIER
    if eqn.primitive is V.DOT and V.needs_rewrite(invals, compute_dtype):
        out_dtype = _matmul_out_dtype(eqn, compute_dtype, ctx)
        dims = jax_compat.param(eqn, "dimension_numbers")
        where = V.placed_for(placed, compute_dtype)
        lhs, rhs = invals
        return [mixed_ops.mixed_dot_general(lhs, rhs, dims, compute_dtype, out_dtype, where)]
    if eqn.primitive is V.CONV and V.needs_rewrite(invals, compute_dtype):
        out_dtype = _matmul_out_dtype(eqn, compute_dtype, ctx)
        where = V.placed_for(placed, compute_dtype)
        conv_dtype = fp8.carrier(compute_dtype)  # fp8 is for matmuls only
        lhs, rhs = invals
        return [mixed_ops.mixed_conv(lhs, rhs, eqn.params, conv_dtype, out_dtype, where)]
    if eqn.primitive.name == V.RAGGED and V.needs_rewrite(invals, compute_dtype):
        if grouped.covers(eqn):  # grouped GEMMs run in bfloat16 under fp8 (`jamp.grouped`)
            out_dtype = _matmul_out_dtype(eqn, compute_dtype, ctx)
            dims = jax_compat.param(eqn, "ragged_dot_dimension_numbers")
            lhs, rhs, sizes = invals
            gemm_dtype = fp8.carrier(compute_dtype)
            return [grouped.mixed_ragged_dot(lhs, rhs, sizes, dims, gemm_dtype, out_dtype)]
        invals = V.as_traced(eqn, invals)
    _warn_uncovered(eqn, invals, compute_dtype)
    if jax_compat.is_kernel(eqn):  # a kernel runs as written, on its traced operand dtypes
        return V.bind(eqn, invals, eqn.params)
    if eqn.primitive.name == "shard_map":
        return _eval_shard_map(eqn, invals, compute_dtype, ctx)
    _check_rewritable(eqn, compute_dtype, ctx)
    tracks_weak = ctx.lower or fp8.is_fp8(compute_dtype)  # fp8 tells weights by weakness
    body_weak = V.body_weak(eqn, list(weak)) if tracks_weak and weak is not None else {}
    inner = _within(ctx, eqn)  # the sub-programs' name stacks continue this equation's
    params = {
        k: _rewrite_param(v, compute_dtype, inner, body_weak.get(k)) for k, v in eqn.params.items()
    }
    return V.bind(eqn, invals, params)


def _eval_polymorphic(eqn, invals, weak):
    """A shape or elementwise operation, in the dtype `jamp.activations.run_dtype` picks."""
    traced = [v.aval.dtype for v in eqn.invars]
    target = act.run_dtype(traced, [V.dtype_of(x) for x in invals], weak)
    cast = []
    for x, t, w in zip(invals, traced, weak):
        if target is None or not act.is_lowerable(t):
            cast.append(V.cast(x, t))
        elif w and V.dtype_of(x) != target:
            cast.append(V.saturate(x, target))
        else:
            cast.append(V.cast(x, target))
    name, shape = eqn.primitive.name, eqn.outvars[0].aval.shape
    if name == "broadcast_in_dim" and eqn.params.get("sharding") is None:
        dims = jax_compat.param(eqn, "broadcast_dimensions")
        return [_broadcast.summed_in_f32(cast[0], shape, dims)]
    return V.bind(eqn, _broadcast.operands(name, cast, shape), eqn.params)


def _eval_custom_jvp(eqn, invals, weak, compute_dtype, ctx: _Ctx):
    """A custom-JVP function (e.g. `jax.nn.relu`) on 16-bit operands, keeping its derivative rule.

    The primal runs in the activation dtypes; the rule, as traced, runs on operands cast back.
    """
    call = jax_compat.param(eqn, "call_jaxpr")
    traced = [v.aval.dtype for v in eqn.invars]
    ctx = _stateless(ctx)

    def body(*xs):
        return _eval(call.jaxpr, call.consts, xs, compute_dtype, ctx, weak)[0]

    specs = [jax.ShapeDtypeStruct(np.shape(x), V.dtype_of(x)) for x in invals]
    out_dtypes = [o.dtype for o in jax.eval_shape(body, *specs)]

    def down(values):
        return [V.cast(x, d) for x, d in zip(values, out_dtypes)]

    def rule(primals, tangents):
        up = V.as_traced(eqn, primals)
        up_t = [V.cast(t, d) if V.is_float_dtype(t.dtype) else t for t, d in zip(tangents, traced)]
        outs, out_t = jax.jvp(lambda *a: V.bind(eqn, a, eqn.params), up, up_t)
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


def _reads_variables(eqn, weak) -> bool:
    """Whether an equation takes a weak float array that is a value, not a literal (a variable
    or what is made of variables alone)."""
    return any(
        w and isinstance(v, jcore.Var) and v.aval.ndim and V.is_float_dtype(v.aval.dtype)  # type: ignore[attr-defined]  # a ShapedArray
        for w, v in zip(weak, eqn.invars)
    )


def _eval_lowered(eqn, invals, weak, compute_dtype, ctx: _Ctx, placed=None):
    """One equation where activations may be 16-bit; returns (outputs, whether each is weak)."""
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    lowered = any(V.dtype_of(x) != v.aval.dtype for x, v in zip(invals, eqn.invars))
    all_weak = all(weak)  # e.g. a gather of a weak table by data indices is data: strong
    squares = name == "mul" and eqn.invars[0] is eqn.invars[1]  # x * x, as in jnp.linalg.norm
    made_of_weights = [all_weak and fp8.is_fp8(compute_dtype)] * n_out  # see _eval_eqn
    if act.runs_in_fp32("square" if squares else name, compute_dtype):
        outs = _eval_as_traced(eqn, invals, compute_dtype, ctx)
        if act.is_range_guard("square" if squares else name, compute_dtype):
            # A float16 square or power, computed in float32 where it cannot overflow, is weak:
            # a float32 reduction of it stays float32 (a norm's variance), and where it meets a
            # float16 activation (gelu's x + 0.044715 x^3) it is saturated into float16, so that
            # the rest of the expression, and what its backward keeps, is float16 again.
            return outs, [True] * n_out
        return outs, made_of_weights
    # Inlined, so that its 16-bit results stay 16-bit: one with 16-bit operands, or one that
    # combines variables with data (`jnp.take` of an embedding table by token ids).
    if name in ("jit", "pjit") and (lowered or (_reads_variables(eqn, weak) and not all_weak)):
        closed = jax_compat.param(eqn, "jaxpr")
        return _eval(closed.jaxpr, closed.consts, invals, compute_dtype, _within(ctx, eqn), weak)
    if (
        name == "gather"
        and weak[0]
        and not all_weak
        and act.is_lowerable(eqn.outvars[0].aval.dtype)
    ):
        # An embedding: rows of a float32 table looked up by data. Its result is data, carried in
        # the compute dtype as a 16-bit model's embedding (Flax `dtype=`, Keras) returns it; the
        # lookup itself stays float32, so its gradient is summed into the table in float32.
        outs = _eval_as_traced(eqn, invals, compute_dtype, ctx)
        return [V.cast(o, fp8.carrier(compute_dtype)) for o in outs], [False] * n_out
    if name in act.POLYMORPHIC_PRIMITIVES:
        return _eval_polymorphic(eqn, invals, weak), [all_weak] * n_out
    if name == "convert_element_type":
        (x,), (v,) = invals, eqn.invars
        new_dtype = jax_compat.param(eqn, "new_dtype")
        if V.dtype_of(x) != v.aval.dtype and new_dtype == v.aval.dtype:
            return [x], list(weak)  # a no-op conversion of a lowered value (e.g. weak-type only)
        if (
            str(eqn.source_info.name_stack).endswith(overrides.OUTPUT_SCOPE)
            and act.is_lowerable(new_dtype)
            and np.dtype(V.dtype_of(x)).itemsize == 2
        ):
            # An override's 16-bit output widened to its policy's output dtype: carried as it
            # is, as the activation would be without the override (see overrides.OUTPUT_SCOPE).
            return [x], list(weak)
        return V.bind(eqn, [x], eqn.params), list(weak)
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


def _fuser(jaxpr, consts, ctx: _Ctx, dtype_for, evaluate) -> Optional[_attention.Fuser]:
    """The attention recogniser of this program, if attention may be fused in it."""
    if ctx.fuse_attention is False:
        return None

    def make() -> _attention.Fuser:
        return _attention.Fuser(
            jaxpr,
            consts,
            _attention.Engine(
                lambda eqn, invals: evaluate(eqn, invals)[0],
                lambda eqn: _attention_dtype(dtype_for(eqn)),
                lambda eqn, dtype: _matmul_out_dtype(eqn, dtype, ctx),
                ctx.save,
                ctx.repeated,
            ),
            lambda eqn: _module_path(ctx.prefix, eqn),
            ctx.fuse_attention if callable(ctx.fuse_attention) else None,
        )

    fuser = _guard.attempt("attention", lambda: ctx.prefix, make, None)
    return fuser if fuser is not None and fuser.first else None


def _module_path(prefix: str, eqn) -> str:
    """An equation's name-scope path without `jnp.einsum`'s own scope (its spec)."""
    parts = "/".join(s for s in (prefix, str(eqn.source_info.name_stack)) if s).split("/")
    return "/".join(p for p in parts if p and "->" not in p)


def _attention_dtype(dtype):
    """Attention's matmuls take two activations: under fp8 they run in the carrier dtype."""
    return None if dtype is None else fp8.carrier(dtype)


def _eval_attention(fuser, eqn, invals, weak) -> Optional[list]:
    """`eqn` as a step of an attention being recognised, or None to evaluate it as usual (also
    where the recogniser fails: the attention then runs as traced, with a warning)."""
    if any(isinstance(x, _attention.Sym) for x in invals):
        with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
            return _guard.attempt(
                "an attention", lambda: fuser.where(eqn), lambda: fuser.step(eqn, invals), None
            )
    if eqn.primitive is V.DOT:
        return _guard.attempt(
            "an attention", lambda: fuser.where(eqn), lambda: fuser.start(eqn, invals, weak), None
        )
    return None


# What a param's ready copy (`jamp.copies.ready_casts`) follows: a kernel transposed or
# reshaped before its matmul is still read from the copy.
_REARRANGE = ("transpose", "reshape")


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

    def dtype_for(eqn):
        # Under fp8 the output head inherits the carrier dtype; an override still decides it.
        inherited = fp8.carrier(compute_dtype) if eqn is ctx.head else compute_dtype
        return _choose(ctx, eqn, inherited)

    def evaluate(eqn, invals, where=None):
        # Keep the module path of each operation, for profiles and for anyone reading the program.
        with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
            weak_in = [is_weak(v) for v in eqn.invars]
            return _eval_eqn(eqn, invals, weak_in, dtype_for(eqn), ctx, where)

    fuser = _fuser(jaxpr, consts, ctx, dtype_for, evaluate)
    made_by: dict[Any, Any] = {}  # var -> its equation, for repeats (`_repeats.repeat_of`)

    def step(eqn) -> None:
        invals = [read(v) for v in eqn.invars]
        if fuser is not None:
            outs = _eval_attention(fuser, eqn, invals, [is_weak(v) for v in eqn.invars])
            if outs is not None:
                env.update(zip(eqn.outvars, outs))
                weak_env.update((v, False) for v in eqn.outvars)
                return
            invals = [_attention.real(x) for x in invals]
        where = None
        if place_env:
            where = [place_env.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
            followed = V.follow_placement(eqn, where)
            if followed is not None:
                place_env[eqn.outvars[0]] = followed
        outs, outs_weak = evaluate(eqn, invals, where)
        if eqn.primitive.name in _REARRANGE and copies.has_ready():
            copies.follow_ready(invals[0], outs[0], lambda c: V.bind(eqn, [c], eqn.params)[0])
        if ctx.saved and len(invals) == 1:
            ctx.follow(eqn, invals[0], outs[0])
        if fuser is not None:
            made_by.update((v, eqn) for v in eqn.outvars)
            repeat = _guard.attempt(
                "a repeat of keys and values",
                lambda: _module_path(ctx.prefix, eqn),
                lambda: _repeats.repeat_of(eqn, made_by),
                None,
            )
            if repeat is not None:
                source, axis, group = repeat
                ctx.repeats[id(outs[0])] = (outs[0], read(source), axis, group)
        for var, val, w in zip(eqn.outvars, outs, outs_weak):
            if not isinstance(var, jcore.DropVar):
                env[var] = val
                weak_env[var] = w

    def recomputed(region: _recompute.Region) -> bool:
        """Evaluates `region` under jax.checkpoint; False (nothing done) if it cannot be."""
        ins = [read(v) for v in region.inputs]
        if any(isinstance(x, _attention.Sym) for x in ins):
            return False
        weak_env.update((v, is_weak(v)) for v in region.inputs)

        def body(*xs):
            local = dict(zip(region.inputs, xs))
            for i in region.members:
                e = jaxpr.eqns[i]
                vals = [v.val if isinstance(v, jcore.Literal) else local[v] for v in e.invars]
                outs, outs_weak = evaluate(e, vals)
                local.update(zip(e.outvars, outs))
                weak_env.update(zip(e.outvars, outs_weak))
            return [local[o] for o in region.outputs]

        outs = _guard.attempt(
            "an activation function recomputed in the backward",
            lambda: _module_path(ctx.prefix, jaxpr.eqns[region.members[-1]]),
            lambda: jax.checkpoint(body, prevent_cse=True)(*ins),
            None,
        )
        if outs is None:
            return False  # (evaluated equation by equation instead)
        env.update(zip(region.outputs, outs))
        return True

    regions: dict = {}
    if ctx.recompute and not place_env:
        regions = _guard.attempt(
            "activation functions recomputed in the backward",
            lambda: ctx.prefix,
            lambda: _recompute.regions(jaxpr),
            {},
        )
    deferred = {i for r in regions.values() for i in r.members[:-1]}
    for index, eqn in enumerate(jaxpr.eqns):
        if index in deferred:
            continue  # evaluated with its region's last equation
        region = regions.get(index)
        if region is not None:
            if recomputed(region):
                continue
            for i in region.members:
                step(jaxpr.eqns[i])
            continue
        step(eqn)
    if fuser is not None:
        return [_attention.real(read(v)) for v in jaxpr.outvars], [
            is_weak(v) for v in jaxpr.outvars
        ]
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
    ctx = _Ctx(compute_for, form == "compute", head, fuse_attention=fuse_attention, calls=calls)
    outs, _ = _eval(jaxpr, consts, args, compute_dtype, ctx, weak, placed)
    # A literal output (e.g. a constant returned by an inlined jit) comes back as an array.
    return [
        jnp.asarray(o, v.aval.dtype) if isinstance(v, jcore.Literal) else V.cast(o, v.aval.dtype)  # type: ignore[attr-defined]  # a ShapedArray
        for o, v in zip(outs, jaxpr.outvars)
    ]
