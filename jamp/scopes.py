"""The name scopes jamp opens around a wrapped NNX model's calls, and what they say.

Flax linen names every module call's scope by the module's name, so a traced equation's name
stack reads `TransformerLM/DecoderBlock_0/Dense_0`. NNX opens no scopes; a `jamp.wrap`ped NNX
model opens them instead: its own call in `jamp_nnx_root(TransformerLM)` (`ROOT_SCOPE`), each
submodule's calls in one holding its whole attribute path, `jamp_nnx(blocks.0.attention)`
(`CALL_SCOPE`; "." between the parts, as a "/" would split the scope in JAX's name stack).
`jamp.inspect` and the fp8 site names read them back (`plain`, `nnx_path`).

Linen opens a scope for each module method call (the module's name; a root module's class name;
`name.method` for a method other than `__call__`), and a module re-entering its own wrapped
method (`nn.SelfAttention` calls `MultiHeadDotProductAttention.__call__`) or a lifted transform's
inner module repeats its name. `LinenCalls` records, while a program is traced, which chain of
such scope names stands for which params path; `linen_path` reads a name stack back with it
(the fp8 site names, `jamp.inspect`'s module paths).

`SUM_SCOPE` names no module: jamp's engine sums a 16-bit operand's gradient over the axes it was
broadcast along (a position embedding's, over the batch) as a product with ones in it, so that
those GEMMs are told apart from the layer's own; module paths leave it out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn

CALL_SCOPE = "jamp_nnx"
ROOT_SCOPE = "jamp_nnx_root"
SUM_SCOPE = "jamp_broadcast_sum"

_CALL = re.compile(rf"^{CALL_SCOPE}\(([^()/]*)\)$")
_ROOT = re.compile(rf"^{ROOT_SCOPE}\((\w+)\)$")


def call_scope(path) -> str:
    """The scope name of the calls of the submodule at attribute path `path` (a tuple)."""
    return f"{CALL_SCOPE}({'.'.join(map(str, path))})"


def root_scope(class_name: str) -> str:
    """The scope name of a wrapped NNX model's own call."""
    return f"{ROOT_SCOPE}({class_name})"


def nnx_path(name_stack: str) -> Optional[str]:
    """The attribute path ("blocks/0/mlp_in") of the submodule of a `jamp.wrap`ped NNX model
    whose call an equation with this name stack ran in: the innermost call scope's, "" for the
    model's own work; None where the stack holds none of these scopes. Names below that scope
    (a `jnp.einsum`'s spec, a user's `jax.named_scope`) are the module's own work."""
    parts = name_stack.split("/")
    calls = [i for i, part in enumerate(parts) if _CALL.match(part)]
    roots = [i for i, part in enumerate(parts) if _ROOT.match(part)]
    if not calls and not roots:
        return None
    if calls and not (roots and roots[-1] > calls[-1]):  # (a wrapped model inside: its own)
        return _CALL.match(parts[calls[-1]]).group(1).replace(".", "/")  # type: ignore[union-attr]
    return ""


def plain(name_stack: str) -> str:
    """`name_stack` as linen would spell it: `jamp_nnx_root(LM)/jamp_nnx(blocks.0)/
    jamp_nnx(blocks.0.mlp_in)/x` -> `LM/blocks/0/mlp_in/x` (the innermost call scope's path,
    with what follows it); what encloses the (innermost) wrapped model is left out. A stack
    without these scopes comes back as it was. Only scopes that are whole names of the stack
    count (not ones inside a transform's name, `jvp(...)`)."""
    parts = name_stack.split("/")
    calls = [i for i, part in enumerate(parts) if _CALL.match(part)]
    roots = [(i, m.group(1)) for i, part in enumerate(parts) if (m := _ROOT.match(part))]
    if not calls and not roots:
        return name_stack
    head = [roots[-1][1]] if roots else []
    if calls and not (roots and roots[-1][0] > calls[-1]):  # (a wrapped model inside: its own)
        last = calls[-1]
        path = _CALL.match(parts[last]).group(1).split(".")  # type: ignore[union-attr]
        return "/".join([*head, *path, *parts[last + 1 :]])
    at = roots[-1][0]
    return "/".join([*head, *parts[at + 1 :]])


# ----- linen's scopes


@dataclasses.dataclass(frozen=True)
class Name:
    """One name of a name stack, with the transforms around it (innermost first)."""

    text: str
    transforms: tuple[str, ...] = ()


def split_top(text: str) -> list[str]:
    """`text` split at the slashes outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "/" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _wraps_whole(part: str) -> bool:
    """Whether `part` is one `head(...)`: its first "(" closes at its last character (not
    `a(x)/b(y)`, a whole stack that `jamp.autocast` re-entered as one scope)."""
    depth = 0
    for i, ch in enumerate(part):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i == len(part) - 1
    return False


def names(name_stack: str) -> list[Name]:
    """The names of a name stack, transforms peeled off: `transpose(jvp(A))/B` -> A (under
    transpose and jvp), B. A scope name that itself holds slashes (`jamp.autocast` re-enters an
    equation's whole name stack as one scope) is split too."""
    out: list[Name] = []
    for part in split_top(name_stack):
        transforms = []
        while part.endswith(")") and "(" in part and _wraps_whole(part):
            head, inner = part.split("(", 1)
            if not re.fullmatch(r"\w+", head):
                break
            transforms.append(head)
            part = inner[:-1]
        around = tuple(reversed(transforms))  # innermost first
        if "/" in part and len(split_top(part)) > 1:  # a wrapped scope holding a whole stack
            for sub in names(part):
                out.append(Name(sub.text, sub.transforms + around))
        elif part:
            out.append(Name(part, around))
    return out


class LinenCalls:
    """Records, while a function is traced, the scope names that linen module calls leave and
    the params path each chain of them stands for.

    Example::

      calls = LinenCalls()
      with calls.recording():
          jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(params)
      linen_path("TransformerLM/Block_0/SelfAttention_0/SelfAttention_0/query", calls)
      # "Block_0/SelfAttention_0/query"
    """

    def __init__(self) -> None:
        self.modules: set[str] = set()  # scope names of linen submodules, without ".method"
        self.roots: set[str] = set()  # scope names of root modules, "Class" or "Class.method"
        # The scope names of the module calls below a root, as they stand on the name stack
        # (methods as "Dense_0.attend"), -> the module's params path.
        self.chains: dict[tuple[str, ...], str] = {}
        self._paths: list[tuple[str, ...]] = []  # the params paths of the calls running now
        self._chain: tuple[str, ...] = ()
        self._scopes: list[tuple[Any, tuple[str, ...]]] = []  # (root scope, its path prefix)

    def _path_of(self, module: nn.Module) -> tuple[str, ...]:
        """A bound module's params path, also in a scope of its own: a module applied from
        inside another's method (`self.head.apply(...)`, a nested apply) has an empty path in
        it, under its caller's path and its name; a lifted transform's inner module (`nn.remat`,
        `nn.scan`) keeps the path its wrapper has (the wrapper's own scope path is empty)."""
        own = tuple(str(p) for p in module.path)
        assert module.scope is not None
        root = module.scope.root
        prefix = next((pre for r, pre in self._scopes if r is root), None)
        if prefix is None:
            caller = self._paths[-1] if self._paths else ()
            if not own:
                prefix = caller + ((module.name,) if self._paths and module.name else ())
            elif caller[len(caller) - len(own) :] == own:
                prefix = caller[: len(caller) - len(own)]
            else:
                prefix = ()
            self._scopes.append((root, prefix))
        return prefix + own

    def _called(self, module: nn.Module, path: str) -> None:
        """Told of each module call, with its params path ("" for a root); for subclasses."""

    def _interceptor(self, next_fun, args, kwargs, context) -> Any:
        module, method = context.module, context.method_name
        scope = module.name or type(module).__name__
        label = scope if method == "__call__" else f"{scope}.{method}"
        if module.name is None or module.scope is None:  # a root (or jamp's unbound Wrapped)
            self.roots.add(label)
            path: tuple[str, ...] = ()
            chain: tuple[str, ...] = ()
        else:
            # Its params path, by Flax's own: a module re-entering its own method (or a lifted
            # transform's inner module) adds no level, a submodule named like its parent does.
            path = self._path_of(module)
            self.modules.add(scope)
            chain = self._chain + (label,)
            self.chains.setdefault(chain, "/".join(path))
        self._called(module, "/".join(path))
        saved = self._chain
        self._paths.append(path)
        self._chain = chain
        try:
            return next_fun(*args, **kwargs)
        finally:
            self._paths.pop()
            self._chain = saved
            if not self._paths:
                self._scopes.clear()  # the program's scopes, kept no longer than its call

    @contextlib.contextmanager
    def recording(self):
        """Record the linen module calls made (by any tracing) inside this context."""
        with nn.intercept_methods(self._interceptor):
            yield self


def chain_path(
    kept: Sequence[str], chains: Mapping[tuple[str, ...], str], previous: Optional[str] = None
) -> str:
    """The params path of the module scopes `kept` (below a root; `previous`: the scope before
    them): the longest run of them that a recorded call left names it exactly (`chains`, from
    `LinenCalls`); names past it (calls of a trace JAX served from its cache, unseen) are read
    one module each, a module's call of a method of its own adding none."""
    path: list[str] = []
    rest = list(kept)
    for end in range(len(rest) if chains else 0, 0, -1):
        found = chains.get(tuple(rest[:end]))
        if found is not None:
            path = found.split("/") if found else []
            previous, rest = rest[end - 1].partition(".")[0], rest[end:]
            break
    for text in rest:
        scope, _, method = text.partition(".")
        if not (method and scope == previous):  # else: a module calling a method of its own
            path.append(scope)
        previous = scope
    return "/".join(path)


def linen_path(name_stack: str, calls: LinenCalls) -> Optional[str]:
    """The params path of the linen module an equation with this name stack ran in ("" for the
    root's own work), by the calls recorded while it was traced; None where no recorded root
    module's scope is on the stack (a function's own scopes, outside any model).

    What encloses the innermost root is its caller's; below it, names no module call left (a
    user's `jax.named_scope`, `jnp.einsum`'s spec, jamp's own scopes) are left out."""
    texts = [n.text for n in names(name_stack)]
    roots = [i for i, text in enumerate(texts) if text in calls.roots]
    if not roots:
        return None
    kept = [t for t in texts[roots[-1] + 1 :] if t.partition(".")[0] in calls.modules]
    return chain_path(kept, calls.chains, texts[roots[-1]].partition(".")[0])
