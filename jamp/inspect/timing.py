"""A step time predicted from a compiled GPU program: a roofline per kernel, plus its launch.

This is a model, not a measurement. Per kernel of the optimized program (`jamp.hlo.kernels`):

    time = launch + max(bytes / (bandwidth x memory), flops / (peak[dtype] x matmul))

with the GPU's published HBM bandwidth and dense tensor-core peaks (float32 GEMMs at the TF32
rate, JAX's default precision on NVIDIA GPUs), and four constants fitted once to measured steps
(`RATES`, see its docstring): the GPU-side cost of a launch, and the fractions of bandwidth and
of peak that kernels reach. Kernels run one after another (XLA:GPU runs one stream by default);
collectives are timed by bytes over NVLink and not overlapped.

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
from jamp.inspect._paths import op_name_path


@dataclasses.dataclass(frozen=True)
class Rates:
    """The model's constants: per-launch seconds, and the fractions of HBM bandwidth, GEMM peak
    and fused-attention peak that kernels reach."""

    launch: float
    memory: float
    matmul: float
    attention: float


#: Fitted to the three JAX rows measured on one H200 (research/gpu_h200.md: Hugging Face GPT-2
#: small, batch 8 x 1024, AdamW; TF32 52.63 ms, HF's own bf16 build 27.21 ms, jamp.wrap
#: mixed_bfloat16 24.55 ms; jax 0.11.2) with those programs compiled here for an H200
#: (experiments/gpu_estimate.py --calibrate; its results file gives each row's error). Errors:
#: -4.8 %, +4.5 %, -4.8 %. Bandwidth and attention shares are held at 0.80 and 0.45 (three rows
#: cannot pin four constants); the launch cost and the GEMM share are fitted. (Refitted when
#: gathers and scatters came to be read as the elements they index: 3.2 us and 0.59 before.)
RATES = Rates(launch=4.0e-6, memory=0.80, matmul=0.57, attention=0.45)

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
        out["note"] = NOTE
        return out

    def lines(self, top: int = 10) -> list[str]:
        out = [
            f"predicted step time on one {self.gpu}: {self.seconds * 1e3:.2f} ms, "
            f"{self.kernels} kernel launches ({self.launch_seconds * 1e3:.2f} ms of it launches)",
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
    "a model, not a measurement: per kernel max(bytes / bandwidth, FLOPs / peak) plus a launch, "
    "with constants fitted to measured H200 steps"
)


def _peak(gpu, dtype: str) -> float:
    return gpu.bf16_tflops * 1e12 * _PEAK_SHARE.get(dtype, 0.5)


def kernel_seconds(k: Kernel, gpu, rates: Rates = RATES) -> tuple[float, str]:
    """(seconds for one run of `k`, what bounds it)."""
    if k.kind == "collective":
        return rates.launch + k.collective_bytes / _NVLINK, "link"
    memory = k.bytes / (gpu.memory_bandwidth * rates.memory)
    share = rates.attention if k.kind == "attention" else rates.matmul
    compute = k.flops / (_peak(gpu, k.dtype) * share) if k.flops else 0.0
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
    program: Program, gpu, rates: Rates = RATES, top: int = 20, found_gemms=None
) -> Estimate:
    """The predicted step time of a compiled program on `gpu` (a `jamp.target.Gpu`);
    `found_gemms`: the program's `jamp.hlo.gemms`, where the caller has them already."""
    times = []
    by_kind: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    launches = 0
    for k in kernels(program, found_gemms):
        one, bound = kernel_seconds(k, gpu, rates)
        path, backward = op_name_path(k.op_name) if k.op_name else ("", False)
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


__all__ = ["NOTE", "RATES", "Estimate", "KernelTime", "Rates", "estimate", "kernel_seconds"]
