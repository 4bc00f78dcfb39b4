"""What XLA made of a sharded program: its HLO after SPMD partitioning, and the collectives in it.

Where a value crosses devices, and in which dtype, is decided by XLA's SPMD partitioner; what
follows is backend-specific. XLA:CPU, for one, widens every 16-bit collective to float32 after
partitioning (its float normalization), so the final CPU program would say float32 where the
partitioned one, the one XLA:GPU runs as it is, moves bf16. These helpers read the partitioned
program, on any backend.

Example::

    text = partitioned_hlo(step, state, batch, key)   # a jitted function and its arguments
    for c in collectives(text):
        print(c.kind, c.dtype, c.shape, c.nbytes, c.op_name)
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile

import numpy as np

_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
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
}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<type>.+?) (?P<op>[a-z][a-z0-9-]*)\((?P<args>[^)]*)\)"
)
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
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
    }
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a partitioned program (a tuple-shaped one is split into its parts)."""

    kind: str  # "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"
    dtype: str  # HLO's spelling: "bf16", "f32", ...
    shape: tuple[int, ...]  # of the result, per device
    op_name: str  # the JAX name stack it came from ("" if XLA recorded none)
    into_matmul: bool = False  # its result is an operand of a dot / convolution (e.g. a weight)
    from_matmul: bool = False  # its operand is a dot's / convolution's result (e.g. a weight grad)

    @property
    def nbytes(self) -> int:
        """Bytes of the result on one device."""
        return int(np.prod(self.shape, dtype=np.int64)) * _ITEMSIZE.get(self.dtype, 4)


def partitioned_hlo(jitted, *args, **kwargs) -> str:
    """The HLO text of `jitted(*args, **kwargs)` right after XLA's SPMD partitioning.

    Compiles the program once more (nothing is run), with XLA dumping that one pass; JAX's
    persistent compilation cache is off meanwhile, since an executable it served would not be
    compiled, and so not dumped.
    """
    import jax  # here: reading a program's text needs jax only when a program is compiled
    from jax.experimental.compilation_cache import compilation_cache

    lowered = jitted.lower(*args, **kwargs)
    cached = jax.config.jax_enable_compilation_cache
    with tempfile.TemporaryDirectory() as where:
        # The cache decides once whether it is in use; reset, it decides again at the next compile.
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        try:
            lowered.compile(
                compiler_options={"xla_dump_to": where, "xla_dump_hlo_pass_re": "spmd-partitioning"}
            )
        finally:
            jax.config.update("jax_enable_compilation_cache", cached)
            compilation_cache.reset_cache()
        found = sorted(glob.glob(os.path.join(where, "*after_spmd-partitioning*.txt")))
        if not found:
            raise RuntimeError(
                "XLA wrote no partitioned program (no sharding to partition, or this XLA names "
                "the pass differently)"
            )
        with open(found[-1]) as f:
            return f.read()


def _reaches(start: str, edges: dict[str, list[str]], ops: dict[str, str]) -> bool:
    """Whether a matmul is reached from `start` along `edges` through pass-through operations."""
    seen, todo = set(), list(edges.get(start, ()))
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if ops.get(name) in _MATMULS:
            return True
        if ops.get(name) in _PASS_THROUGH:
            todo.extend(edges.get(name, ()))
    return False


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in `hlo_text`, in program order, each marked with whether it feeds a
    matmul operand or carries a matmul result."""
    found, ops = [], {}
    operands: dict[str, list[str]] = {}
    users: dict[str, list[str]] = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, op = m.group("name"), m.group("op")
        ops[name] = op
        operands[name] = _OPERAND.findall(m.group("args"))
        for operand in operands[name]:
            users.setdefault(operand, []).append(name)
        kind = op[: -len("-start")] if op.endswith("-start") else op
        if kind in _KINDS:
            where = _OP_NAME.search(line)
            found.append((name, kind, m.group("type"), where.group(1) if where else ""))
    out = []
    for name, kind, type_text, op_name in found:
        into, source = _reaches(name, users, ops), _reaches(name, operands, ops)
        for dtype, dims in _ARRAY.findall(type_text):
            shape = tuple(int(d) for d in dims.split(",") if d)
            out.append(Collective(kind, dtype, shape, op_name, into, source))
    return out
