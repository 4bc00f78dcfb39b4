"""What a compiled program keeps in device memory, by dtype: XLA's buffer assignment, read.

XLA plans a program's memory before it runs: every value (HLO instruction result) gets an
offset in an allocation (a parameter, an output, or the one block of temporaries), and values
whose live ranges do not overlap share bytes. The plan is dumped as `*buffer-assignment.txt`
(allocations and their values) and `*live-range.txt` (each value's first and last step in the
program's order); from the two, `temp_peak` finds the moment the temporaries are fullest and
which dtypes fill them then, so a report can say "4 GiB of fp32 attention scores are kept for
the backward" instead of one number. It is XLA's plan for the target, not a measured peak.

Example::

  allocations = parse_buffer_assignment(files["...buffer-assignment.txt"])
  peak = temp_peak(allocations, parse_live_ranges(files["...live-range.txt"]))
  peak.by_class   # {"bf16": ..., "f32": ..., "workspace": ..., "free": ...}
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from jamp.hlo.text import _arrays

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+),(.*):\s*$")
_VALUE = re.compile(  # a loop-carried value reads `<12 while.3{0} (phi) @0>`
    r"^\s*value: <\d+ (?P<name>[^ >]+)(?: \(phi\))? @\d+> "
    r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<type>.*)$"
)
_SHAPE = re.compile(r"\bshape \|(?P<type>[^|]*)\|")
_RANGE = re.compile(r"^\s+(?P<name>[^\s:]+\{[\d,]*\}):(?P<start>\d+)-(?P<end>\d+)\s*$")

#: The classes live bytes are split into, in the order reports show them.
CLASSES = ("f32", "bf16", "f16", "fp8", "int", "workspace", "other", "free")


def dtype_class(dtype: str) -> str:
    """f32 / bf16 / f16 / fp8 / int / other for an HLO element type."""
    if dtype in ("f32", "bf16", "f16"):
        return dtype
    if dtype.startswith("f8"):
        return "fp8"
    if dtype == "pred" or re.fullmatch(r"[su]\d+", dtype):
        return "int"
    return "other"


@dataclasses.dataclass(frozen=True)
class Value:
    """One value of the buffer assignment: `name{index}`, its bytes and offset, its class."""

    name: str
    size: int
    offset: int
    cls: str


@dataclasses.dataclass(frozen=True)
class Allocation:
    index: int
    size: int
    kind: str  # "temp", "parameter", "output", "constant", "thread-local", "other"
    values: tuple[Value, ...]
    cls: str = "other"  # the dtype class of the shape it is allocated for (a parameter's)


def _kind(flags: str) -> str:
    if "preallocated-temp" in flags:
        return "temp"
    if "parameter" in flags:
        return "parameter"
    if "maybe-live-out" in flags or "output" in flags:
        return "output"
    if "constant" in flags:
        return "constant"
    if "thread-local" in flags:
        return "thread-local"
    return "other"


def _value_class(name: str, type_text: str) -> str:
    if type_text.startswith("("):
        return "other"  # a tuple's table of pointers
    arrays = _arrays(type_text)
    if not arrays:
        return "other"
    dtype = arrays[0][0]
    # A library call's scratch space: the second result of a cuBLAS / cuDNN custom call.
    if dtype == "s8" and re.search(r"\{[1-9]\d*\}$", name):
        return "workspace"
    return dtype_class(dtype)


def parse_buffer_assignment(text: str) -> list[Allocation]:
    """The allocations of a `*buffer-assignment.txt` dump, each with its values."""
    out: list[Allocation] = []
    current: Optional[Allocation] = None
    values: list[Value] = []
    for line in text.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            if current is not None:
                out.append(dataclasses.replace(current, values=tuple(values)))
            shape = _SHAPE.search(m.group(3))
            cls = _value_class("", shape.group("type")) if shape else "other"
            current = Allocation(int(m.group(1)), int(m.group(2)), _kind(m.group(3)), (), cls)
            values = []
            continue
        v = _VALUE.match(line)
        if v and current is not None:
            name = v.group("name")
            if "{" not in name:
                name += "{}"
            cls = _value_class(name, v.group("type"))
            values.append(Value(name, int(v.group("size")), int(v.group("offset")), cls))
        elif line and not line.startswith(" ") and current is not None:
            out.append(dataclasses.replace(current, values=tuple(values)))
            current, values = None, []
    if current is not None:
        out.append(dataclasses.replace(current, values=tuple(values)))
    return out


def parse_live_ranges(text: str) -> dict[str, tuple[int, int]]:
    """`name{index}` -> (first, last) step of each value in a `*live-range.txt` dump."""
    out, inside = {}, False
    for line in text.splitlines():
        if line.strip() == "BufferLiveRange:":
            inside = True
            continue
        if inside:
            m = _RANGE.match(line)
            if not m:
                if line.strip() and not line.startswith("    "):
                    break
                continue
            out[m.group("name")] = (int(m.group("start")), int(m.group("end")))
    return out


@dataclasses.dataclass(frozen=True)
class TempPeak:
    """The temporaries at their fullest: when (`step`), and their bytes by class (`by_class`,
    with "free" the allocation's bytes no value held then; the classes sum to `size`)."""

    step: int
    size: int
    by_class: dict[str, int]


def temp_peak(allocations: list[Allocation], ranges: dict[str, tuple[int, int]]) -> TempPeak:
    """The moment the temporaries hold the most live bytes, and those bytes by dtype class."""
    temps = [a for a in allocations if a.kind == "temp"]
    size = sum(a.size for a in temps)
    # Values that share bytes (an in-place update and its input) are one buffer: one interval
    # per run of overlapping live ranges at the same place.
    by_place: dict[tuple[int, int, int], list] = {}
    for a in temps:
        for v in a.values:
            if v.name in ranges:
                by_place.setdefault((a.index, v.offset, v.size), []).append(
                    (*ranges[v.name], v.cls)
                )
    intervals = []
    for (_, _, n), spans in by_place.items():
        spans.sort()
        start, end, classes = spans[0][0], spans[0][1], [spans[0][2]]
        for s0, e0, cls in spans[1:]:
            if s0 <= end:  # overlaps the run so far: the same buffer
                end = max(end, e0)
                classes.append(cls)
            else:
                intervals.append((start, end, n, classes))
                start, end, classes = s0, e0, [cls]
        intervals.append((start, end, n, classes))
    events = sorted(
        [(s, 0, n) for s, _, n, _ in intervals] + [(e + 1, -1, n) for _, e, n, _ in intervals]
    )
    live = best = 0
    best_step = 0
    for step, sign, n in events:
        live += n if sign == 0 else -n
        if live > best:
            best, best_step = live, step
    by_class = dict.fromkeys(CLASSES, 0)
    for s, e, n, classes in intervals:
        if s <= best_step <= e:
            # The buffer's class: its largest-footprint value's (all share the bytes).
            by_class[max(set(classes), key=classes.count)] += n
    by_class["free"] = max(0, size - sum(by_class.values()))
    return TempPeak(best_step, size, by_class)
