"""The collectives of a partitioned program: kind, dtype, bytes, and the mesh axes they span.

Where a value crosses devices, and in which dtype, is decided by XLA's SPMD partitioner; what
follows is backend-specific. XLA:CPU, for one, widens every 16-bit collective to float32 after
partitioning (its float normalization), so the final CPU program would say float32 where the
partitioned one, the one XLA:GPU runs as it is, moves bf16. `partitioned_hlo` gives the program
right after partitioning, on any backend; a GPU program compiled for a target
(`jamp.compile_for`) can be read as it is.

Example::

    text = partitioned_hlo(step, state, batch, key)   # a jitted function and its arguments
    for c in collectives(text):
        print(c.kind, c.dtype, c.shape, c.nbytes, c.op_name)
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from typing import Optional, Sequence

import numpy as np

from jamp.hlo import dump
from jamp.hlo.text import Program, array_bytes, parse

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_MATMULS = ("dot", "convolution")
# Operations that move or re-type a value without combining it with another: a gather feeding
# a matmul through these still feeds that matmul.
_PASS_THROUGH = frozenset(
    {
        "bitcast",
        "reshape",
        "transpose",
        "copy",
        "convert",
        "tuple",
        "get-tuple-element",
        "opt-barrier",
        "slice",
        "dynamic-slice",
        "all-gather-done",
        "all-reduce-done",
        "collective-permute-done",
    }
)
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# The device ids of a named mesh: listed (0,4,1,5,...) or, from JAX 0.10.2's XLA, as an iota
# ([2,4]T(1,0): 0..7 laid out [2,4], transposed (1,0), read row-major).
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]*)\))?\s*\{([^}]*)\}"
)
_IOTA_IDS = re.compile(r"\[([\d,]+)\](?:T\(([\d,]+)\))?")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a partitioned program (a tuple-shaped one is split into its parts)."""

    kind: str  # "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"
    dtype: str  # HLO's spelling: "bf16", "f32", ...
    shape: tuple[int, ...]  # of the result, per device
    op_name: str  # the JAX name stack it came from (where XLA kept none: its sources', or "")
    into_matmul: bool = False  # its result is an operand of a dot / convolution (e.g. a weight)
    from_matmul: bool = False  # its operand is a dot's / convolution's result (e.g. a weight grad)
    groups: Optional[tuple[tuple[int, ...], ...]] = None  # device groups (positions), if given
    count: int = 1  # runs per run of the program (inside a loop: its trip count)

    @property
    def nbytes(self) -> int:
        """Bytes of the result on one device."""
        return array_bytes(self.dtype, self.shape)


def partitioned_hlo(jitted, *args, **kwargs) -> str:
    """The HLO text of `jitted(*args, **kwargs)` right after XLA's SPMD partitioning.

    Compiles the program once more (nothing is run), with XLA dumping that one pass; JAX's
    persistent compilation cache is off meanwhile (see `jamp.hlo.dump`).
    """
    lowered = jitted.lower(*args, **kwargs)
    _, files = dump.compile_dumped(
        lowered, {"xla_dump_hlo_pass_re": "spmd-partitioning"}, keep=("spmd-partitioning",)
    )
    found = [text for name, text in sorted(files.items()) if "after_spmd-partitioning" in name]
    if not found:
        raise RuntimeError(
            "XLA wrote no partitioned program (no sharding to partition, or this XLA names "
            "the pass differently)"
        )
    return found[-1]


def _axis_groups(
    sizes: Sequence[int], subset: Sequence[int], device_ids: Optional[Sequence[int]] = None
) -> tuple[tuple[int, ...], ...]:
    """The device groups that vary over the axes `subset` of a mesh whose devices, row-major,
    are `device_ids` (by default their positions 0, 1, ...)."""
    if device_ids is None:
        device_ids = range(int(np.prod(sizes)))
    ids = np.asarray(device_ids).reshape(sizes)
    rest = [i for i in range(len(sizes)) if i not in subset]
    size = int(np.prod([sizes[i] for i in subset]))
    rows = ids.transpose(rest + list(subset)).reshape(-1, size)
    return tuple(tuple(int(i) for i in row) for row in rows)


def _device_ids(text: str) -> list[int]:
    """A named mesh's device ids, row-major: listed (0,4,1,5) or an iota ([2,4]T(1,0))."""
    m = _IOTA_IDS.fullmatch(text.strip())
    if not m:
        return [int(d) for d in re.findall(r"\d+", text)]
    dims = [int(d) for d in m.group(1).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(2):
        ids = ids.transpose([int(d) for d in m.group(2).split(",")])
    return [int(i) for i in ids.reshape(-1)]


def replica_groups(attributes: str) -> Optional[tuple[tuple[int, ...], ...]]:
    """The device groups of a collective's `replica_groups=` ({{0,1},{2,3}}, the iota form
    [2,2]<=[4] / [2,4]<=[4,2]T(1,0), or the named form mesh['data'=2,'fsdp'=4] {'fsdp'}, its
    devices in order, listed or an iota: mesh['axis_0'=4,'axis_1'=2], device_ids=(0,4,1,5,...)
    {'axis_0'} or device_ids=([2,4]T(1,0)), as JAX 0.10's XLA writes it); None when it has
    none."""
    m = _GROUPS_MESH.search(attributes)
    if m:
        axes = re.findall(r"'?(\w+)'?\s*=\s*(\d+)", m.group(1))
        names = [n for n, _ in axes]
        chosen = re.findall(r"'?(\w+)'?", m.group(3))
        subset = [names.index(n) for n in chosen if n in names]
        listed = _device_ids(m.group(2)) if m.group(2) else None
        return _axis_groups([int(s) for _, s in axes], subset, listed)
    m = _GROUPS_IOTA.search(attributes)
    if m:
        shape = [int(d) for d in m.group(1).split(",")]
        dims = [int(d) for d in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))
    m = _GROUPS_LIST.search(attributes)
    if m and not m.group(1):
        return ()  # replica_groups={}: one group of every device
    if m:
        groups = re.findall(r"\{([\d,]*)\}", m.group(1))
        return tuple(tuple(int(i) for i in g.split(",") if i) for g in groups)
    return None


def mesh_axes(
    groups: Optional[Sequence[Sequence[int]]], axis_sizes: Sequence[tuple[str, int]]
) -> tuple[str, ...]:
    """The mesh axes a collective's device groups span, devices numbered in the mesh's order
    (row-major over `axis_sizes`, as `Mesh.devices.flat`). () where the groups match no set of
    axes or are absent (None: a collective-permute's pairs); all axes when one group, or the
    empty set of groups (`{}`), holds every device."""
    if groups is None:
        return ()
    names = [n for n, _ in axis_sizes]
    sizes = [s for _, s in axis_sizes]
    total = int(np.prod(sizes)) if sizes else 1
    if not groups or (len(groups) == 1 and len(groups[0]) in (0, total)):
        return tuple(n for n, s in axis_sizes if s > 1)
    wanted = {frozenset(g) for g in groups}
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), r):
            if any(sizes[i] == 1 for i in subset):
                continue
            if {frozenset(row) for row in _axis_groups(sizes, subset)} == wanted:
                return tuple(names[i] for i in subset)
    return ()


# What else a fusion between a matmul and a collective may do and still carry the matmul's
# result: sum it (a gradient summed over repeated heads), broadcast a constant into it.
_CARRYING = _PASS_THROUGH | {"parameter", "constant", "broadcast", "reduce", "add"}


def _moves_only(inst, program: Program) -> bool:
    """A fusion that only moves, re-types or sums values (a layout change XLA:GPU fused)."""
    return inst.op == "fusion" and all(i.op in _CARRYING for i in program.body(inst))


def _walk(program: Program, starts, onward, limit: Optional[int] = None):
    """The instructions reached from the names `starts`, nearest first, each once: from each,
    on to the names `onward(inst)` gives (at most `limit` names visited)."""
    seen: set[str] = set()
    todo = collections.deque(starts)
    while todo and (limit is None or len(seen) < limit):
        name = todo.popleft()
        if name in seen:
            continue
        seen.add(name)
        inst = program.by_name.get(name)
        if inst is not None:
            yield inst
            todo.extend(onward(inst))


def _reaches(start: str, edges: dict[str, list[str]], program: Program) -> bool:
    """Whether a matmul is reached from `start` along `edges` through pass-through operations."""

    def onward(inst):
        passes = inst.op in _PASS_THROUGH or _moves_only(inst, program)
        return edges.get(inst.name, ()) if passes and not _is_matmul(inst) else ()

    return any(_is_matmul(i) for i in _walk(program, edges.get(start, ()), onward))


def _element_users(program: Program, users: dict, name: str, k: int, n: int) -> list[str]:
    """The instructions that take element `k` of `name`'s result (of `n` elements)."""
    out = []
    for user in users.get(name, ()):
        inst = program.by_name[user]
        for ref, element in itertools.zip_longest(inst.operands, inst.operand_elements):
            if ref != name:
                continue
            if element is not None:
                if element == k:
                    out.append(user)
            elif inst.op == "get-tuple-element" and n > 1:
                if inst.attribute("index") == str(k):
                    out.append(user)
            else:  # the whole value (one array, or a tuple passed on as it is)
                out.append(user)
    return out


def _reaches_any(starts: list[str], edges: dict[str, list[str]], program: Program) -> bool:
    """Whether one of `starts` is a matmul, or passes a value on to one along `edges`."""
    for name in starts:
        inst = program.by_name.get(name)
        if inst is None:
            continue
        if _is_matmul(inst):
            return True
        if (inst.op in _PASS_THROUGH or _moves_only(inst, program)) and _reaches(
            name, edges, program
        ):
            return True
    return False


def _is_matmul(inst) -> bool:
    return (
        inst.op in _MATMULS
        or (inst.op == "custom-call" and "$" in inst.target)
        or (inst.op == "fusion" and "gemm" in inst.fusion_kind)
    )


def _named_by_sources(program: Program, starts: Sequence[str], limit: int = 256) -> str:
    """The name a collective with no name stack of its own takes from what it carries: the
    name stacks of the nearest instructions upstream that have one (a fusion by its body's),
    joined by ":" as XLA's combiners join the names of what they merge. Older XLAs (JAX 0.10's)
    drop the name when they combine collectives or move them out of the partitioner's scope."""

    def name_of(inst) -> str:
        return inst.op_name or next((i.op_name for i in program.body(inst) if i.op_name), "")

    names: list[str] = []
    for inst in _walk(program, starts, lambda i: () if name_of(i) else i.operands, limit):
        found = name_of(inst)
        if found and found not in names:
            names.append(found)
    return ":".join(names)


def collectives(hlo_text: str | Program) -> list[Collective]:
    """Every collective in a program (HLO text or parsed), in program order, each marked with
    whether it feeds a matmul operand or carries a matmul result. A combined collective (XLA
    merges several into one instruction) is split into its parts, each marked on its own."""
    program = hlo_text if isinstance(hlo_text, Program) else parse(hlo_text)
    users = program.users()
    operands = {inst.name: list(inst.operands) for inst in program.instructions}
    times = program.multiplicity()
    out = []
    for inst in program.instructions:
        kind = inst.op[: -len("-start")] if inst.op.endswith("-start") else inst.op
        if kind not in KINDS:
            continue
        groups = replica_groups(inst.attributes)
        arrays = inst.arrays
        result = inst.name
        if inst.op.endswith("-start"):
            done = [u for u in users.get(inst.name, ()) if program.by_name[u].op.endswith("-done")]
            if done:
                result, arrays = done[0], program.by_name[done[0]].arrays
            elif len(arrays) > 1:
                arrays = arrays[len(inst.operands) : 2 * len(inst.operands)] or arrays[-1:]
        n = len(arrays)
        for k, (dtype, shape) in enumerate(arrays):
            into = _reaches_any(_element_users(program, users, result, k, n), users, program)
            source_name = inst.operands[k] if n == len(inst.operands) else None
            if source_name is None:
                source = _reaches(inst.name, operands, program)
            else:
                source = _reaches_any([source_name], operands, program)
            count = times.get(inst.computation, 1)
            name = inst.op_name or _named_by_sources(
                program, inst.operands if source_name is None else [source_name]
            )
            out.append(Collective(kind, dtype, shape, name, into, source, groups, count))
    return out
