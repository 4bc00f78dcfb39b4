"""What fp8 matmuls buy a compiled program, and what their scaling costs, by the step-time model.

An fp8 GEMM is faster than the same GEMM in bf16, but never by the 2x of the peaks
(`jamp.inspect.gemm_rate`: 1.45x at GPT-2 small's shapes, 1.86x at a 7B model's), and fp8 adds
work a bf16 step does not do: each operand's amax (a reduction over it, then over its blocks),
its cast to fp8 (a pass that writes the fp8 copy), copies of fp8 operands laid out for the
backward's GEMMs. `summary(program, gpu)` prices both from the program's own kernels: the fp8
GEMMs as they are and at bf16's rate for the same shapes, and the scaling kernels, found by
what they do (a kernel that writes fp8 values; a reduction of absolute values, or a scalar
maximum, as an amax is; a copy of fp8 values). Where the GEMMs save less than the scaling
costs, fp8 is predicted slower than bf16 for this program. A model of kernels, not a
measurement; compiling the same step under `mixed_bfloat16` compares whole programs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jamp.hlo.kernels import Kernel, kernels
from jamp.hlo.text import Program
from jamp.inspect import timing


@dataclasses.dataclass(frozen=True)
class Fp8Cost:
    """The fp8 GEMMs of a program and its fp8 scaling kernels, priced by `jamp.inspect.timing`."""

    gemms: int  # fp8 GEMM launches per step
    gemm_seconds: float  # their predicted time
    as_bf16_seconds: float  # the same GEMMs' at bf16's rate
    scaling: int  # scaling kernel launches per step (amax, casts to fp8, fp8 copies)
    scaling_seconds: float

    @property
    def saved_seconds(self) -> float:
        return self.as_bf16_seconds - self.gemm_seconds

    @property
    def slower(self) -> bool:
        """Whether the scaling costs more than the fp8 GEMMs save: fp8 slower than bf16."""
        return self.scaling_seconds > self.saved_seconds

    def lines(self) -> list[str]:
        ms = 1e3
        verdict = (
            "fp8 is predicted SLOWER than bf16 matmuls for this program"
            if self.slower
            else "fp8 is predicted faster than bf16 matmuls for this program"
        )
        speedup = self.as_bf16_seconds / self.gemm_seconds if self.gemm_seconds else 0.0
        return [
            f"fp8: {verdict}: its {self.gemms} fp8 GEMMs {self.gemm_seconds * ms:.2f} ms "
            f"({self.as_bf16_seconds * ms:.2f} in bf16 at the same shapes, {speedup:.2f}x), "
            f"saving {self.saved_seconds * ms:.2f} ms; its scaling (amaxes, casts to fp8, fp8 "
            f"copies: {self.scaling} kernels) {self.scaling_seconds * ms:.2f} ms",
            f"  ({timing.NOTE.split(':')[0]}; compile the step under mixed_bfloat16 to compare "
            "whole programs)",
        ]


def _is_scaling(program: Program, k: Kernel) -> bool:
    """A kernel of fp8's scaling: it writes fp8 values, or takes an amax, or copies fp8 values."""
    inst = program.by_name[k.name]
    if k.kind == "gemm" or k.kind == "attention":
        return False
    if any(d.startswith("f8") for d, _ in inst.arrays):
        return True
    if k.kind == "copy":
        return any(d.startswith("f8") for d, _ in program.operand_arrays(inst))
    if k.kind != "reduction":
        return False
    body = list(program.body(inst)) if inst.op == "fusion" else [inst]
    ops = {i.op for i in body}
    scalar = bool(inst.arrays) and all(len(shape) == 0 for _, shape in inst.arrays)
    return "reduce" in ops and ("abs" in ops or (scalar and "maximum" in ops))


def summary(program: Program, gpu, rates: timing.Rates = timing.RATES) -> Optional[Fp8Cost]:
    """The program's `Fp8Cost`, or None where it runs no fp8 GEMM."""
    gemms = scaling = 0
    fp8 = as_bf16 = cost = 0.0
    for k in kernels(program):
        seconds = timing.kernel_seconds(k, gpu, rates)[0] * k.count
        if k.kind == "gemm" and k.dtype == "f8":
            gemms += k.count
            fp8 += seconds
            bf16 = dataclasses.replace(k, dtype="bf16")
            as_bf16 += timing.kernel_seconds(bf16, gpu, rates)[0] * k.count
        elif _is_scaling(program, k):
            scaling += k.count
            cost += seconds
    if not gemms:
        return None
    return Fp8Cost(gemms, fp8, as_bf16, scaling, cost)


__all__ = ["Fp8Cost", "summary"]
