"""What each instruction of a compiled XLA program is, for `jamp.inspect.profile`.

A profiler trace names the HLO instruction each event ran (its `hlo_op`); the compiled program's
HLO text (`jitted.lower(...).compile().as_text()`) says what that instruction is: its result and
operand types, the computations it calls (a fusion's body) and the JAX name stack that XLA kept
in its metadata (`op_name="jit(train_step)/jvp(Wrapped.apply)/SeedCNN/Dense_0/dot_general"`).
From those this module gives every instruction a class (see `CLASSES`) and a Flax module path.

Example::

    ops = HloOps(step.lower(state, batch, rng).compile().as_text())
    ops.op("ynn_fusion.5")     # Op(op_class='matmul 16-bit', module='Dense_0', tier=0)
    module_path("jit(train_step)/transpose(jvp(Wrapped.apply))/SeedCNN/Conv_1/mul")  # 'Conv_1'
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jamp.hlo import text as hlo_text
from jamp.hlo.kernels import COLLECTIVE_OPS
from jamp.inspect._paths import names, nnx_root, op_name_path
from jamp.wrap import Wrapped

#: The classes of device time, in the order tables and plots show them. "16-bit" matmuls are all
#: matmuls whose operands are 16 bits wide or narrower (bf16, fp16, fp8, int8); "fp32" ones have
#: a 32-bit (or wider) operand. Elementwise work is 16-bit when most of the floating-point
#: elements its instructions write (or read) are 16-bit.
CLASSES = (
    "matmul 16-bit",
    "matmul fp32",
    "convolution",
    "elementwise 16-bit",
    "elementwise 32-bit",
    "collective",
    "other",
)
#: Module paths of work outside the model: the loss (its forward and backward, outside the model),
#: the update (gradient averaging, unscaling, finite check, optimizer, loss-scale adjustment) and
#: instructions XLA created without a name stack (copies, layout changes).
LOSS, UPDATE, UNNAMED, UNMATCHED = "(loss)", "(update)", "(unnamed)", "(unmatched)"


# Events of these only wrap or wait for other work (a while loop's event spans its body's events;
# an async "-done" waits for its "-start"): they get only time in which nothing else ran.
_CONTAINERS = frozenset({"while", "conditional", "call"})
_NOT_WORK = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})


@dataclasses.dataclass(frozen=True)
class Op:
    """What one instruction is: its class, its module path, and its priority when events overlap
    (0 compute, 1 collective, 2 containers and waits)."""

    op_class: str
    module: str
    tier: int = 0


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    op: str
    arrays: tuple[tuple[str, tuple[int, ...]], ...]
    operands: tuple[str, ...]
    calls: tuple[str, ...]  # computations whose instructions are part of this one
    target: str  # a custom-call's target
    op_name: str


def _instr(inst: hlo_text.Instruction) -> _Instr:
    calls = list(inst.calls)
    if inst.op == "call":
        calls += [c for c in inst.called if c not in calls]  # its to_apply
    return _Instr(
        inst.name, inst.op, inst.arrays, inst.operands, tuple(calls), inst.target, inst.op_name
    )


def module_path(op_name: str) -> str:
    """The module path of an HLO instruction's `op_name`, as the precision report names it
    (`jamp.inspect._paths`), with a label where that path is empty: the model's root module's
    own operations ("(SeedCNN)"), the loss outside the model, the update, no name at all.

    Example::

      >>> module_path("jit(step)/transpose(jvp(Wrapped.apply))/TransformerLM/DecoderBlock_0/"
      ...             "LayerNorm_0/jamp_policy_1_/mul")
      'DecoderBlock_0/LayerNorm_0'
      >>> module_path("jit(step)/jvp(Wrapped.apply)/SeedCNN/jit(relu)/max")
      '(SeedCNN)'
      >>> module_path("jit(step)/jvp()/log"), module_path("jit(step)/sqrt")
      ('(loss)', '(update)')
    """
    if not op_name:
        return UNNAMED
    stack = op_name.rsplit("/", 1)[0] if "/" in op_name else ""
    # A capitalized name outside jit(...) is a Flax root scope (its class, or jamp's Wrapped);
    # without one the instruction lies outside the model, whatever else its stack names
    # (shard_map, while/body).
    roots = [n.text for n in names(stack) if n.text[:1].isupper() and "jit" not in n.transforms]
    nnx_model = nnx_root(stack)  # a jamp.wrapped NNX model's call (its class name)
    if not roots and nnx_model is None:
        return LOSS if ("jvp(" in stack or "transpose(" in stack) else UPDATE
    path, _ = op_name_path(op_name)
    if path:
        return path
    if nnx_model is not None:
        return f"({nnx_model})"
    wrapped = roots[0].split(".")[0] == Wrapped.__name__ and len(roots) > 1
    return f"({(roots[1] if wrapped else roots[0]).split('.')[0]})"


def _elements(instr: _Instr) -> list[tuple[str, int]]:
    """(element type, element count) of each array of an instruction's result."""
    return [(dtype, int(np.prod(shape, dtype=np.int64))) for dtype, shape in instr.arrays]


def _is_float(dtype: str) -> bool:
    return dtype in ("bf16", "f16", "f32", "f64") or dtype.startswith(("f8", "f6", "f4"))


def _narrow(dtype: str) -> bool:
    """At most 16 bits wide: what the "16-bit" classes count."""
    return dtype in ("bf16", "f16", "s8", "u8", "s4", "u4") or dtype.startswith(("f8", "f6", "f4"))


class HloOps:
    """The instructions of one compiled program (its HLO text), classified on demand.

    Example::

      ops = HloOps(jitted.lower(*args).compile().as_text())
      ops.module_name            # 'jit_train_step': what the trace's events call the program
      ops.op("fusion.3")         # Op(op_class='elementwise 32-bit', module='Dense_0', tier=0)
    """

    def __init__(self, text: str):
        first = text.lstrip().split("\n", 1)[0]
        self.module_name = first.split()[1].rstrip(",") if first.startswith("HloModule") else ""
        self._instrs: dict[str, _Instr] = {}
        self._computations: dict[str, list[_Instr]] = collections.defaultdict(list)
        self._users: dict[str, list[str]] = collections.defaultdict(list)
        self._cache: dict[str, Op] = {}
        for inst in hlo_text.parse(text).instructions:
            instr = _instr(inst)
            self._instrs[instr.name] = instr
            self._computations[inst.computation].append(instr)
            for operand in instr.operands:
                self._users[operand].append(instr.name)

    def __contains__(self, name: str) -> bool:
        return name in self._instrs

    def _contents(self, instr: _Instr) -> list[_Instr]:
        """The instructions a fusion (or call, or async op) runs, nested fusions included."""
        out, todo, seen = [], list(instr.calls), set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for inner in self._computations.get(name, ()):
                out.append(inner)
                if inner.op in ("fusion", "call") or inner.op.startswith("async-"):
                    todo.extend(inner.calls)
        return out

    def _dtype(self, instr: _Instr) -> str:
        """The floating-point type an instruction writes, or else the first one it reads."""
        for dtype, _ in _elements(instr):
            if _is_float(dtype):
                return dtype
        for operand in instr.operands:
            if operand in self._instrs:
                for dtype, _ in _elements(self._instrs[operand]):
                    if _is_float(dtype):
                        return dtype
        return ""

    def _operands_narrow(self, instr: _Instr) -> bool:
        types = [_elements(self._instrs[o]) for o in instr.operands[:2] if o in self._instrs]
        return bool(types) and all(t and _narrow(t[0][0]) for t in types)

    def op(self, name: str) -> Op:
        """The class, module path and overlap tier of instruction `name` (UNMATCHED if unknown)."""
        if name not in self._cache:
            instr = self._instrs.get(name)
            self._cache[name] = (
                Op("other", UNMATCHED, 0) if instr is None else self._classify(instr)
            )
        return self._cache[name]

    def _classify(self, instr: _Instr) -> Op:
        base = instr.op.removesuffix("-start").removesuffix("-done")
        body = [instr, *self._contents(instr)]
        tier = 2 if instr.op in _CONTAINERS or instr.op.endswith("-done") else 0
        if base in COLLECTIVE_OPS or any(
            i.op.removesuffix("-start") in COLLECTIVE_OPS for i in body
        ):
            where = next((i for i in body if i.op.removesuffix("-start") in COLLECTIVE_OPS), instr)
            return Op("collective", self._path(where, instr), max(tier, 1))
        if tier == 2:
            return Op("other", self._path(instr, instr), 2)
        target = instr.target.lower()
        for inner in body:
            inner_target = inner.target.lower()
            if inner.op == "dot" or any(k in inner_target for k in ("gemm", "matmul", "fmha")):
                narrow = self._operands_narrow(inner)
                return Op("matmul 16-bit" if narrow else "matmul fp32", self._path(inner, instr))
            if inner.op == "convolution" or (
                "conv" in inner_target and "convert" not in inner_target
            ):
                return Op("convolution", self._path(inner, instr))
        if instr.op == "custom-call" and target:
            return Op("other", self._path(instr, instr))
        return Op(self._elementwise_class(body), self._path(instr, instr))

    def _elementwise_class(self, body: list[_Instr]) -> str:
        # Weigh each instruction by the elements it writes: a fusion that widens bf16 to fp32,
        # computes and narrows back did its arithmetic in fp32.
        narrow = wide = 0
        for inner in body:
            if inner.op in _NOT_WORK or inner.op == "fusion":
                continue
            dtype = self._dtype(inner)
            count = sum(n for _, n in _elements(inner)) or 1
            if dtype and _narrow(dtype):
                narrow += count
            elif dtype:
                wide += count
        if not narrow and not wide:
            return "other"
        return "elementwise 16-bit" if narrow > wide else "elementwise 32-bit"

    def _named(self, instr: _Instr) -> str | None:
        """The module path of an instruction's own name stack, or its body's commonest one."""
        if instr.op_name:
            return module_path(instr.op_name)
        counts = collections.Counter(i.op_name for i in self._contents(instr) if i.op_name)
        return module_path(counts.most_common(1)[0][0]) if counts else None

    def _path(self, where: _Instr, instr: _Instr) -> str:
        """The module path of `where` (the part of `instr` that decides its class)."""
        if where.op_name:
            return module_path(where.op_name)
        if (named := self._named(instr)) is not None:
            return named
        # XLA's own instructions (layout copies, a 16-bit convolution it rewrote in fp32) carry
        # no name stack: they belong with the nearest named instruction that uses their result
        # or makes an operand (users first: a rewritten op's result is cast back by its own
        # module), preferably one inside the model (the state's parameters are named outside).
        todo, fallback = [*self._users.get(instr.name, ()), *instr.operands], UNNAMED
        seen: set[str] = set()
        while todo and len(seen) < 32:
            near = self._instrs.get(todo.pop(0))
            if near is None or near.name in seen:
                continue
            seen.add(near.name)
            named = self._named(near)
            if named is not None and not named.startswith("("):
                return named
            if named is not None and fallback == UNNAMED:
                fallback = named
            todo += [*self._users.get(near.name, ()), *near.operands]
        return fallback
