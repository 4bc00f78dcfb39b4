"""The kernels a compiled GPU program launches, with the bytes each moves and the FLOPs it does.

On a GPU each top-level instruction of the optimized program that does work is one kernel (or
one library call): a fusion, a cuBLAS / cuDNN custom call, a copy, a collective. They run in the
entry computation's order, a loop body's as often as its trip count. For each one this reads:

* its kind (`KINDS`): "gemm" (a GEMM fusion, a cuBLAS call, a convolution), "attention" (cuDNN's
  fused attention), "reduction" (XLA's input fusions, whose root reduces), "elementwise" (loop
  fusions), "transpose", "scatter", "copy", "collective", or "other";
* the bytes it reads and writes: its operands and results, where a fusion reads only slices of
  an operand the slices, where it gathers from one (a label's logit, an embedding's rows) each
  index's slice in whole 32-byte sectors, and an in-place update (a dynamic-update-slice root:
  a scan's carry; a scatter: an embedding's gradient) only the elements it updates;
* the FLOPs of its matrix units (GEMMs, convolutions, attention's two or five GEMMs; causal
  attention counts half) and the dtype they run in ("bf16", "f16", "f8", "f32": TF32 on a GPU).

Example::

    for k in kernels(parse(compiled.as_text())):
        print(k.kind, k.name, k.bytes, k.flops, k.dtype, k.count, k.op_name)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np

from jamp.hlo.gemms import Gemm, gemms
from jamp.hlo.text import ITEMSIZE, Instruction, Program, array_bytes

KINDS = (
    "gemm",
    "attention",
    "reduction",
    "elementwise",
    "transpose",
    "scatter",
    "copy",
    "collective",
    "other",
)
# Instructions that launch nothing: values, views, control (their bodies are read apart).
_NO_KERNEL = frozenset(
    {
        "parameter",
        "constant",
        "tuple",
        "get-tuple-element",
        "bitcast",
        "while",
        "call",
        "conditional",
        "after-all",
        "add-dependency",
        "opt-barrier",
        "partition-id",
        "replica-id",
        "domain",
    }
)
#: HLO's collective opcodes (an async one's `-start` names its kind).
COLLECTIVE_OPS = frozenset(
    {
        "all-gather",
        "all-reduce",
        "reduce-scatter",
        "all-to-all",
        "ragged-all-to-all",
        "collective-permute",
        "collective-broadcast",
        "send",
        "recv",
    }
)
_SLICES = frozenset({"slice", "dynamic-slice"})
_VIEWS = frozenset({"bitcast", "reshape"})
_SLICE_SIZES = re.compile(r"slice_sizes=\{([^}]*)\}")
_SECTOR = 32  # bytes: the unit a GPU reads memory in
# Control flow whose called computations run as kernel sequences of their own.
_CONTROL = frozenset({"while", "call", "conditional"})


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel launch (or library call) of a compiled program, per run of its computation."""

    name: str  # the HLO instruction
    kind: str  # one of KINDS
    detail: str  # the fusion kind, custom-call target or opcode
    op_name: str  # the JAX name stack it came from ("" when XLA kept none)
    bytes: int  # read + written
    flops: int  # of matrix units (GEMMs, attention); 0 for other kernels
    dtype: str  # what the matrix units multiply ("bf16", "f32", ...); "" for other kernels
    count: int = 1  # runs per run of the program
    collective_bytes: int = 0  # a collective's result bytes on one device
    gemm_shape: tuple[int, int, int, int] = (0, 0, 0, 0)  # a GEMM's (batch, M, N, K): `Gemm`


def _dtype_class(operands: tuple[str, ...]) -> str:
    if any(d in ("f32", "f64") for d in operands):
        return "f32"
    if any(d.startswith("f8") for d in operands):
        return "f8"
    if "f16" in operands:
        return "f16"
    if "bf16" in operands:
        return "bf16"
    return operands[0] if operands else ""


def _attention_flops(program: Program, inst: Instruction) -> int:
    """2 GEMMs forward (scores, mix), 5 backward (recompute scores, dP, dQ, dK, dV); causal masks
    skip half of each, sliding windows all but the window's keys. From the scores' shape
    [B, H, Lq, Lk] and the head size."""
    config = inst.backend_config().get("cudnn_fmha_backend_config", {})
    scores = config.get("intermediate_tensor_shape", {}).get("dimensions", [])
    operands = program.operand_arrays(inst)
    if len(scores) != 4 or not operands:
        return 0
    head = operands[0][1][-1] if operands[0][1] else 0
    one = 2 * int(np.prod([int(d) for d in scores], dtype=np.int64)) * int(head)
    gemms = 5 if "Backward" in inst.target else 2
    causal = 0.5 if "CAUSAL" in str(config.get("mask_type", "")) else 1.0
    window = int(config.get("sliding_window_length", 0) or 0)
    t, s = int(scores[2]), int(scores[3])
    if window and causal < 1.0 and 0 < window < t:  # each query sees `window` keys at most
        causal = (window * (window + 1) / 2 + (t - window) * window) / (t * s)
    return int(one * gemms * causal)


def attention_mask(inst: Instruction) -> Optional[str]:
    """A cuDNN fused attention call's mask as cuDNN runs it: "causal" (half of the scores
    skipped), "none" (every score computed), with ", window W" where each query sees W keys at
    most (a sliding window) and " + bias" where it reads an additive bias;
    None for any other instruction (a backward call included: it runs its forward's mask)."""
    if inst.op != "custom-call" or not inst.target.startswith("__cudnn$fmha"):
        return None
    if "Backward" in inst.target:
        return None
    config = inst.backend_config().get("cudnn_fmha_backend_config", {})
    mask = str(config.get("mask_type", "?")).lower().replace("no_mask", "none")
    window = int(config.get("sliding_window_length", 0) or 0)
    mask += f", window {window}" if window else ""
    return mask + (" + bias" if "Bias" in inst.target else "")


def _body(program: Program, inst: Instruction) -> list[Instruction]:
    return [i for name in inst.calls for i in program.computations.get(name, ())]


def _gathered_bytes(gather: Instruction, itemsize: int) -> int:
    """What a gather reads of its operand: each index's slice, in whole 32-byte sectors (the
    GPU's memory transaction), in the operand's element size."""
    m = _SLICE_SIZES.search(gather.attributes)
    per = max(int(np.prod([int(d) for d in m.group(1).split(",") if d.strip()])) if m else 1, 1)
    indices = _elements(gather) // per
    return indices * -(-per * itemsize // _SECTOR) * _SECTOR


def _elements(inst: Instruction) -> int:
    return int(np.prod(inst.shape, dtype=np.int64))


def _scatter_update(inst: Instruction, by_name: dict) -> Optional[Instruction]:
    """The updates of a scatter into one array (which it updates in place), else None."""
    if inst.op != "scatter" or len(inst.operands) != 3:
        return None
    target = by_name.get(inst.operands[0])
    while target is not None and target.op in _VIEWS and target.operands:
        target = by_name.get(target.operands[0])
    if target is None or target.op != "parameter":  # a computed target is written whole
        return None
    return by_name.get(inst.operands[2])


def _param_reads(body: list[Instruction]) -> dict[int, Optional[int]]:
    """Per parameter number of a fused computation, the bytes it reads of that operand where it
    reads less than all of it (slices and gathers, also of its converted values; 0 for the
    buffer a dynamic-update-slice writes into, the updated elements of a scatter's), else None."""
    users: dict[str, list[Instruction]] = {}
    for i in body:
        for operand in i.operands:
            users.setdefault(operand, []).append(i)
    by_name = {i.name: i for i in body}
    out: dict[int, Optional[int]] = {}
    for param in body:
        if param.op != "parameter" or not param.args.strip().isdigit():
            continue
        itemsize = ITEMSIZE.get(param.dtype, 4)
        reads: list[int] = []
        todo, partial = [param.name], True
        while todo and partial:
            name = todo.pop()
            for user in users.get(name, ()):
                if user.op in _VIEWS or (user.op == "convert" and len(user.operands) == 1):
                    todo.append(user.name)
                elif user.op in _SLICES and user.operands[:1] == (name,):
                    reads.append(_elements(user) * itemsize)
                elif user.op == "gather" and user.operands[:1] == (name,):
                    reads.append(_gathered_bytes(user, itemsize))
                elif user.op == "dynamic-update-slice" and user.operands[:1] == (name,):
                    reads.append(0)
                elif (
                    user.operands[:1] == (name,)
                    and (update := _scatter_update(user, by_name)) is not None
                ):  # in place: what it reads of its target is the elements it updates
                    reads.append(_elements(update) * itemsize)
                else:
                    partial = False
                    break
        out[int(param.args)] = sum(reads) if partial and reads else None
    return out


def _written(body: list[Instruction], result_bytes: int) -> int:
    """Bytes a fusion writes: its results, but only the update of an in-place update (a
    dynamic-update-slice's or a scatter's)."""
    by_name = {i.name: i for i in body}
    root = next((i for i in body if i.root), None)
    if root is None:
        return result_bytes
    roots = [by_name[o] for o in root.operands if o in by_name] if root.op == "tuple" else [root]
    total = 0
    for r in roots:
        while r.op in _VIEWS and r.operands and r.operands[0] in by_name:
            r = by_name[r.operands[0]]
        if r.op == "dynamic-update-slice" and len(r.operands) > 1 and r.operands[1] in by_name:
            total += by_name[r.operands[1]].nbytes
        elif (update := _scatter_update(r, by_name)) is not None:
            total += _elements(update) * ITEMSIZE.get(r.dtype, 4)
        else:
            total += r.nbytes
    return total


def _fusion_bytes(program: Program, inst: Instruction) -> int:
    body = _body(program, inst)
    reads = _param_reads(body)
    total = 0
    for number, name in enumerate(inst.operands):
        operand = program.by_name.get(name)
        if operand is None:
            continue
        partial = reads.get(number)
        total += operand.nbytes if partial is None else partial
    return total + _written(body, inst.nbytes)


def _plain_bytes(program: Program, inst: Instruction) -> int:
    operands = sum(
        array_bytes(d, s) for d, s in (program.operand_arrays(inst) if inst.operands else ())
    )
    return operands + inst.nbytes


def _kind(inst: Instruction, gemm: Optional[Gemm]) -> tuple[str, str]:
    op = inst.op
    if gemm is not None:
        return "gemm", gemm.kind
    if op == "custom-call":
        target = inst.target
        if target.startswith("__cudnn$fmha"):
            return "attention", target
        return "other", target
    base = op.removesuffix("-start")
    if base in COLLECTIVE_OPS or op.startswith("async"):
        return "collective", op
    if op == "fusion":
        kind = inst.fusion_kind
        if kind == "kInput":
            return "reduction", kind
        if kind == "kLoop":
            return "elementwise", kind
        if "transpose" in inst.name:
            return "transpose", kind
        if "scatter" in inst.name:
            return "scatter", kind
        return "other", kind
    if op in ("copy", "copy-start"):
        return "copy", op
    if op == "transpose":
        return "transpose", op
    if op in ("scatter", "select-and-scatter"):
        return "scatter", op
    if op == "reduce":
        return "reduction", op
    return "other", op


def _inner_gemm(program: Program, inst: Instruction, by_gemm: dict) -> Optional[Gemm]:
    """The library GEMM a fusion wraps, where XLA put one inside (a "dynamic slice fusion":
    cuBLAS reading a slice of its operand in place, one launch)."""
    return next((by_gemm[i.name] for i in _body(program, inst) if i.name in by_gemm), None)


def _skipped_condition(inst: Instruction) -> Optional[str]:
    """The condition of a while loop whose trip count XLA knows: the GPU runtime then runs the
    body that many times and never the condition (its kernels launch not at all)."""
    if inst.trip_count is None:
        return None
    name = inst.attribute("condition")
    return name.lstrip("%") if name else None


def _kernel_computations(program: Program) -> dict[str, int]:
    """The computations whose instructions launch kernels (the entry, loop bodies, the
    conditions of loops of unknown trip count, called computations, conditional branches), with
    their runs per program run."""
    times = program.multiplicity()
    out = {program.entry: 1}
    todo = [program.entry]
    while todo:
        computation = todo.pop()
        for inst in program.computations.get(computation, ()):
            if inst.op in _CONTROL:
                skipped = _skipped_condition(inst)
                for name in inst.called:
                    if name not in out and name != skipped:
                        out[name] = times.get(name, 1)
                        todo.append(name)
    return out


def kernels(program: Program, found_gemms: Optional[list[Gemm]] = None) -> list[Kernel]:
    """Every kernel launch of a compiled program, in program order (a loop body's once, with its
    `count`). A conditional's branches are all listed, as if each ran. `found_gemms`: the
    program's `gemms(program)`, where the caller has them already."""
    by_gemm = {g.name: g for g in (gemms(program) if found_gemms is None else found_gemms)}
    found = []
    for computation, times in _kernel_computations(program).items():
        for inst in program.computations.get(computation, ()):
            if inst.op in _NO_KERNEL or inst.op.endswith("-done"):
                continue
            gemm = by_gemm.get(inst.name)
            if gemm is None and inst.op == "fusion":
                gemm = _inner_gemm(program, inst, by_gemm)
            kind, detail = _kind(inst, gemm)
            flops, dtype = 0, ""
            if gemm is not None:
                flops, dtype = gemm.flops, _dtype_class(gemm.operands)
            elif kind == "attention":
                flops = _attention_flops(program, inst)
                dtype = _dtype_class(tuple(d for d, _ in program.operand_arrays(inst)[:1]))
            nbytes = (
                _fusion_bytes(program, inst) if inst.op == "fusion" else _plain_bytes(program, inst)
            )
            found.append(
                Kernel(
                    inst.name,
                    kind,
                    detail,
                    inst.op_name or (gemm.op_name if gemm is not None else ""),
                    nbytes,
                    flops,
                    dtype,
                    times,
                    inst.nbytes if kind == "collective" else 0,
                    gemm.shape if gemm is not None else (0, 0, 0, 0),
                )
            )
    return found


def shared_results(program: Program, scope: str) -> list[str]:
    """The elementwise kernels (loop fusions, transposes, copies) whose results are read both by
    a kernel of name scope `scope` and by another kernel: what XLA wrote out because two kernels
    read it, where one reader alone would have fused it in. E.g. with `jamp.grad_stats.SCOPE`,
    the gradients that the finite check reads beside the update."""
    found = kernels(program)
    kernel_names = {k.name for k in found}
    movable = {k.name for k in found if k.kind in ("elementwise", "transpose", "copy")}
    readers: dict[str, set[str]] = {}
    for inst in program.instructions:
        if inst.name not in kernel_names:
            continue
        for operand in inst.operands:
            source = _through_views(program, operand)
            if source in kernel_names:
                readers.setdefault(source, set()).add(inst.name)
    out = []
    for source, names in readers.items():
        scoped = {n for n in names if f"/{scope}/" in program.by_name[n].op_name}
        if scoped and names - scoped and source in movable:
            out.append(source)
    return sorted(out)


def ends_in_reduction(program: Program, name: str) -> bool:
    """Whether kernel `name`'s computation reduces: a split-K GEMM's sum of its partial products,
    a two-row bias sum. XLA:GPU fuses such a kernel into an elementwise reader (an optimizer's
    update) but not into another reduction's input (a finite check's): 54 of the 55
    `shared_results` of GPT-2 small's step on the H200 program reduce, and stayed written out
    with the check's reduction written three ways."""
    inst = program.by_name.get(name)
    return inst is not None and (
        inst.op == "reduce" or any(i.op == "reduce" for i in program.body(inst))
    )


def _through_views(program: Program, name: str) -> str:
    """The instruction a value comes from, looking through bitcasts and tuple elements."""
    seen = 0
    inst = program.by_name.get(name)
    while inst is not None and inst.op in ("bitcast", "get-tuple-element") and seen < 16:
        name = inst.operands[0] if inst.operands else name
        inst = program.by_name.get(name)
        seen += 1
    return name


__all__ = [
    "COLLECTIVE_OPS",
    "KINDS",
    "Kernel",
    "attention_mask",
    "ends_in_reduction",
    "kernels",
    "shared_results",
]
