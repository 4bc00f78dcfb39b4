"""Walk a traced program and count, per module path and pass, what runs in which dtype.

The precision report's engine (`jamp.inspect.report` turns its counts into rows, totals and
hazards). It reads the jaxpr a function really runs (after `jamp.wrap` / `jamp.autocast` rewrote
it), descending into every sub-program: `jit`, `scan` (its body counted `length` times), `cond`
(the most expensive branch), `while` (the body once: its trip count is not known when tracing),
`remat`, `shard_map`, custom-derivative functions.

Example::

  walker = Walker(Context(calls, compute=np.dtype(jnp.bfloat16), activations="float32"))
  walker.walk(jax.make_jaxpr(step)(*args).jaxpr)
  walker.stats[("Dense_0", "forward")].matmul_flops
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jamp import activations as act
from jamp import jax_compat
from jamp.inspect import _paths
from jamp.nnx import FP32_MODULES as NNX_FP32_MODULES
from jamp.wrap import FP32_MODULE_NAME_SUFFIXES, FP32_MODULES

MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot_general")
#: Operations that only move, re-shape or re-label values: no arithmetic to count.
STRUCTURAL = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "transpose",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "pad",
        "gather",
        "scatter",
        "rev",
        "split",
        "copy",
        "copy_p",
        "optimization_barrier",
        "sharding_constraint",
        "device_put",
        "stop_gradient",
        "iota",
    }
)
#: Collectives that sum (a 16-bit sum across devices rounds every partial sum) ...
REDUCING_COLLECTIVES = frozenset(
    {"psum", "psum2", "psum_invariant", "psum_scatter", "reduce_scatter", "pmean"}
)
#: ... and those that only move values (lossless in any dtype).
MOVING_COLLECTIVES = frozenset({"all_gather", "all_to_all", "ppermute", "pbroadcast"})
_SUMS = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})
_SHORT = {
    "bfloat16": "bf16",
    "float16": "f16",
    "float32": "f32",
    "float64": "f64",
    "float8_e4m3fn": "f8e4m3fn",
    "float8_e5m2": "f8e5m2",
}


def short(dtype) -> str:
    """HLO's short dtype name: bf16, f16, f32, f8e4m3fn, f8e5m2, ..."""
    name = np.dtype(dtype).name
    return _SHORT.get(name, name)


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)  # numpy alone does not count bf16 and fp8


def is_16bit(dtype) -> bool:
    """Floats narrower than 32 bits (bf16, f16, the fp8 formats)."""
    return is_float(dtype) and np.dtype(dtype).itemsize < 4


class MatmulKind(NamedTuple):
    """A matmul's form: "dot", "grouped" (a grouped GEMM) or "conv", its operands' dtypes and
    the dtype it accumulates in.

    `upcast`: the operands hold 16-bit values widened to float32 just before the product (how
    `jamp.mixed_ops` lowers a mixed matmul on CPUs without native 16-bit matmuls): 16-bit
    precision, float32 arithmetic; `lhs` / `rhs` name the 16-bit dtypes.
    """

    op: str
    lhs: str
    rhs: str
    accumulate: str
    upcast: bool = False

    def __str__(self):
        text = f"{self.op} {self.lhs}*{self.rhs}->{self.accumulate}"
        return f"{text} (as f32)" if self.upcast else text


@dataclasses.dataclass
class Stats:
    """Counts for one (module path, pass)."""

    matmul_flops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    elementwise: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    kept_fp32: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    kept_fp32_flops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    activation_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def merge(self, other: "Stats") -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).update(getattr(other, f.name))

    def cost(self) -> int:
        return sum(self.matmul_flops.values()) + sum(self.elementwise.values())


@dataclasses.dataclass
class Context:
    """What the walk needs to know beyond the program itself."""

    calls: _paths.ModuleCalls
    compute: Optional[np.dtype]  # the policy's compute dtype (None: float32)
    activations: str  # "float32" or "compute", resolved (see jamp.activations)
    overrides: tuple = ()  # the jamp.wrap overrides the policy tags index into
    wrapped: bool = False  # the program runs a jamp.wrap'ped model (its scopes say Wrapped.*)


def _size(aval) -> int:
    return int(math.prod(aval.shape))


def _nbytes(aval) -> int:
    return _size(aval) * np.dtype(aval.dtype).itemsize


def matmul_flops(eqn) -> int:
    """2 * multiply-adds of a `dot_general`, `ragged_dot_general` (each left row multiplies one
    group's matrix) or `conv_general_dilated` equation."""
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
        group: tuple = ()
        if eqn.primitive.name == "dot_general":
            (_, rc), (_, rb) = jax_compat.param(eqn, "dimension_numbers")
        else:
            dims = jax_compat.param(eqn, "ragged_dot_dimension_numbers")
            (_, rc), (_, rb) = dims.dot_dimension_numbers
            group = tuple(dims.rhs_group_dimensions)
        free = [d for d in range(rhs.ndim) if d not in set(rc) | set(rb) | set(group)]
        return 2 * _size(lhs) * int(math.prod(rhs.shape[d] for d in free))
    out = eqn.outvars[0].aval
    out_features = rhs.shape[jax_compat.param(eqn, "dimension_numbers").rhs_spec[0]]
    # Each output element is a dot product over the kernel's window and input features.
    return 2 * _size(out) * (_size(rhs) // out_features)


def widened_from(var, producers) -> Optional[np.dtype]:
    """The 16-bit dtype a float32 operand was widened from just before its matmul, if any."""
    eqn = producers.get(var)
    if eqn is None or eqn.primitive.name != "convert_element_type":
        return None
    source = eqn.invars[0].aval.dtype
    return np.dtype(source) if is_16bit(source) and not is_16bit(var.aval.dtype) else None


def _summed(var, consumers) -> bool:
    """Whether `var` is summed (perhaps after a cast, as `jnp.sum` upcasts 16-bit inputs): an
    exponential that is summed is a softmax's (or a logsumexp's)."""
    for eqn in consumers[var]:
        if eqn.primitive.name in _SUMS:
            return True
        if eqn.primitive.name == "convert_element_type" and _summed(eqn.outvars[0], consumers):
            return True
    return False


def _is_norm_class(cls: Optional[type]) -> bool:
    if cls is None:
        return False
    if issubclass(cls, FP32_MODULES + NNX_FP32_MODULES):
        return True
    ends = tuple(s.lower() for s in FP32_MODULE_NAME_SUFFIXES)
    return any(c.__name__.lower().endswith(ends) for c in cls.__mro__)


def override_rule(index: int, overrides) -> Optional[str]:
    """The rule a `jamp_policy_<index>_` tag stands for if it computes in float32, else None."""
    if index >= len(overrides):
        return f"override #{index}"
    key, policy = overrides[index]
    if is_16bit(policy.compute_dtype):
        return None
    if key in FP32_MODULES + NNX_FP32_MODULES or type(key).__name__ == "_NamedLike":
        return "normalization"
    return f"override {key.__name__ if isinstance(key, type) else key}"


def _is_jamp_mixed_op(jaxpr) -> bool:
    """Whether a custom-derivative body is one of jamp's own mixed matmuls (`jamp.mixed_ops`)."""
    return any(
        e.primitive.name in MATMULS and all(is_16bit(v.aval.dtype) for v in e.invars[:2])
        for e in jaxpr.eqns
    )


#: The path of work outside every module call of a Flax program (the loss, the optimizer).
OUTSIDE = "(outside modules)"


def _join(prefix: str, stack: str) -> str:
    return f"{prefix}/{stack}" if prefix and stack else prefix or stack


class HazardCount(NamedTuple):
    kind: str
    path: str
    phase: str
    detail: str


class Walker:
    """Accumulates `Stats` per (path, phase) and hazard amounts over a jaxpr."""

    def __init__(self, ctx: Context, differentiated: bool = True):
        self.ctx = ctx
        self.differentiated = differentiated  # the program holds a backward pass
        self.stats: dict[tuple[str, str], Stats] = collections.defaultdict(Stats)
        self.hazards: collections.Counter = collections.Counter()  # HazardCount -> amount
        self.collective_bytes: collections.Counter = collections.Counter()  # (prim, dtype)
        self.custom_paths: set[str] = set()
        self._where: dict[str, tuple[str, str, Optional[int]]] = {}

    def where(self, stack: str) -> tuple[str, str, Optional[int]]:
        """(module path, phase, policy tag) of a name stack, memoized: stacks repeat a lot."""
        if stack not in self._where:
            if _paths.is_backward(stack):
                phase = "backward"
            elif "jvp(" in stack or not self.differentiated:
                phase = "forward"
            else:
                phase = "other"  # outside differentiation: the optimizer, the loss scale
            calls: Optional[_paths.ModuleCalls]
            calls = self.ctx.calls
            if calls.roots or calls.nnx_roots:
                inside = _paths.in_module(stack, calls)
            else:  # nothing recorded (a trace JAX had cached): read the names as they are
                calls, inside = None, "Wrapped." in stack or not self.ctx.wrapped
            path = _paths.module_path(stack, calls) if inside else OUTSIDE
            self._where[stack] = (path, phase, _paths.policy_tag(stack))
        return self._where[stack]

    def walk(self, jaxpr, prefix: str = "", times: int = 1, in_custom: bool = False) -> None:
        consumers: collections.defaultdict[jcore.Var, list] = collections.defaultdict(list)
        producers: dict[jcore.Var, Any] = {}
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, jcore.Var):
                    consumers[v].append(eqn)
            producers.update((v, eqn) for v in eqn.outvars)
        for eqn in jaxpr.eqns:
            stack = _join(prefix, str(eqn.source_info.name_stack))
            name = eqn.primitive.name
            if name in MATMULS:
                self._matmul(eqn, stack, times, in_custom, producers)
            elif jax_compat.is_kernel(eqn):
                continue  # a kernel's body reads and writes buffers: not ours to count
            elif list(jcore.jaxprs_in_params(eqn.params)):
                self._higher_order(eqn, stack, times, in_custom)
            elif name in REDUCING_COLLECTIVES | MOVING_COLLECTIVES:
                self._collective(eqn, stack, times)
            else:
                self._elementwise(eqn, stack, times, consumers)

    def _higher_order(self, eqn, stack: str, times: int, in_custom: bool) -> None:
        name = eqn.primitive.name
        subs = list(jcore.jaxprs_in_params(eqn.params))
        if name == "scan":
            self.walk(subs[0], stack, times * int(jax_compat.param(eqn, "length")), in_custom)
        elif name == "cond":
            self._most_expensive(subs, stack, times, in_custom)
        elif name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
            custom = in_custom or not _is_jamp_mixed_op(subs[0])
            if custom:
                self.custom_paths.add(self.where(stack)[0])
            self.walk(subs[0], stack, times, custom)  # the primal; rules are not in the program
        else:
            for sub in subs:
                self.walk(sub, stack, times, in_custom)

    def _most_expensive(self, branches, stack: str, times: int, in_custom: bool) -> None:
        best = None
        for branch in branches:
            sub = Walker(self.ctx)
            sub._where, sub.custom_paths = self._where, self.custom_paths
            sub.walk(branch, stack, times, in_custom)
            cost = sum(s.cost() for s in sub.stats.values())
            if best is None or cost > best[0]:
                best = (cost, sub)
        if best is not None:
            for key, stats in best[1].stats.items():
                self.stats[key].merge(stats)
            self.hazards.update(best[1].hazards)
            self.collective_bytes.update(best[1].collective_bytes)

    def _matmul(self, eqn, stack: str, times: int, in_custom: bool, producers) -> None:
        path, phase, tag = self.where(stack)
        lhs, rhs = (v.aval.dtype for v in eqn.invars[:2])
        out = eqn.outvars[0].aval
        if not (is_float(lhs) and is_float(rhs)):
            return
        acc = eqn.params.get("preferred_element_type") or out.dtype
        op = {"dot_general": "dot", "ragged_dot_general": "grouped"}.get(eqn.primitive.name, "conv")
        flops = matmul_flops(eqn) * times
        stats = self.stats[(path, phase)]
        widened = [widened_from(v, producers) for v in eqn.invars[:2]]
        if all(w is not None for w in widened):  # 16-bit values in a float32 product
            lhs, rhs = widened
            kind = MatmulKind(op, short(lhs), short(rhs), short(acc), upcast=True)
            stats.matmul_flops[kind] += flops
            stats.activation_bytes[short(out.dtype)] += _nbytes(out) * times
            return
        stats.matmul_flops[MatmulKind(op, short(lhs), short(rhs), short(acc))] += flops
        stats.activation_bytes[short(out.dtype)] += _nbytes(out) * times
        if is_16bit(lhs) and is_16bit(rhs) and is_16bit(acc):
            detail = (
                f"{op} {short(lhs)}*{short(rhs)}->{short(acc)}: its result is rounded to (and "
                f"must fit in) {short(acc)}; no float32 result asked for"
            )
            self.hazards[HazardCount("16-bit accumulation", path, phase, detail)] += flops
        if self.ctx.compute is None or (is_16bit(lhs) and is_16bit(rhs)):
            return
        rule = override_rule(tag, self.ctx.overrides) if tag is not None else None
        if rule is None:
            custom = in_custom or (phase == "backward" and path in self.custom_paths)
            rule = "custom-derivative" if custom else "not rewritten"
            why = (
                "a custom-derivative function's own rule runs as written"
                if custom
                else "jamp did not rewrite it"
            )
            detail = f"{op} {short(lhs)}*{short(rhs)}: {why}"
            self.hazards[HazardCount("fp32 matmul", path, phase, detail)] += flops
        stats.kept_fp32_flops[rule] += flops

    def _collective(self, eqn, stack: str, times: int) -> None:
        path, phase, _ = self.where(stack)
        # JAX releases spell a psum inside shard_map psum2 or psum_invariant: one name here.
        name = "psum" if eqn.primitive.name.startswith("psum") else eqn.primitive.name
        for v in eqn.invars:
            if not is_float(v.aval.dtype):
                continue
            key = (name, short(v.aval.dtype))
            self.collective_bytes[key] += _nbytes(v.aval) * times
            if is_16bit(v.aval.dtype) and eqn.primitive.name in REDUCING_COLLECTIVES:
                detail = f"{name} in {short(v.aval.dtype)}: partial sums rounded"
                hazard = HazardCount("16-bit collective", path, phase, detail)
                self.hazards[hazard] += _size(v.aval) * times

    def _elementwise(self, eqn, stack: str, times: int, consumers) -> None:
        floats_in = [v.aval for v in eqn.invars if is_float(v.aval.dtype)]
        floats_out = [v.aval for v in eqn.outvars if is_float(v.aval.dtype)]
        if not floats_in and not floats_out:
            return
        name = eqn.primitive.name
        if name in STRUCTURAL:
            return
        path, phase, tag = self.where(stack)
        stats = self.stats[(path, phase)]
        for aval in floats_out:
            stats.activation_bytes[short(aval.dtype)] += _nbytes(aval) * times
        if name == "convert_element_type":
            return  # a cast: its result counts as a value, not as arithmetic
        dtype = (floats_in or floats_out)[0].dtype
        elements = max(_size(a) for a in floats_in + floats_out) * times
        stats.elementwise[short(dtype)] += elements
        if is_16bit(dtype):
            self._check_16bit(eqn, path, phase, elements, consumers)
        elif self.ctx.compute is not None:
            stats.kept_fp32[self._fp32_rule(name, tag)] += elements

    def _fp32_rule(self, name: str, tag: Optional[int]) -> str:
        """Why a float32 operation stayed float32 under a 16-bit policy."""
        if tag is not None:
            rule = override_rule(tag, self.ctx.overrides)
            if rule is not None:
                return rule
        if name in act.FP32_PRIMITIVES:
            return "exp/log/reduction"
        if act.runs_in_fp32(name, self.ctx.compute):
            return "fp16 range (square/power)"
        return "float32 activations" if self.ctx.activations == "float32" else "float32 operand"

    def _check_16bit(self, eqn, path: str, phase: str, elements: int, consumers) -> None:
        name = eqn.primitive.name
        dtype = eqn.invars[0].aval.dtype if eqn.invars else eqn.outvars[0].aval.dtype
        found = []
        if name == "exp" and _summed(eqn.outvars[0], consumers):
            found.append(("16-bit softmax", "exp whose sum normalizes it"))
        elif name in act.FP32_PRIMITIVES and name not in _SUMS and name != "rsqrt":
            found.append(("16-bit exp/log", name))
        if name == "rsqrt" or _is_norm_class(self.ctx.calls.classes.get(path)):
            found.append(("16-bit normalization", f"{name} in a normalization layer's statistics"))
        if name in _SUMS:
            terms = _size(eqn.invars[0].aval) // max(_size(eqn.outvars[0].aval), 1)
            if name.startswith("cum"):
                terms = eqn.invars[0].aval.shape[int(jax_compat.param(eqn, "axis"))]
            limit = 2 ** jnp.finfo(dtype).nmant  # where a running sum's ulp outgrows its terms
            if terms > limit:
                found.append(("16-bit reduction", f"{name} of {terms} terms (> {limit})"))
        for kind, detail in found:
            detail = f"{detail} in {short(dtype)}"
            self.hazards[HazardCount(kind, path, phase, detail)] += elements
