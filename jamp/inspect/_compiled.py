"""The GEMMs of a compiled program, read from its HLO text, and the dtypes they really run in.

A jaxpr says what was asked for; XLA decides what runs. On GPUs a matmul the jaxpr computes in
bf16 can still become a float32 GEMM (a GPU without bf16 tensor cores, a layout or fusion
XLA:GPU does not handle in bf16); the compiled HLO shows it. What a GEMM looks like there:

* a cuBLAS / cuBLASLt call: `custom-call(...)`, `custom_call_target="__cublas$gemm"`,
  `"__cublas$lt$matmul"` (fp8: `"__cublas$lt$matmul$f8"`), operands typed in the call;
* a Triton GEMM: a `fusion(...)`, `kind=kCustom`, whose called computation holds the `dot`;
* a plain `dot(...)` (CPUs, and the dot inside a Triton fusion);
* cuDNN convolutions: `custom_call_target="__cudnn$conv..."`.

Each instruction keeps the JAX name stack it came from in `metadata={op_name="..."}`, which
`jamp.inspect._paths.op_name_path` turns into a module path.

Example::

  text = jax.jit(step).lower(*args).compile().as_text()
  for gemm in compiled_gemms(text):
      print(gemm.kind, gemm.operands, gemm.result, gemm.op_name)
"""

from __future__ import annotations

import dataclasses
import re

_HEAD = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s(?P<op>[a-z][\w\-]*)\("
)
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[[0-9,]*\]")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_FUSION_KIND = re.compile(r'"kind"\s*:\s*"([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matrix multiplication or convolution of a compiled program."""

    name: str  # the HLO instruction
    kind: str  # "cublas", "cublasLt", "triton", "dot", "cudnn conv"
    operands: tuple[str, ...]  # dtypes of the two matrix operands, HLO spelling ("bf16", "f32")
    result: str  # dtype of the product
    op_name: str  # the JAX name stack it came from ("" when XLA kept none)

    @property
    def is_fp32(self) -> bool:
        """Whether a matrix operand is float32 (a float32 or TF32 GEMM, not a 16-bit one)."""
        return "f32" in self.operands or "f64" in self.operands


def _call_args(line: str, start: int) -> str:
    """The text between the parenthesis at `start - 1` and its match."""
    depth = 1
    for i in range(start, len(line)):
        if line[i] == "(":
            depth += 1
        elif line[i] == ")":
            depth -= 1
            if depth == 0:
                return line[start:i]
    return line[start:]


def _kind(op: str, line: str, triton_bodies: set[str], computation: str):
    """The GEMM kind of an instruction, or None if it is none."""
    if op == "dot":
        return "triton" if computation in triton_bodies else "dot"
    if op != "custom-call":
        return None
    target = _TARGET.search(line)
    target = target.group(1) if target else ""
    if target.startswith("__cublas$lt"):
        return "cublasLt"
    if target.startswith("__cublas"):
        return "cublas"
    if target.startswith("__cudnn$conv"):
        return "cudnn conv"
    return None


def _triton_bodies(lines) -> set[str]:
    """Names of the computations that Triton GEMM fusions call (their `dot` is the GEMM)."""
    bodies = set()
    for line in lines:
        if " fusion(" in line and "kind=kCustom" in line:
            kind, calls = _FUSION_KIND.search(line), _CALLS.search(line)
            if kind and calls and "gemm" in kind.group(1):
                bodies.add(calls.group(1))
    return bodies


def _operand_dtypes(args: str, types: dict[str, str]) -> list[str]:
    """The dtypes of a call's operands: printed with the operand (`bf16[8,16]{1,0} %a`, older
    XLA) or looked up by name (`%a`, newer XLA prints operands bare)."""
    out = []
    for operand in _split_args(args):
        typed = _ARRAY.search(operand)
        name = re.search(r"%([\w.\-]+)\s*$", operand)
        if typed:
            out.append(typed.group(1))
        elif name and name.group(1) in types:
            out.append(types[name.group(1)])
    return out


def _split_args(args: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(args):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(args[start:i].strip())
            start = i + 1
    parts.append(args[start:].strip())
    return [p for p in parts if p]


def compiled_gemms(hlo_text: str) -> list[Gemm]:
    """Every GEMM and convolution call in a compiled program's HLO text, in program order."""
    lines = hlo_text.splitlines()
    triton = _triton_bodies(lines)
    types = {}  # instruction -> the dtype of its result (the first array of a tuple)
    for line in lines:
        m = _HEAD.match(line)
        if m and _ARRAY.search(m.group("type")):
            types[m.group("name")] = _ARRAY.search(m.group("type")).group(1)
    out, computation = [], ""
    for line in lines:
        header = _COMPUTATION.match(line)
        if header and " = " not in line.split("(", 1)[0]:
            computation = header.group("name")
            continue
        m = _HEAD.match(line)
        if not m:
            continue
        kind = _kind(m.group("op"), line, triton, computation)
        if kind is None:
            continue
        operands = _operand_dtypes(_call_args(line, m.end()), types)[:2]
        result = _ARRAY.findall(m.group("type"))
        where = _OP_NAME.search(line)
        out.append(
            Gemm(
                name=m.group("name"),
                kind=kind,
                operands=tuple(operands),
                result=result[0] if result else "",
                op_name=where.group(1) if where else "",
            )
        )
    return out
