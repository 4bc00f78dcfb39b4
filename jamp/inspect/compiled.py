"""What a step compiled for a GPU target keeps and runs: `jamp.compile_for`'s report.

Built from the compiled program and XLA's dumps (`jamp.hlo`): memory per device (XLA's
`memory_analysis()`, and live bytes by dtype from its buffer assignment), GEMMs by kernel family
and operand dtypes with their FLOPs, every float32 GEMM by module path, attention calls (cuDNN's
fused kernel or separate matmuls and softmax), and collectives by kind, dtype and mesh axis.
Printable (`table()`) and as data (`to_dict()`, `to_json()`). With it, a predicted step time
(`jamp.inspect.timing`): the kernels by kind and the costliest ones, by a roofline per kernel
plus its launch.

All memory figures are XLA's plan for the target, not a measured peak; the step time is a model
fitted to measured steps, not a measurement.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
from typing import Any, Optional

from jamp import hlo, losses
from jamp.hlo import buffers
from jamp.hlo.kernels import attention_mask
from jamp.inspect import fp8_cost, timing
from jamp.inspect._paths import ModuleCalls, module_path, report_path, split_top

_GIB = float(1 << 30)


def memory_fraction() -> float:
    """The share of a GPU's memory JAX's allocator takes: $XLA_PYTHON_CLIENT_MEM_FRACTION, else
    JAX's default 0.75 (the rest is the CUDA context, cuBLAS / cuDNN / NCCL buffers and what
    other processes hold)."""
    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    try:
        fraction = float(value) if value else 0.75
    except ValueError:
        fraction = 0.75
    return min(max(fraction, 0.0), 1.0)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device: XLA's `memory_analysis()` and, at the temporaries' fullest moment, what
    they hold by dtype class (`temporaries_by_dtype`, summing to `temporaries`)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    hbm: int
    arguments_by_dtype: dict[str, int]
    temporaries_by_dtype: dict[str, int]

    @property
    def peak(self) -> int:
        """Arguments + outputs not aliased to them + temporaries: all live at once."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def share(self) -> float:
        """The peak as a fraction of the GPU's memory."""
        return self.peak / self.hbm if self.hbm else float("nan")


@dataclasses.dataclass(frozen=True)
class GemmGroup:
    """GEMMs of one kernel family and operand dtypes."""

    kind: str
    operands: str  # "bf16 x bf16"
    count: int
    flops: int


@dataclasses.dataclass(frozen=True)
class Attention:
    """One attention call site (a module path) and how it runs."""

    path: str
    fused: bool  # cuDNN's fused kernel (forward and backward) instead of matmuls and softmax
    forward: int  # kernel calls (fused) or batched GEMMs (unfused) in the forward pass
    backward: int
    # a fused one's mask, as cuDNN runs it: "causal" (half of the scores skipped) or "none"
    # (every score computed), "+ bias" where an additive bias is read ("" unfused)
    mask: str = ""


@dataclasses.dataclass(frozen=True)
class CollectiveGroup:
    """Collectives of one kind and dtype over the same mesh axes, per step, per device."""

    kind: str
    dtype: str
    axes: tuple[str, ...]
    count: int
    nbytes: int  # of their results, on one device
    into_matmul: int  # how many feed a matmul (a weight's gather)


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """`jamp.compile_for`'s report. See the module docstring."""

    target: str
    gpu: str
    devices: int
    mesh: dict[str, int]
    activations: tuple[str, ...]  # the forms wrapped models resolved to while traced
    compile_seconds: float
    memory: Memory
    gemms: tuple[hlo.Gemm, ...]
    attention: tuple[Attention, ...]
    collectives: tuple[CollectiveGroup, ...]
    hlo_text: str = dataclasses.field(repr=False, default="")
    # What jamp's engine recognised as attention while tracing, per call: (module path, how it
    # runs: "cudnn", "xla" (written out) or "unfused" (as traced), why not cuDNN).
    attention_traced: tuple[tuple[str, str, str], ...] = ()
    # The step time predicted from the program's kernels (a model, not a measurement).
    estimate: Optional[timing.Estimate] = None
    # What its fp8 GEMMs save and their scaling costs (a model); None without fp8 GEMMs.
    fp8: Optional[fp8_cost.Fp8Cost] = None
    # The module calls recorded while the step was traced: they name an op's module by its
    # params path (`jamp.inspect._paths`). Not part of the report's data.
    calls: Optional[ModuleCalls] = dataclasses.field(default=None, repr=False, compare=False)

    def op_path(self, op_name: str) -> tuple[str, bool]:
        """(module path, whether backward) of an HLO instruction's `op_name`: the params path
        of the module it ran in ("" outside any), read with the calls recorded while tracing."""
        return report_path(op_name, self.calls)

    def usable_bytes(self, fraction: Optional[float] = None) -> int:
        """Bytes a step may plan for per device: `fraction` (default
        `jamp.target.memory_fraction()`, JAX's allocator pool) of the GPU's memory."""
        return int(self.memory.hbm * (memory_fraction() if fraction is None else fraction))

    def fits(self, fraction: Optional[float] = None) -> bool:
        """Whether the planned peak fits in `usable_bytes(fraction)`."""
        return self.memory.peak <= self.usable_bytes(fraction)

    def gemm_groups(self) -> list[GemmGroup]:
        groups: dict[tuple[str, str], list[hlo.Gemm]] = {}
        for g in self.gemms:
            groups.setdefault((g.kind, " x ".join(g.operands) or "?"), []).append(g)
        return sorted(
            (
                GemmGroup(k, o, sum(g.count for g in v), sum(g.flops * g.count for g in v))
                for (k, o), v in groups.items()
            ),
            key=lambda g: -g.flops,
        )

    def fp32_gemms(self) -> list[tuple[str, str, str, int]]:
        """(module path, "forward" / "backward", kernel family, count) of every GEMM with a
        float32 operand."""
        found: collections.Counter[tuple[str, str, str]] = collections.Counter()
        for g in self.gemms:
            if g.is_fp32:
                path, backward = self.op_path(g.op_name)
                key = (path or _scope(g.op_name), "backward" if backward else "forward", g.kind)
                found[key] += g.count
        return [(*k, n) for k, n in sorted(found.items())]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(dataclasses.replace(self, hlo_text="", calls=None))
        out.pop("hlo_text")
        out.pop("calls")
        out["memory"]["peak"] = self.memory.peak
        out["memory"]["share"] = self.memory.share
        out["gemms"] = [dataclasses.asdict(g) for g in self.gemm_groups()]
        out["fp32_gemms"] = [
            dict(zip(("path", "pass", "kind", "count"), r)) for r in self.fp32_gemms()
        ]
        out["fits"] = self.fits()
        out["usable_bytes"] = self.usable_bytes()
        out["estimate"] = self.estimate.to_dict() if self.estimate is not None else None
        if self.fp8 is not None:
            out["fp8"]["slower"] = self.fp8.slower
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def table(self) -> str:
        return "\n".join(_table_lines(self))


_TRANSFORM = re.compile(r"^(?:jvp|transpose|vmap|remat|checkpoint)\((.*)\)$")


def _scope(op_name: str) -> str:
    """An op name's scopes without the primitive and JAX's own wrappers ("(top level)" if none):
    `jit(...)` levels dropped, transformations unwrapped ("transpose(jvp(Wrapped.apply))" is
    "Wrapped.apply"), so that a forward and its backward name one place."""
    parts = []
    for part in split_top(op_name)[:-1]:
        while (m := _TRANSFORM.match(part)) is not None:
            part = m.group(1)
        if not part.startswith(("jit(", "pjit(")):
            parts.append(part)
    return "/".join(parts) or "(top level)"


def _natural(text: str):
    """Sort key: numbers as numbers ("layers_2" before "layers_10")."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _size(n: float) -> str:
    """Bytes in GiB from 1 GiB, else MiB."""
    return f"{n / _GIB:.2f} GiB" if abs(n) >= _GIB else f"{n / (1 << 20):.1f} MiB"


def _flop(n: float) -> str:
    return f"{n / 1e12:.3f} TFLOP" if n >= 1e11 else f"{n / 1e9:.2f} GFLOP"


def _table_lines(r: CompileReport) -> list[str]:
    m = r.memory
    mesh = ", ".join(f"{k}={v}" for k, v in r.mesh.items()) or "one device"
    forms = {"compute": "16-bit between matmuls", "float32": "float32 between matmuls"}
    act = "; ".join(f"{a} ({forms.get(a, a)})" for a in r.activations) or (
        "no 16-bit policy traced (or JAX reused an earlier trace of this step)"
    )
    lines = [
        f"compiled for {r.target} ({r.devices} x {r.gpu}, {_size(m.hbm)} each), mesh {mesh}, "
        f"in {r.compile_seconds:.1f} s",
        f"activations: {act}",
        "memory per device, XLA's buffer plan (not a measured peak):",
        f"  arguments    {_size(m.arguments):>12}",
        f"  outputs      {_size(m.outputs):>12}  ({_size(m.aliased)} of them aliased to arguments)",
        f"  temporaries  {_size(m.temporaries):>12}",
        f"  peak         {_size(m.peak):>12}  = {m.share:.1%} of HBM",
    ]
    usable = r.usable_bytes()
    verdict = "fits" if r.fits() else "does NOT fit"
    lines.append(
        f"  {verdict} in {_size(usable)} ({usable / m.hbm:.0%} of HBM: the pool JAX's allocator "
        "takes, XLA_PYTHON_CLIENT_MEM_FRACTION)"
    )
    split = ", ".join(f"{k} {_size(v)}" for k, v in m.temporaries_by_dtype.items() if v)
    lines.append(f"  temporaries at their peak, by dtype: {split or '-'}")
    args = ", ".join(f"{k} {_size(v)}" for k, v in m.arguments_by_dtype.items() if v)
    lines.append(f"  arguments by dtype: {args or '-'}")
    lines.append("GEMMs per step and device:")
    for g in r.gemm_groups():
        lines.append(f"  {g.operands:<22} {g.kind:<13} x{g.count:<6} {_flop(g.flops):>14}")
    fp32 = r.fp32_gemms()
    lines.append(f"float32 GEMMs: {'none' if not fp32 else sum(n for *_, n in fp32)}")
    for path, which, kind, n in fp32:
        lines.append(f"  {path} ({which}, {kind}) x{n}")
    fused = [a for a in r.attention if a.fused]
    unfused = [a for a in r.attention if not a.fused]
    lines.append(
        f"attention: {len(fused)} fused (cuDNN), {len(unfused)} unfused (matmuls + softmax)"
    )
    groups: dict[tuple, list[str]] = {}
    for a in r.attention:
        groups.setdefault((a.fused, a.forward, a.backward, a.mask), []).append(a.path)
    for (is_fused, forward, backward, mask), paths in groups.items():
        how = "cuDNN fused kernel" if is_fused else "batched GEMMs"
        masked = f"; mask {mask}" if mask else ""
        shown = ", ".join(sorted(paths, key=_natural)[:3])
        more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        lines.append(
            f"  {len(paths)} x {'fused' if is_fused else 'unfused'} ({forward} forward / "
            f"{backward} backward {how} each{masked}): {shown}{more}"
        )
    lines.extend(_traced_attention_lines(r))
    lines.append("collectives per step (result bytes per device):")
    if not r.collectives:
        lines.append("  none")
    for c in r.collectives:
        over = ",".join(c.axes) or "?"
        feeds = f", {c.into_matmul} into matmuls" if c.into_matmul else ""
        lines.append(
            f"  {c.kind:<18} {c.dtype:<9} over {over:<12} x{c.count:<5} {_size(c.nbytes):>12}{feeds}"
        )
    if r.estimate is not None:
        lines.extend(r.estimate.lines())
    if r.fp8 is not None:
        lines.extend(r.fp8.lines())
    return lines


def _traced_attention_lines(r: CompileReport) -> list[str]:
    """What the engine decided per attention it recognised, grouped by decision and reason."""
    if not r.attention_traced:
        return []
    groups: dict[tuple[str, str], list[str]] = {}
    for path, how, why in r.attention_traced:
        groups.setdefault((how, why), []).append(path)
    names = {"cudnn": "cuDNN fused", "xla": "written out", "unfused": "left as traced"}
    lines = [f"  recognised by jamp while tracing: {len(r.attention_traced)}"]
    for (how, why), paths in sorted(groups.items()):
        distinct = sorted(set(paths), key=_natural)
        shown = ", ".join(distinct[:2])
        more = f" and {len(distinct) - 2} more" if len(distinct) > 2 else ""
        lines.append(
            f"    {len(paths)} {names.get(how, how)}{f' ({why})' if why else ''}: {shown}{more}"
        )
    return lines


def _attention(
    program: hlo.Program, gemms: list[hlo.Gemm], calls: Optional[ModuleCalls] = None
) -> list[Attention]:
    sites: dict[str, list[int]] = {}  # path -> [fused fwd, fused bwd, gemm fwd, gemm bwd]
    masks: dict[str, str] = {}
    for inst in program.instructions:
        if inst.op == "custom-call" and inst.target.startswith("__cudnn$fmha"):
            path, _ = report_path(inst.op_name, calls)
            path = path or _scope(inst.op_name)
            backward = "Backward" in inst.target
            sites.setdefault(path, [0, 0, 0, 0])[1 if backward else 0] += 1
            mask = attention_mask(inst)
            if mask is not None:
                masks[path] = mask
    softmax = set()  # paths with an exponential: a softmax
    for inst in program.instructions:
        if inst.op == "exponential":
            path, backward = report_path(inst.op_name, calls)
            if not backward:
                softmax.add(path or _scope(inst.op_name))
    for g in gemms:
        # (the fused head + loss: batched GEMMs around an exponential too, but no attention)
        if not g.batched or losses.SCOPE in g.op_name:
            continue
        path, backward = report_path(g.op_name, calls)
        path = path or _scope(g.op_name)
        if path in softmax:
            sites.setdefault(path, [0, 0, 0, 0])[3 if backward else 2] += 1
    out = []
    for path, (ff, fb, gf, gb) in sorted(sites.items()):
        if ff or fb:
            out.append(Attention(path, True, ff, fb, masks.get(path, "")))
        elif gf >= 2:
            out.append(Attention(path, False, gf, gb))
    return out


def _collective_groups(program: hlo.Program, mesh) -> list[CollectiveGroup]:
    axes = list(mesh.shape.items()) if mesh is not None else []
    groups: dict[tuple, list[hlo.Collective]] = {}
    for c in hlo.collectives(program):
        over = hlo.mesh_axes(c.groups, axes) if axes else ()
        groups.setdefault((c.kind, c.dtype, over), []).append(c)
    return [
        CollectiveGroup(
            k,
            d,
            a,
            sum(c.count for c in v),
            sum(c.nbytes * c.count for c in v),
            sum(c.count for c in v if c.into_matmul),
        )
        for (k, d, a), v in sorted(
            groups.items(), key=lambda kv: -sum(c.nbytes * c.count for c in kv[1])
        )
    ]


def _file(files: dict[str, str], suffix: str) -> str:
    """The dump of the optimized program (XLA also dumps some before optimizations)."""
    found = [t for n, t in files.items() if n.endswith(suffix) and "after_optimizations" in n]
    found = found or [t for n, t in files.items() if n.endswith(suffix)]
    return found[-1] if found else ""


def _arguments_by_dtype(allocations) -> dict[str, int]:
    out = dict.fromkeys(buffers.CLASSES[:-2], 0)
    for a in allocations:
        if a.kind == "parameter":  # by the parameter's own shape (donated bytes hold others too)
            out[a.cls] = out.get(a.cls, 0) + a.size
    return out


#: The dumps the report reads (file name endings): XLA's buffer assignment and live ranges.
DUMPS = ("buffer-assignment.txt", "live-range.txt")


def _traced_path(where: str, calls: Optional[ModuleCalls]) -> str:
    """The params path of the module an attention recognised while tracing ran in (the engine
    notes its name-scope path); the scope path itself where it names no module."""
    return module_path(where, calls) or where


def build_report(
    *,
    target,
    devices,
    executable,
    files,
    mesh,
    activations,
    compile_seconds,
    attention_traced=(),
    calls: Optional[ModuleCalls] = None,
) -> CompileReport:
    """The report of one compiled program (see `jamp.compile_for`); `calls`: the module calls
    recorded while its step was traced, which name modules by their params paths."""
    missing = [d for d in DUMPS if not any(n.endswith(d) for n in files)]
    if missing:
        raise RuntimeError(
            f"XLA dumped no {', '.join(missing)} for this program (this XLA names its dumps "
            "otherwise): the memory split by dtype cannot be read"
        )
    text = executable.as_text()
    program = hlo.parse(text)
    stats = executable.memory_analysis()
    allocations = buffers.parse_buffer_assignment(_file(files, "buffer-assignment.txt"))
    ranges = buffers.parse_live_ranges(_file(files, "live-range.txt"))
    peak = buffers.temp_peak(allocations, ranges)
    temps = dict(peak.by_class)
    # XLA's temp figure may include what its plan lists apart (e.g. alignment); keep the split
    # summing to it.
    temps["free"] = max(0, temps["free"] + stats.temp_size_in_bytes - peak.size)
    memory = Memory(
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes),
        hbm=target.gpu.hbm_bytes,
        arguments_by_dtype=_arguments_by_dtype(allocations),
        temporaries_by_dtype=temps,
    )
    found = hlo.gemms(program)
    return CompileReport(
        target=target.name,
        gpu=target.gpu.kind,
        devices=devices,
        mesh=dict(mesh.shape) if mesh is not None else {},
        activations=tuple(activations),
        compile_seconds=compile_seconds,
        memory=memory,
        gemms=tuple(found),
        attention=tuple(_attention(program, found, calls)),
        collectives=tuple(_collective_groups(program, mesh)),
        hlo_text=text,
        attention_traced=tuple(
            (_traced_path(where, calls), how, why) for where, how, why in attention_traced
        ),
        estimate=timing.estimate(program, target.gpu, found_gemms=found, calls=calls),
        fp8=fp8_cost.summary(program, target.gpu),
        calls=calls,
    )
