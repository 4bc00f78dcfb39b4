"""One reader of XLA's HLO text: the instructions of a program, with their types and operands.

Every HLO reading in jamp (the GEMMs of a compiled program, its collectives, the device-time
classes of `jamp.inspect.profile`, the GPU report of `jamp.compile_for`) starts here. A line of
HLO text reads::

  %name = TYPE op(OPERANDS), attribute=value, ..., metadata={op_name="jit(step)/..."}

TYPE is an array (`bf16[8,1024]{1,0}`) or a tuple of them (`(f32[512,128]{1,0}, s8[4194304]{0})`);
OPERANDS are `%names` (newer XLA) or typed (`bf16[8,16]{1,0} %a`, older XLA). Instructions live
in computations (`%fused_computation.3 (param_0: f32[8]) -> f32[8] {` ... `}`); the one marked
`ENTRY` is the program, the others are called by fusions, reductions, loops and conditionals.

Example::

  program = parse(compiled.as_text())
  for inst in program.instructions:
      print(inst.computation, inst.name, inst.op, inst.arrays, inst.op_name)
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Iterator, Optional

import numpy as np

#: Bytes per element, by HLO's spelling of the element type.
ITEMSIZE = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e8m0fnu": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
}

_HEAD = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+(?:\{[\d,]*\})?)\s*=\s*")
_COMPUTATION = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)(?:#(\d+))?\s*$")  # `%name`, `%tuple#1` (an element of it)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CALLS = re.compile(r"\bcalls=(?:\{([^}]*)\}|%?([\w.\-]+))")
_TO_APPLY = re.compile(r"\bto_apply=%?([\w.\-]+)")
_BODY = re.compile(r"\b(?:body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_FUSION_KIND = re.compile(r'"kind"\s*:\s*"([^"]+)"')
_HLO_KIND = re.compile(r"\bkind=(k\w+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction.

    Attributes:
      name: its name, without `%`.
      op: the opcode ("dot", "fusion", "custom-call", "all-gather-start", ...).
      arrays: the arrays of its result type, in order: (dtype, shape) pairs ("bf16", (8, 1024));
        one for an array, several for a tuple.
      operands: the names of its operands.
      operand_elements: per operand, the element of a tuple it takes (`%t#1`), else None.
      computation: the computation it belongs to.
      attributes: the text after its operand list (attributes, metadata, backend config).
      root: whether it is its computation's ROOT.
      args: the text of its operand list as written (a parameter's number, a constant's value).
    """

    name: str
    op: str
    arrays: tuple[tuple[str, tuple[int, ...]], ...]
    operands: tuple[str, ...]
    computation: str
    attributes: str
    operand_elements: tuple[Optional[int], ...] = ()
    root: bool = False
    args: str = ""

    @property
    def dtype(self) -> str:
        """The element type of its (first) result array ("" for a token or an empty tuple)."""
        return self.arrays[0][0] if self.arrays else ""

    @property
    def shape(self) -> tuple[int, ...]:
        return self.arrays[0][1] if self.arrays else ()

    @property
    def op_name(self) -> str:
        """The JAX name stack XLA kept for it ("" when none)."""
        m = _OP_NAME.search(self.attributes)
        return m.group(1) if m else ""

    @property
    def target(self) -> str:
        """A custom call's target ("__cublas$lt$matmul", ...); "" for other instructions."""
        m = _TARGET.search(self.attributes)
        return m.group(1) if m else ""

    @property
    def fusion_kind(self) -> str:
        """A fusion's kind: the backend's ("__triton_nested_gemm_fusion", "__cudnn$fusion") when
        it gives one, else HLO's ("kLoop", "kInput", "kOutput", "kCustom"); "" otherwise."""
        if self.op != "fusion":
            return ""
        m = _FUSION_KIND.search(self.attributes)
        if m:
            return m.group(1)
        m = _HLO_KIND.search(self.attributes)
        return m.group(1) if m else ""

    @property
    def calls(self) -> tuple[str, ...]:
        """The computations of its `calls=` attribute (a fusion's body, an async op's)."""
        out: list[str] = []
        for m in _CALLS.finditer(self.attributes):
            names = m.group(1) if m.group(1) is not None else m.group(2)
            out.extend(n.strip().lstrip("%") for n in names.split(",") if n.strip())
        return tuple(out)

    @property
    def called(self) -> tuple[str, ...]:
        """The computations it calls (a fusion's body, a reduction's combiner, loop bodies)."""
        out = list(self.calls)
        out.extend(m.group(1) for m in _TO_APPLY.finditer(self.attributes))
        out.extend(m.group(1) for m in _BODY.finditer(self.attributes))
        for m in _BRANCHES.finditer(self.attributes):
            out.extend(n.strip().lstrip("%") for n in m.group(1).split(",") if n.strip())
        return tuple(out)

    def attribute(self, key: str) -> Optional[str]:
        """The raw value of `key=...` (up to the next top-level comma), or None."""
        m = re.search(rf"\b{re.escape(key)}=", self.attributes)
        if not m:
            return None
        parts = split_top(self.attributes[m.end() :])
        return parts[0] if parts else ""

    @property
    def trip_count(self) -> Optional[int]:
        """A while loop's trip count where XLA knows it (its backend config), else None."""
        if self.op != "while":
            return None
        n = self.backend_config().get("known_trip_count", {}).get("n")
        return int(n) if n else None

    def backend_config(self) -> dict:
        """The instruction's backend config, parsed from JSON ({} when absent or unreadable)."""
        text = self.attribute("backend_config")
        if not text or not text.startswith("{"):
            return {}
        try:
            return json.loads(text)
        except ValueError:
            return {}

    @property
    def nbytes(self) -> int:
        """Bytes of its result (all arrays of a tuple)."""
        return sum(array_bytes(d, s) for d, s in self.arrays)


def array_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * ITEMSIZE.get(dtype, 4)


def _matching(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at `start`."""
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        elif ch == '"':  # strings (op names, JSON) may hold brackets
            end = text.find('"', i + 1)
            i = len(text) if end < 0 else end
        i += 1
    return len(text)


def split_top(args: str) -> list[str]:
    """`args` split at the commas outside brackets and strings."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(args):
        ch = args[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == '"':
            end = args.find('"', i + 1)
            i = len(args) if end < 0 else end
        elif ch == "," and depth == 0:
            parts.append(args[start:i].strip())
            start = i + 1
        i += 1
    parts.append(args[start:].strip())
    return [p for p in parts if p]


def _arrays(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_text)
    )


def parse_line(line: str, computation: str = "") -> Optional[Instruction]:
    """The instruction on one line of HLO text, or None if the line holds none."""
    head = _HEAD.match(line)
    if not head:
        return None
    i = head.end()
    if i < len(line) and line[i] == "(":  # a tuple type
        end = _matching(line, i)
    else:
        end = line.find(" ", i)
        end = len(line) if end < 0 else end
    type_text = line[i:end]
    rest = line[end:].lstrip()
    m = re.match(r"([a-z][\w\-]*)\(", rest)
    if not m:
        return None
    close = _matching(rest, m.end() - 1)
    args = rest[m.end() : close - 1]
    operands, elements = [], []
    for operand in split_top(rest[m.end() : close - 1]):
        named = _OPERAND.search(operand)
        if named:
            operands.append(named.group(1))
            elements.append(int(named.group(2)) if named.group(2) else None)
    return Instruction(
        name=head.group("name"),
        op=m.group(1),
        arrays=_arrays(type_text),
        operands=tuple(operands),
        computation=computation,
        attributes=rest[close:].strip().lstrip(", "),
        operand_elements=tuple(elements),
        root=bool(head.group("root")),
        args=args if m.group(1) in ("parameter", "constant") else "",
    )


@dataclasses.dataclass
class Program:
    """A parsed HLO module: its instructions in text order, by name, and by computation."""

    instructions: list[Instruction]
    entry: str
    by_name: dict[str, Instruction]
    computations: dict[str, list[Instruction]]

    def operand_arrays(self, inst: Instruction) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, shape) of each operand's (first) array, where the operand is known."""
        out = []
        for name in inst.operands:
            found = self.by_name.get(name)
            if found is not None and found.arrays:
                out.append(found.arrays[0])
        return out

    def users(self) -> dict[str, list[str]]:
        """name -> the names of the instructions that take it as an operand."""
        out: dict[str, list[str]] = {}
        for inst in self.instructions:
            for operand in inst.operands:
                out.setdefault(operand, []).append(inst.name)
        return out

    def body(self, inst: Instruction) -> Iterator[Instruction]:
        """The instructions of the computations `inst` calls, nested calls included."""
        seen, todo = set(), list(inst.called)
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for inner in self.computations.get(name, ()):
                yield inner
                todo.extend(inner.called)

    def multiplicity(self) -> dict[str, int]:
        """computation -> how many times one run of the program runs it: a while loop's body
        (a `lax.scan`'s: gradient accumulation, layers under scan) as often as its known trip
        count says, nested loops multiplied; 1 where XLA knows no trip count."""
        out = {self.entry: 1}
        todo = [self.entry]
        while todo:
            computation = todo.pop()
            for inst in self.computations.get(computation, ()):
                times = out[computation]
                if inst.op == "while":
                    times *= inst.trip_count or 1
                for name in inst.called:
                    if name not in out:
                        out[name] = times
                        todo.append(name)
        return out

    def callers(self) -> dict[str, Instruction]:
        """computation -> the instruction that calls it (the first, if several do)."""
        out: dict[str, Instruction] = {}
        for inst in self.instructions:
            for name in inst.called:
                out.setdefault(name, inst)
        return out


def parse(hlo_text: str) -> Program:
    """Every instruction of an HLO module's text (one module; the first ENTRY is its program)."""
    instructions: list[Instruction] = []
    computations: dict[str, list[Instruction]] = {}
    computation, entry = "", ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and " = " not in line.split("(", 1)[0]:
            computation = header.group("name")
            if header.group("entry") and not entry:
                entry = computation
            computations.setdefault(computation, [])
            continue
        inst = parse_line(line, computation)
        if inst is None:
            continue
        instructions.append(inst)
        computations.setdefault(computation, []).append(inst)
    by_name = {inst.name: inst for inst in instructions}
    return Program(instructions, entry, by_name, computations)
