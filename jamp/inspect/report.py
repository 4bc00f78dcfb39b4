"""The precision report: what a policy did to each module, read from the program that runs.

`precision_report(fn, *args)` traces `fn` (a `jamp.wrap`ped model's apply, a function under
`jamp.autocast`, a whole train step from `jamp.make_train_step`) with `jax.make_jaxpr`, so it sees
the program after jamp rewrote it, and counts per Flax module path and pass (forward /
backward: the backward is where users lose precision):

* matmuls and convolutions by operand and accumulation dtype (`preferred_element_type`), in FLOPs;
* elementwise work by dtype, in elements;
* what stayed float32 under a 16-bit policy and by which rule: "normalization" (a normalization
  layer, by `jamp.wrap`'s rules), "override <key>" (the user's overrides), "exp/log/reduction"
  (`jamp.activations.FP32_PRIMITIVES`), "custom-derivative" (a custom-derivative function's own
  rule, which jamp runs as written), "float32 activations" (the values between matmuls, kept
  float32 on CPUs by `activations="float32"`) or "float32 operand" (promoted by a float32 input).

Totals: the share of matmul FLOPs with 16-bit operands, bytes of values produced by dtype. Hazards:
a matmul left float32, a 16-bit product accumulated in 16 bits, a softmax, normalization or
long sum in 16 bits, a 16-bit summing collective (in the jaxpr, e.g. a pmap step's `psum`, and,
with `compiled=True`, in the partitioned HLO), on GPUs a float32 GEMM in the compiled program where
the jaxpr asked for 16 bits, and a compute dtype this device only emulates (`jamp.hardware`).

Example::

  model = jamp.wrap(TransformerLM(vocab_size=256), "mixed_bfloat16")
  step = jamp.make_train_step(loss_fn, tx)
  report = precision_report(step, state, batch, jax.random.key(0))
  print(report.table())
  assert report.totals.share_16bit() == 1.0
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.extend import core as jcore

from jamp import activations as act
from jamp import hardware, hlo
from jamp.hlo import Gemm
from jamp.inspect import _logits, _paths, _walk
from jamp.inspect._walk import MatmulKind

__all__ = ["Gemm", "Hazard", "MatmulKind", "Report", "Row", "Totals", "precision_report"]

#: Hazard kinds, most serious first (the order the table lists them in).
HAZARD_KINDS = (
    "16-bit accumulation",
    "16-bit softmax",
    "16-bit normalization",
    "16-bit reduction",
    "16-bit exp/log",
    "16-bit collective",
    "fp32 matmul",
    "fp32 GEMM in compiled HLO",
    "emulated compute dtype",
    "float32 logits kept",
    "logits formed",
)
LOGITS_CLASSES, LOGITS_ELEMENTS = _logits.CLASSES, _logits.ELEMENTS
#: "other": work outside differentiation in a program that has a backward pass (the optimizer
#: update, the loss-scale adjustment, the finiteness check).
PHASES = ("forward", "backward", "other")


@dataclasses.dataclass(frozen=True)
class Row:
    """What one module path does in one pass ("forward" or "backward")."""

    path: str  # the Flax module path ("" for the root module, OUTSIDE for the loss, optimizer)
    phase: str  # one of PHASES
    matmul_flops: dict[MatmulKind, int]
    elementwise: dict[str, int]  # dtype ("f32", "bf16") -> elements
    kept_fp32: dict[str, int]  # rule -> elements of float32 elementwise work under 16-bit policy
    kept_fp32_flops: dict[str, int]  # rule -> float32 matmul FLOPs under a 16-bit policy
    activation_bytes: dict[str, int]  # dtype -> bytes of the values its operations produce

    @property
    def flops(self) -> int:
        return sum(self.matmul_flops.values())

    @property
    def flops_16bit(self) -> int:
        """Matmul FLOPs whose two operands hold 16-bit values (widened ones included)."""
        return sum(f for k, f in self.matmul_flops.items() if _is16(k.lhs) and _is16(k.rhs))

    @property
    def flops_fp8(self) -> int:
        """Matmul FLOPs whose two operands are fp8 (jamp.fp8: E4M3 / E5M2)."""
        return sum(f for k, f in self.matmul_flops.items() if _is8(k.lhs) and _is8(k.rhs))

    @property
    def flops_upcast(self) -> int:
        """Matmul FLOPs on 16-bit values widened to float32 for the product (see MatmulKind)."""
        return sum(f for k, f in self.matmul_flops.items() if k.upcast)


@dataclasses.dataclass(frozen=True)
class Hazard:
    """A place where precision is likely lost, or speed left on the table."""

    kind: str  # one of HAZARD_KINDS
    path: str  # module path ("" outside modules, or the whole program)
    phase: str  # "forward", "backward" or "" (not tied to one pass)
    detail: str
    amount: int = 0  # FLOPs for matmul hazards, elements (or bytes, collectives) otherwise

    def __str__(self):
        if not (self.path or self.phase):  # the whole program
            return f"{self.kind}: {self.detail}"
        path = self.path or "(root)"
        where = f"{path} ({self.phase})" if self.phase else path
        return f"{self.kind}: {where}: {self.detail}"


@dataclasses.dataclass(frozen=True)
class Totals:
    """Whole-program sums."""

    matmul_flops: dict[str, int]  # phase -> FLOPs
    matmul_flops_16bit: dict[str, int]  # phase -> FLOPs with 16-bit operands
    matmul_flops_upcast: dict[str, int]  # phase -> of those, FLOPs computed in float32
    elementwise: dict[str, int]  # dtype -> elements
    activation_bytes: dict[str, int]  # dtype -> bytes of values produced
    collective_bytes: dict[str, int]  # "psum bf16", "all-gather f32" -> bytes
    matmul_flops_fp8: dict[str, int] = dataclasses.field(default_factory=dict)  # of the 16-bit

    def share_fp8(self) -> float:
        """The fraction of matmul FLOPs with fp8 operands (nan: no matmuls)."""
        total = sum(self.matmul_flops.values())
        return sum(self.matmul_flops_fp8.values()) / total if total else float("nan")

    def share_16bit(self, phase: Optional[str] = None) -> float:
        """The fraction of matmul FLOPs (in `phase`, or all) with 16-bit operands (nan: none)."""
        phases = [phase] if phase else list(self.matmul_flops)
        total = sum(self.matmul_flops.get(p, 0) for p in phases)
        low = sum(self.matmul_flops_16bit.get(p, 0) for p in phases)
        return low / total if total else float("nan")


@dataclasses.dataclass(frozen=True)
class Report:
    """The precision report of one traced program; `table()` prints it."""

    rows: list[Row]
    totals: Totals
    hazards: list[Hazard]
    compute_dtype: str  # the 16-bit dtype the policy computes in, or "float32"
    activations: str  # "float32" or "compute" (see jamp.activations)
    hardware: Optional[str] = None  # whether this device runs the compute dtype natively
    gemms: list[Gemm] = dataclasses.field(default_factory=list)  # with compiled=True
    calls: Any = dataclasses.field(default=None, repr=False, compare=False)

    def row(self, path: str, phase: str = "forward") -> Optional[Row]:
        """The row of one module path and pass, or None."""
        return next((r for r in self.rows if r.path == path and r.phase == phase), None)

    def table(self) -> str:
        from jamp.inspect import _text  # the formatting is long and only needed for printing

        return _text.report_table(self)

    __str__ = table


def _is16(short: str) -> bool:
    return short in ("bf16", "f16") or _is8(short)


def _is8(short: str) -> bool:
    return short.startswith(("f8", "float8"))


def _rows(walker: _walk.Walker) -> list[Row]:
    rows = []
    for (path, phase), s in walker.stats.items():
        if not (s.matmul_flops or s.elementwise):
            continue
        rows.append(
            Row(
                path,
                phase,
                dict(s.matmul_flops),
                dict(s.elementwise),
                dict(s.kept_fp32),
                dict(s.kept_fp32_flops),
                dict(s.activation_bytes),
            )
        )
    return sorted(rows, key=lambda r: PHASES.index(r.phase))  # stable: program order within


def _totals(rows: list[Row], collective_bytes: dict) -> Totals:
    phases = [p for p in PHASES if any(r.phase == p for r in rows)]
    flops, low, up, f8 = ({p: 0 for p in phases} for _ in range(4))
    elementwise: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for r in rows:
        flops[r.phase] += r.flops
        low[r.phase] += r.flops_16bit
        up[r.phase] += r.flops_upcast
        f8[r.phase] += r.flops_fp8
        for d, n in r.elementwise.items():
            elementwise[d] = elementwise.get(d, 0) + n
        for d, n in r.activation_bytes.items():
            nbytes[d] = nbytes.get(d, 0) + n
    return Totals(flops, low, up, elementwise, nbytes, dict(collective_bytes), f8)


def _hazards(counts) -> list[Hazard]:
    out = [Hazard(h.kind, h.path, h.phase, h.detail, int(n)) for h, n in counts.items()]
    return sorted(out, key=lambda h: (HAZARD_KINDS.index(h.kind), -h.amount))


def compiled_hazards(report: Report, hlo_text: str) -> list[Hazard]:
    """Float32 GEMMs in compiled HLO text at module paths (and passes) where the traced program
    computes its matmuls in 16 bits: XLA fell back to float32 there.

    Example::

      text = jax.jit(step).lower(*args).compile().as_text()
      for hazard in compiled_hazards(precision_report(step, *args), text):
          print(hazard)
    """
    return _gemm_hazards(report, hlo.gemms(hlo.parse(hlo_text)))


def _gemm_hazards(report: Report, gemms: list[Gemm]) -> list[Hazard]:
    asked = {(r.path, r.phase) for r in report.rows if r.flops_16bit}
    found: dict[tuple[str, str], list[Gemm]] = {}
    for gemm in gemms:
        if not gemm.is_fp32 or not gemm.op_name:
            continue
        path, backward = _paths.op_name_path(gemm.op_name, report.calls)
        phase = PHASES[int(backward)]
        if (path, phase) in asked:
            found.setdefault((path, phase), []).append(gemm)
    return [
        Hazard(
            "fp32 GEMM in compiled HLO",
            path,
            phase,
            f"{len(found_here)} {found_here[0].kind} GEMM(s) on "
            f"{'*'.join(found_here[0].operands)} where the program asks for {report.compute_dtype}",
            len(found_here),
        )
        for (path, phase), found_here in found.items()
    ]


def _logits_hazards(jaxpr) -> list[Hazard]:
    """What the program does with a language model's logits (`jamp.inspect._logits`)."""
    return [Hazard(*found) for found in _logits.kept(jaxpr) + _logits.formed(jaxpr)]


def _hardware(compute: Optional[np.dtype]) -> tuple[Optional[str], list[Hazard]]:
    """The hardware line, and a hazard when the compute dtype is only emulated here."""
    s = hardware.support(np.dtype(compute) if compute is not None else np.dtype(np.float32))
    native = {True: "native", False: "emulated", None: "unknown"}[s.native]
    line = f"{np.dtype(s.dtype).name} on {s.device}: {native}; {s.detail}"
    if s.native is False and compute is not None:
        return line, [Hazard("emulated compute dtype", "", "", line)]
    return line, []


def _compiled_parts(fn, args, calls) -> tuple[list[Gemm], list[Hazard], dict]:
    """Compiles `fn`: its GEMMs, and the collectives of its partitioned program."""
    jitted = jax.jit(fn)
    executable = jitted.lower(*args).compile()
    text = executable.as_text()
    assert text is not None  # a compiled executable has its HLO text
    gemms = hlo.gemms(hlo.parse(text))
    shardings = jax.tree.leaves(executable.input_shardings)
    devices = {d for s in shardings for d in s.device_set}
    hazards: list[Hazard] = []
    nbytes: dict[str, int] = {}
    if len(devices) > 1:  # partitioned: what crosses devices, in which dtype
        for c in hlo.collectives(hlo.partitioned_hlo(jitted, *args)):
            key = f"{c.kind} {c.dtype}"
            nbytes[key] = nbytes.get(key, 0) + c.nbytes
            if c.dtype in ("bf16", "f16") and c.kind in ("all-reduce", "reduce-scatter"):
                path, backward = _paths.op_name_path(c.op_name or "x", calls)
                detail = f"{c.kind} of {c.dtype}{list(c.shape)}: partial sums rounded"
                hazards.append(
                    Hazard("16-bit collective", path, PHASES[int(backward)], detail, c.nbytes)
                )
    return gemms, hazards, nbytes


def _trace(fn, args):
    """`fn`'s jaxpr on `args`, and the Flax module calls made while tracing it."""
    # A new function each time, so that at least the outer trace runs again.
    return _paths.recording_calls(fn, lambda: jax.make_jaxpr(lambda *a: fn(*a))(*args))


def _survey(jaxpr) -> tuple[Optional[np.dtype], bool, bool]:
    """(the 16-bit dtype most matmul FLOPs take their operands in, or None; whether the program
    holds a backward pass; whether it runs a jamp.wrap'ped model)."""
    flops: collections.Counter = collections.Counter()
    backward = wrapped = False

    def visit(j):
        nonlocal backward, wrapped
        producers = {}
        for eqn in j.eqns:
            producers.update((v, eqn) for v in eqn.outvars)
            stack = str(eqn.source_info.name_stack)
            backward = backward or _paths.is_backward(stack)
            wrapped = wrapped or "Wrapped." in stack
            if eqn.primitive.name in _walk.MATMULS:
                lhs, rhs = (
                    _walk.widened_from(v, producers) or v.aval.dtype for v in eqn.invars[:2]
                )
                if _walk.is_16bit(lhs) and lhs == rhs:
                    flops[np.dtype(lhs)] += _walk.matmul_flops(eqn)
            for sub in jcore.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr)
    return (flops.most_common(1)[0][0] if flops else None), backward, wrapped


def _wrapped_settings(calls: _paths.ModuleCalls) -> dict[str, Any]:
    """The policy, activations and overrides of the first `jamp.wrap`ped model the trace ran."""
    if not calls.wrapped:
        return {}
    w = calls.wrapped[0]
    return {
        "compute": np.dtype(w.policy.compute_dtype),
        "activations": act.resolve(w.activations),
        "overrides": w.overrides,
    }


def precision_report(fn: Callable, *args, compiled: bool = False, compute_dtype=None) -> Report:
    """The precision report of `fn(*args)`, per Flax module path, forward and backward apart.

    Args:
      fn: any JAX function: a `jamp.wrap`ped model's apply, a function under
        `jamp.autocast.autocast`, a train step; trace a gradient (e.g. the step of
        `jamp.make_train_step`, or `jax.value_and_grad` of a loss) to see the backward pass.
      *args: example arguments: arrays or `jax.ShapeDtypeStruct`s (nothing is run).
      compiled: also compile `fn` (nothing is run): on GPUs, flag float32 GEMMs that XLA chose
        where the program asks for 16 bits; on several devices, read the collectives of the
        partitioned program.
      compute_dtype: the policy's compute dtype; by default that of the `jamp.wrap`ped model
        `fn` runs, else the 16-bit dtype most matmuls use.

    Returns:
      A `Report`: `.rows`, `.totals`, `.hazards`, `.table()`.

    Example::

      report = precision_report(jax.value_and_grad(loss), params, batch)
      report.row("Dense_0", "backward").matmul_flops
    """
    closed, calls = _trace(fn, args)
    settings = _wrapped_settings(calls)
    inferred, differentiated, wrapped = _survey(closed.jaxpr)
    compute = compute_dtype if compute_dtype is not None else settings.get("compute", inferred)
    compute = np.dtype(compute) if compute is not None and _walk.is_16bit(compute) else None
    activations = settings.get("activations") or act.resolve("auto")
    ctx = _walk.Context(calls, compute, activations, settings.get("overrides", ()), wrapped)
    walker = _walk.Walker(ctx, differentiated)
    walker.walk(closed.jaxpr)
    rows = _rows(walker)
    collective_bytes = {f"{p} {d}": n for (p, d), n in walker.collective_bytes.items()}
    hazards = _hazards(walker.hazards)
    hardware_line, hardware_hazards = _hardware(compute)
    report = Report(
        rows=rows,
        totals=_totals(rows, collective_bytes),
        hazards=hazards + hardware_hazards + _logits_hazards(closed.jaxpr),
        compute_dtype=np.dtype(compute).name if compute is not None else "float32",
        activations=activations,
        hardware=hardware_line,
        calls=calls,
    )
    return _with_compiled(report, fn, args) if compiled else report


def _with_compiled(report: Report, fn, args) -> Report:
    """`report` with what the compiled program adds: its GEMMs (and, on GPUs, those XLA left
    float32) and the collectives of its partitioned program."""
    gemms, collective_hazards, hlo_bytes = _compiled_parts(fn, args, report.calls)
    extra = collective_hazards
    if jax.default_backend() in ("gpu", "cuda", "rocm"):
        extra = extra + _gemm_hazards(report, gemms)
    totals = dataclasses.replace(
        report.totals, collective_bytes={**report.totals.collective_bytes, **hlo_bytes}
    )
    return dataclasses.replace(
        report,
        totals=totals,
        hazards=sorted(report.hazards + extra, key=lambda h: HAZARD_KINDS.index(h.kind)),
        gemms=gemms,
    )
