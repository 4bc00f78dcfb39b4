"""The GEMMs of a compiled program, read from its HLO text, and the dtypes they really run in.

A jaxpr says what was asked for; XLA decides what runs. On GPUs a matmul the jaxpr computes in
bf16 can still become a float32 GEMM (a layout or fusion XLA:GPU does not handle in bf16, or
operands converted inside the GEMM's fusion); the compiled HLO shows it. A GEMM there is:

* a cuBLAS / cuBLASLt call: `custom-call`, `custom_call_target="__cublas$gemm"`,
  `"__cublas$lt$matmul"`, fp8: `"__cublas$lt$matmul$f8"`, its dimensions in the backend config;
* a Triton or cuDNN GEMM fusion: a `fusion` whose backend kind names it
  (`__triton_gemm`, `__triton_nested_gemm_fusion`, `__cudnn$fusion`), the `dot` in its body;
* a plain `dot` (CPUs; a dot inside an ordinary fusion);
* a convolution: `custom_call_target="__cudnn$conv..."` on GPUs, `convolution` elsewhere.

The operand dtypes are those the GEMM multiplies: for a fusion, those of the `dot` inside it
(a bf16 parameter converted to f32 inside a Triton fusion is an f32 GEMM).

Example::

  for gemm in gemms(parse(compiled.as_text())):
      print(gemm.kind, gemm.operands, gemm.flops, gemm.op_name)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np

from jamp.hlo.text import Instruction, Program

#: Kernel families, as `Gemm.kind` spells them.
KINDS = ("cuBLAS", "cuBLASLt", "cuBLASLt fp8", "Triton", "cuDNN", "cuDNN conv", "dot", "conv")
_DIMS = re.compile(r"\b(lhs_contracting_dims|lhs_batch_dims)=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"\bdim_labels=(\w+)_(\w+)->(\w+)")


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matrix multiplication or convolution of a compiled program."""

    name: str  # the HLO instruction
    kind: str  # one of KINDS
    operands: tuple[str, ...]  # dtypes of the two multiplied operands, HLO spelling ("bf16")
    result: str  # dtype of the product
    op_name: str  # the JAX name stack it came from ("" when XLA kept none)
    flops: int = 0  # 2 x multiply-adds, for one call; 0 where jamp cannot tell
    batched: bool = False  # a batched matmul (batch dimensions: attention's scores and mix)
    accumulates: str = ""  # a fusion's dot's own result dtype (what it sums in); else `result`
    count: int = 1  # runs per run of the program (inside a loop: its trip count)
    # (batch, M, N, K) of one call: the batch's extent, the result's rows (the lhs's free axes)
    # and columns, the contracted extent; a convolution's as the GEMM it is (M: output positions,
    # N: output features, K: window x input features); zeros where jamp cannot tell
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def is_fp32(self) -> bool:
        """Whether a multiplied operand is float32 (a float32 or TF32 GEMM, not a 16-bit one)."""
        return "f32" in self.operands or "f64" in self.operands


def _prod(sizes) -> int:
    return int(np.prod(list(sizes), dtype=np.int64))


def _shape(program: Program, inst: Instruction, contracting, batch, result) -> tuple:
    """(batch, M, N, K) of a GEMM `inst` from its lhs's contracting and batch axes and its
    result's shape ([batch..., lhs free..., rhs free...])."""
    arrays = program.operand_arrays(inst)
    if not arrays or not result:
        return (0, 0, 0, 0)
    lhs = arrays[0][1]
    k = _prod(lhs[d] for d in contracting if d < len(lhs))
    b = _prod(lhs[d] for d in batch if d < len(lhs))
    m = _prod(n for d, n in enumerate(lhs) if d not in contracting and d not in batch)
    total = _prod(result)
    return (b, m, total // max(1, b * m), k)


def _gemm_dims(program: Program, inst: Instruction, contracting, batch) -> tuple[int, bool, tuple]:
    """(FLOPs: 2 x result elements x contracted extent, whether batched, (batch, M, N, K))."""
    shape = _shape(program, inst, contracting, batch, inst.shape)
    return 2 * _prod(shape), bool(batch), shape


def _dot_flops(program: Program, dot: Instruction) -> tuple[int, bool, tuple]:
    dims = dict(_DIMS.findall(dot.attributes))
    contracting = [int(d) for d in dims.get("lhs_contracting_dims", "").split(",") if d]
    batch = [int(d) for d in dims.get("lhs_batch_dims", "").split(",") if d]
    return _gemm_dims(program, dot, contracting, batch)


def _custom_gemm_flops(program: Program, inst: Instruction) -> tuple[int, bool, tuple]:
    dims = inst.backend_config().get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    contracting = [int(d) for d in dims.get("lhs_contracting_dimensions", [])]
    batch = [int(d) for d in dims.get("lhs_batch_dimensions", [])]
    return _gemm_dims(program, inst, contracting, batch)


def _conv_flops(program: Program, inst: Instruction) -> tuple[int, tuple]:
    """(2 x (forward output elements) x (kernel elements per output feature), the implicit
    GEMM's (1, M, N, K)): the same count for a convolution and both of its transposes (cuDNN's
    backward-input / backward-filter calls)."""
    labels = _DIM_LABELS.search(inst.attributes)
    arrays = program.operand_arrays(inst)
    if not labels or len(arrays) < 2 or not inst.arrays:
        return 0, (0, 0, 0, 0)
    kernel_labels = labels.group(2)
    target = inst.target
    if "BackwardFilter" in target:
        output, kernel = arrays[1][1], inst.shape
    elif "BackwardInput" in target:
        output, kernel = arrays[0][1], arrays[1][1]
    else:
        output, kernel = inst.shape, arrays[1][1]
    if "o" not in kernel_labels or len(kernel) != len(kernel_labels):
        return 0, (0, 0, 0, 0)
    features = max(1, kernel[kernel_labels.index("o")])
    per_output = _prod(kernel) // features
    positions = _prod(output) // features
    return 2 * _prod(output) * per_output, (1, positions, features, per_output)


def _kind(inst: Instruction) -> Optional[str]:
    if inst.op == "custom-call":
        target = inst.target
        if target.startswith("__cublas$lt$matmul$f8"):
            return "cuBLASLt fp8"
        if target.startswith("__cublas$lt"):
            return "cuBLASLt"
        if target.startswith("__cublas"):
            return "cuBLAS"
        if target.startswith("__cudnn$conv"):
            return "cuDNN conv"
        return None
    if inst.op == "fusion":
        kind = inst.fusion_kind
        if "triton" in kind and "gemm" in kind:
            return "Triton"
        if kind.startswith("__cudnn"):
            return "cuDNN"
    return None


def gemms(program: Program) -> list[Gemm]:
    """Every GEMM and convolution call of a compiled program, in program order.

    A dot inside a GEMM fusion is counted once, as that fusion; a dot inside an ordinary fusion
    (XLA fuses small ones) or outside any fusion is a "dot"."""
    in_gemm_fusion: set[str] = set()
    found: list[Gemm] = []
    for inst in program.instructions:
        kind = _kind(inst)
        if kind in ("Triton", "cuDNN"):
            dot = next((i for i in program.body(inst) if i.op == "dot"), None)
            in_gemm_fusion.update(i.name for i in program.body(inst))
            if dot is None:
                continue
            flops, batched, shape = _dot_flops(program, dot)
            operands = tuple(d for d, _ in program.operand_arrays(dot))[:2]
            found.append(
                Gemm(
                    inst.name,
                    kind,
                    operands,
                    inst.dtype,
                    inst.op_name or dot.op_name,
                    flops,
                    batched,
                    dot.dtype,
                    shape=shape,
                )
            )
        elif kind == "cuDNN conv":
            operands = tuple(d for d, _ in program.operand_arrays(inst))[:2]
            flops, shape = _conv_flops(program, inst)
            found.append(
                Gemm(inst.name, kind, operands, inst.dtype, inst.op_name, flops, shape=shape)
            )
        elif kind is not None:
            flops, batched, shape = _custom_gemm_flops(program, inst)
            operands = tuple(d for d, _ in program.operand_arrays(inst))[:2]
            found.append(
                Gemm(
                    inst.name, kind, operands, inst.dtype, inst.op_name, flops, batched, shape=shape
                )
            )
    for inst in program.instructions:  # dots and convolutions XLA left as they are
        if inst.name in in_gemm_fusion or inst.op not in ("dot", "convolution"):
            continue
        operands = tuple(d for d, _ in program.operand_arrays(inst))[:2]
        if inst.op == "dot":
            flops, batched, shape = _dot_flops(program, inst)
            found.append(
                Gemm(
                    inst.name,
                    "dot",
                    operands,
                    inst.dtype,
                    inst.op_name,
                    flops,
                    batched,
                    shape=shape,
                )
            )
        else:
            found.append(Gemm(inst.name, "conv", operands, inst.dtype, inst.op_name))
    order = {inst.name: i for i, inst in enumerate(program.instructions)}
    times = program.multiplicity()
    found = [
        dataclasses.replace(
            g,
            accumulates=g.accumulates or g.result,
            count=times.get(program.by_name[g.name].computation, 1),
        )
        for g in found
    ]
    return sorted(found, key=lambda g: order.get(g.name, 0))
