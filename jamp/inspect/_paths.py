"""Module paths from JAX name stacks: which Flax module an equation (or an HLO op) belongs to.

Flax linen wraps every module method call in `jax.named_scope` (the module's name, or its class
name for a root module; `name.method` for a method other than `__call__`), so each jaxpr
equation's `source_info.name_stack` says where it came from, and XLA copies it into every HLO
instruction's `op_name`. Around those names sit what JAX and jamp add:

* transforms wrap the first name inside them: `jvp(Wrapped.apply)/TransformerLM/Dense_0` is the
  forward of a differentiated call, `transpose(jvp(Wrapped.apply))/...` its backward,
  `vmap(Dense_0)` a vmapped module; HLO op names start with `jit(step)/jit(main)/`;
* `jamp.wrap` tags the calls of overridden submodules (normalization layers included) with a
  `jamp_policy_<i>_` scope, and `jamp.autocast` names an equation that had no name `_`;
* names that are no module: `jnp.einsum`'s spec, `rematted_computation`, jamp's
  `jamp_broadcast_sum` (`jamp.scopes.SUM_SCOPE`), user scopes.

`module_path` strips all of that down to the path Flax gives the module in the variables tree
("DecoderBlock_0/Dense_0"; "" outside any module): the one name jamp's reports, overrides and
logs give a module. It is exact for a trace recorded with `ModuleCalls`, which notes every
module call's scope names and the params path they stand for: a module whose method calls
another of its own wrapped methods (`nn.SelfAttention` calls `MultiHeadDotProductAttention`'s
`__call__`, a lifted transform's inner module) repeats its name on the stack,
`Block_0/SelfAttention_0/SelfAttention_0/query`, for the params path
`Block_0/SelfAttention_0/query`. Without one it keeps every name that looks like a module's and
drops what `jamp.wrap` put above the model (an unwrapped root's class name stays).

A `jamp.wrap`ped NNX model's submodule calls run in a scope naming their whole attribute path,
`jamp_nnx(blocks.0.attn)` (`jamp.scopes.CALL_SCOPE`); the innermost such scope is the path
("blocks/0/attn"), whatever encloses it. The model's own call runs in
`jamp_nnx_root(TransformerLM)` (`jamp.scopes.ROOT_SCOPE`): its root, path "".

Example::

  calls = ModuleCalls()
  with calls.recording():
      jaxpr = jax.make_jaxpr(loss)(params)
  for eqn in jaxpr.eqns:
      print(module_path(str(eqn.source_info.name_stack), calls),
            is_backward(str(eqn.source_info.name_stack)))
"""

from __future__ import annotations

import contextlib
import re
import weakref
from typing import Any, Callable, Optional

import flax.linen as nn

from jamp.nnx import observing_calls as _observing_nnx_calls
from jamp.overrides import TAG_PREFIX as wrap_tag
from jamp.overrides import tag_index as _tag_index
from jamp.scopes import CALL_SCOPE as _NNX_SCOPE
from jamp.scopes import ROOT_SCOPE as _NNX_ROOT
from jamp.scopes import SUM_SCOPE as _SUM_SCOPE
from jamp.scopes import LinenCalls, chain_path
from jamp.scopes import Name as Name  # the name stack's reading, shared with the fp8 site names
from jamp.scopes import names as names
from jamp.scopes import split_top as split_top

#: The scope `jamp.wrap` puts around an overridden submodule's call (see `jamp.overrides.tag`).
_TAG = re.compile(rf"^{re.escape(wrap_tag)}(\d+)_$")
# What `jamp.wrap` calls the user's model from: `Wrapped.apply`, `Wrapped.init`, ...
_WRAPPED = re.compile(r"^Wrapped\.\w+$")
# A module's scope name: an identifier, perhaps with `.method`.
_MODULE_LIKE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_<>]\w*>?)?$")
# Transforms whose argument is a function's name, not a scope of the program.
_FUNCTION_TRANSFORMS = frozenset({"jit", "pjit"})
# Scopes JAX itself, or jamp's engine, opens inside a program.
_JAX_NAMES = frozenset({"rematted_computation", _SUM_SCOPE})


def is_backward(name_stack: str) -> bool:
    """Whether an equation belongs to a backward pass (it ran under JAX's `transpose`)."""
    return "transpose(" in name_stack


def policy_tag(name_stack: str) -> Optional[int]:
    """The index (into `jamp.wrap`'s overrides) of the innermost policy tag, if any."""
    return _tag_index(name_stack)  # jamp.wrap's own reading of its tags


class ModuleCalls(LinenCalls):
    """Records, while a function is traced, the scope names that Flax module calls leave
    (`jamp.scopes.LinenCalls`: `roots`, `modules`, `chains`).

    Also keeps the `jamp.wrap`ped modules it saw (`wrapped`), whose overrides say which policy
    each tag index stands for, and the class of each module by path (`classes`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.classes: dict[str, type] = {}  # module path -> class
        self.nnx_roots: set[str] = set()  # class names of wrapped NNX models called
        self.wrapped: list = []  # jamp.wrap's linen Wrapped modules, NNX models' settings

    def _called(self, module: nn.Module, path: str) -> None:
        if type(module).__name__ == "Wrapped":
            if module.name is None and hasattr(module, "overrides"):
                if not any(w is module for w in self.wrapped):
                    self.wrapped.append(module)
            return
        self.classes.setdefault(path, type(module))

    def _nnx_call(self, path: str, cls: type, setup) -> None:
        if path:
            self.classes.setdefault(path, cls)
        if setup is not None:
            self.nnx_roots.add(cls.__name__)
            if not any(w is setup for w in self.wrapped):
                self.wrapped.append(setup)  # its policy, overrides and activations, as Wrapped's

    @contextlib.contextmanager
    def recording(self):
        """Record module calls made (by any tracing) inside this context: linen modules' and
        the submodules' of `jamp.wrap`ped NNX models."""
        with super().recording(), _observing_nnx_calls(self._nnx_call):
            yield self


# The module calls recorded the last time each function was traced: a jitted function (a
# sharded step) is traced once, and JAX serves its cached trace afterwards, running no module.
_RECORDED: "weakref.WeakKeyDictionary[Any, ModuleCalls]" = weakref.WeakKeyDictionary()


def recording_calls(fn, trace: Callable[[], Any]) -> tuple[Any, ModuleCalls]:
    """`trace()` (which traces `fn`), and the module calls recorded while it ran; where it
    recorded none (JAX served a cached trace of `fn`), those recorded last time `fn` was traced
    here."""
    calls = ModuleCalls()
    with calls.recording():
        out = trace()
    try:
        if calls.roots or calls.nnx_roots:
            _RECORDED[fn] = calls
        else:
            calls = _RECORDED.get(fn, calls)
    except TypeError:  # not weakly referable: keep what was recorded
        pass
    return out, calls


def _is_root(text: str, calls: Optional[ModuleCalls]) -> bool:
    if calls is not None:
        return text in calls.roots or _WRAPPED.match(text) is not None
    return _WRAPPED.match(text) is not None


def module_path(name_stack: str, calls: Optional[ModuleCalls] = None) -> str:
    """The Flax module path of an equation with this name stack ("" outside any module).

    Args:
      name_stack: `str(eqn.source_info.name_stack)`, or an HLO op name without its last
        component (the primitive; see `op_name_path`).
      calls: the module calls recorded while the program was traced; without them every name
        that looks like a module's is kept.

    Example::

      module_path("transpose(jvp(Wrapped.apply))/TransformerLM/Embed_0.attend")  # "Embed_0"
    """
    all_names = names(name_stack)
    nnx_scopes = [n for n in all_names if _NNX_SCOPE in n.transforms]
    if nnx_scopes:  # inside a wrapped NNX model's submodule: its scope holds the whole path
        return nnx_scopes[-1].text.replace(".", "/")
    if nnx_root(name_stack) is not None:
        return ""  # the wrapped NNX model's own operations
    items = [
        n
        for n in all_names
        if not _TAG.match(n.text)
        and n.text != "_"
        and not _FUNCTION_TRANSFORMS.intersection(n.transforms)
    ]
    texts = [n.text for n in items]
    # Everything up to the innermost root belongs to the caller: jamp's Wrapped, the root
    # module's own scope (its class name), a root method ("Model.encode").
    start = 0
    for i, text in enumerate(texts):
        if _is_root(text, calls):
            start = i + 1
            if calls is None and _WRAPPED.match(text) and i + 1 < len(texts):
                start = i + 2  # the wrapped model's class name follows Wrapped's scope
    kept = []
    for text in texts[start:]:
        if not _MODULE_LIKE.match(text) or text in _JAX_NAMES:
            continue  # an einsum spec, a name JAX added
        if calls is not None and calls.roots and text.partition(".")[0] not in calls.modules:
            continue  # a user's own scope inside a Flax program
        kept.append(text)
    # The longest run of scopes a recorded call left names its params path exactly.
    previous = texts[start - 1].partition(".")[0] if start else None
    return chain_path(kept, calls.chains if calls is not None else {}, previous)


def nnx_root(name_stack: str) -> Optional[str]:
    """The class name of the `jamp.wrap`ped NNX model whose call an equation ran in, if any."""
    for n in names(name_stack):
        if _NNX_ROOT in n.transforms:
            return n.text
    return None


def in_module(name_stack: str, calls: ModuleCalls) -> bool:
    """Whether an equation ran inside a Flax module call (always, for a program without any:
    then its scopes are the user's own `jax.named_scope`s)."""
    if not calls.roots and not calls.nnx_roots:
        return True
    return any(
        _is_root(n.text, calls) or _NNX_ROOT in n.transforms or _NNX_SCOPE in n.transforms
        for n in names(name_stack)
    )


def op_name_path(op_name: str, calls: Optional[ModuleCalls] = None) -> tuple[str, bool]:
    """(module path, whether backward) of an HLO instruction's `op_name` metadata.

    Example::

      op_name_path("jit(step)/jit(main)/transpose(jvp(Wrapped.apply))/Model/Dense_0/dot_general")
      # ("Dense_0", True)
    """
    parts = split_top(op_name)
    stack = "/".join(parts[:-1])  # the last name is the primitive
    return module_path(stack, calls), is_backward(stack)


def report_path(op_name: str, calls: Optional[ModuleCalls] = None) -> tuple[str, bool]:
    """`op_name_path` for a report: the params path of the module an op ran in; where the
    recorded calls give none (work of the model's root, a loss's own scopes), the path its name
    stack reads without them, as before calls were recorded."""
    path, backward = op_name_path(op_name, calls)
    if not path and calls is not None:
        path, backward = op_name_path(op_name)
    return path, backward
