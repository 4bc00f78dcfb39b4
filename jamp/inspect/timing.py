"""A step time predicted from a compiled GPU program: a roofline per kernel, plus its launch.

This is a model, not a measurement. Per kernel of the optimized program (`jamp.hlo.kernels`):

    time = launch + max(bytes / (bandwidth x memory), flops / (peak[dtype] x share))

with the GPU's published HBM bandwidth and dense tensor-core peaks (float32 GEMMs at the TF32
rate, JAX's default precision on NVIDIA GPUs). A GEMM's share of its dtype's peak is its shape's
(`jamp.inspect.gemm_rate`: waves of 128 x 128 tiles on the GPU's SMs, split-K, a tile's fixed
cost; fitted per dtype to public matmul measurements, fp8 at its own share of its own peak)
times a correction fitted once to measured steps; fused attention's is a constant share. The
constants (`RATES`, see its docstring): the GPU-side cost of a launch, the fraction of bandwidth
streaming kernels reach, the GEMM correction, attention's share. Kernels run one after another
(XLA:GPU runs one stream by default); collectives are timed by bytes over NVLink plus a launch,
not overlapped (see `kernel_seconds`).

Example::

    est = estimate(hlo.parse(compiled.as_text()), jamp.target.GPUS["h200"])
    est.seconds, est.kernels, est.by_kind, est.top[:5]
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from jamp.hlo.kernels import Kernel, kernels
from jamp.hlo.text import Program
from jamp.inspect import gemm_rate
from jamp.inspect._paths import report_path


@dataclasses.dataclass(frozen=True)
class Rates:
    """The model's constants: per-launch seconds, the fraction of HBM bandwidth streaming kernels
    reach, the correction applied to every GEMM's rate of `jamp.inspect.gemm_rate` (1: the public
    fits as they are), and the fraction of the dense peak fused attention reaches."""

    launch: float
    memory: float
    matmul: float
    attention: float


#: Fitted to the three JAX rows measured on one H200 (docs/results.md, "On an H200": Hugging
#: Face GPT-2 small, batch 8 x 1024, AdamW; TF32 52.63 ms, HF's own bf16 build 27.21 ms, jamp.wrap
#: mixed_bfloat16 24.55 ms; jax 0.11.2) with those programs compiled here for an H200
#: (experiments/gpu_estimate.py --calibrate; its results file gives each row's error). One
#: constant is fitted, the launch cost: 5.6 us, the fixed cost per call that XLA's own matmul
#: table shows too (`jamp.inspect.gemm_rate`). GEMM rates are the public fits as they are
#: (correction 1; freed, the three rows fit 1.31: GEMMs above their peak); bandwidth and
#: attention shares are held at 0.80 and 0.45. (Before GEMMs had shapes: launch 4.0 us and one
#: GEMM share of 0.57 for every shape and dtype, which had fp8 faster than bf16 on GPT-2 small.)
RATES = Rates(launch=5.6e-6, memory=0.80, matmul=1.0, attention=0.45)


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """A step measured on a GPU, and the model's error on it: fitted with it, and predicted by
    the model fitted to the other measured steps (leave-one-out)."""

    name: str
    measured_ms: float
    error: float
    held_out_error: float


#: Every JAX program measured on a GPU so far (experiments/gpu_estimate.py; add the rows that
#: experiments/gpu_suite.sh measures when it runs).
CALIBRATION = (
    Calibrated("Hugging Face GPT-2 small, TF32", 52.63, +0.045, +0.047),
    Calibrated("Hugging Face GPT-2 small, its own bf16 build", 27.21, +0.036, +0.036),
    Calibrated("Hugging Face GPT-2 small, jamp mixed_bfloat16", 24.55, -0.047, -0.118),
)
#: The range a prediction is given with: the largest leave-one-out error.
ERROR = max(abs(c.held_out_error) for c in CALIBRATION)


# Per GPU dtype class: which published peak applies (TF32 is half the bf16 dense peak).
_PEAK_SHARE = {"bf16": 1.0, "f16": 1.0, "f8": 2.0, "f32": 0.5}
_NVLINK = 450e9  # bytes/s each way per H100/H200 (NVLink 4: 900 GB/s bidirectional)


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """One kernel's predicted time per step (all its runs), and what bounds it."""

    name: str
    kind: str
    path: str  # module path from its op name; "(loss)" / "(update)" for work outside the model
    backward: bool
    seconds: float
    bound: str  # "memory", "compute", "launch" or "link"
    bytes: int
    flops: int
    count: int


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A predicted step time: its total, per kernel kind, and the costliest kernels."""

    seconds: float
    kernels: int  # launches per step
    by_kind: dict[str, tuple[int, float]]  # kind -> (launches, seconds)
    top: tuple[KernelTime, ...]
    launch_seconds: float  # the launches' share of `seconds`
    rates: Rates
    gpu: str

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["by_kind"] = {k: {"kernels": n, "seconds": s} for k, (n, s) in self.by_kind.items()}
        out["range_seconds"] = self.range_seconds()
        out["note"] = NOTE
        return out

    def range_seconds(self) -> tuple[float, float]:
        """The prediction's range: +- the model's largest leave-one-out error (`ERROR`)."""
        return self.seconds * (1 - ERROR), self.seconds * (1 + ERROR)

    def lines(self, top: int = 10) -> list[str]:
        low, high = self.range_seconds()
        out = [
            f"predicted step time on one {self.gpu}: {self.seconds * 1e3:.2f} ms "
            f"({low * 1e3:.1f}-{high * 1e3:.1f} ms), {self.kernels} kernel launches "
            f"({self.launch_seconds * 1e3:.2f} ms of it launches)",
            f"  ({NOTE})",
            "  by kind:",
        ]
        for kind, (n, s) in sorted(self.by_kind.items(), key=lambda kv: -kv[1][1]):
            out.append(f"    {kind:<12} x{n:<5} {s * 1e3:8.2f} ms")
        out.append(f"  top {min(top, len(self.top))} kernels by predicted time:")
        for k in self.top[:top]:
            where = (
                k.path
                if k.path.startswith("(") and k.path != "(loss)"
                else (f"{k.path} ({'backward' if k.backward else 'forward'})")
            )
            count = f" x{k.count}" if k.count > 1 else ""
            out.append(
                f"    {k.seconds * 1e3:7.3f} ms  {k.kind:<11} {k.bound:<7} {k.name}{count}  {where}"
            )
        return out


NOTE = (
    "a model, not a measurement: per kernel max(bytes / bandwidth, FLOPs / (peak x its GEMM "
    "shape's share)) plus a launch, fitted to 3 measured H200 steps; the range is its largest "
    "error on a measured step it was not fitted to (leave-one-out); collectives: bytes over "
    "NVLink, not overlapped"
)


def _peak(gpu, dtype: str) -> float:
    return gpu.bf16_tflops * 1e12 * _PEAK_SHARE.get(dtype, 0.5)


def kernel_parts(k: Kernel, gpu, rates: Rates = RATES) -> tuple[float, float]:
    """(seconds its bytes take, seconds its matrix units take) for one run of `k`, launch left
    out. A collective's bytes cross one GPU's NVLink (450 GB/s each way): no latency per hop, no
    overlap with compute (XLA's asynchronous collectives may hide some of it)."""
    if k.kind == "collective":
        return k.collective_bytes / _NVLINK, 0.0
    memory = k.bytes / (gpu.memory_bandwidth * rates.memory)
    if not k.flops:
        return memory, 0.0
    if k.kind == "attention":
        share = rates.attention
    else:
        share = rates.matmul * gemm_rate.efficiency(k.gemm_shape, k.dtype, gpu.sm_count)
    return memory, k.flops / (_peak(gpu, k.dtype) * share)


def kernel_seconds(k: Kernel, gpu, rates: Rates = RATES) -> tuple[float, str]:
    """(seconds for one run of `k`, what bounds it): a launch, then its bytes or its matrix
    units' work, whichever takes longer (`kernel_parts`)."""
    memory, compute = kernel_parts(k, gpu, rates)
    if k.kind == "collective":
        return rates.launch + memory, "link"
    if max(memory, compute) < rates.launch:
        return rates.launch + max(memory, compute), "launch"
    return rates.launch + max(memory, compute), "compute" if compute > memory else "memory"


def _outside(op_name: str) -> str:
    """Where a kernel outside every module belongs: the loss (differentiated, so its op name
    carries `jvp(`), the update after it, or nowhere XLA said ("(unnamed)")."""
    if not op_name:
        return "(unnamed)"
    return "(loss)" if "jvp(" in op_name else "(update)"


def estimate(
    program: Program, gpu, rates: Rates = RATES, top: int = 20, found_gemms=None, calls=None
) -> Estimate:
    """The predicted step time of a compiled program on `gpu` (a `jamp.target.Gpu`);
    `found_gemms`: the program's `jamp.hlo.gemms`, where the caller has them already; `calls`:
    the module calls recorded while the step was traced (`jamp.inspect._paths.ModuleCalls`),
    which name each kernel's module by its params path."""
    times = []
    by_kind: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    launches = 0
    for k in kernels(program, found_gemms):
        one, bound = kernel_seconds(k, gpu, rates)
        path, backward = report_path(k.op_name, calls) if k.op_name else ("", False)
        times.append(
            KernelTime(
                k.name,
                k.kind,
                path or _outside(k.op_name),
                backward,
                one * k.count,
                bound,
                k.bytes,
                k.flops,
                k.count,
            )
        )
        by_kind[k.kind][0] += k.count
        by_kind[k.kind][1] += one * k.count
        launches += k.count
    ranked = tuple(sorted(times, key=lambda t: -t.seconds)[:top])
    return Estimate(
        seconds=sum(t.seconds for t in times),
        kernels=launches,
        by_kind={k: (n, s) for k, (n, s) in by_kind.items()},
        top=ranked,
        launch_seconds=launches * rates.launch,
        rates=rates,
        gpu=gpu.kind,
    )


__all__ = [
    "CALIBRATION",
    "ERROR",
    "NOTE",
    "RATES",
    "Calibrated",
    "Estimate",
    "KernelTime",
    "Rates",
    "estimate",
    "kernel_parts",
    "kernel_seconds",
]
