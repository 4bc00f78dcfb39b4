"""Stable fp8 site names (a module's params path), and the names sites had before."""

from __future__ import annotations

import re
from typing import Callable, Optional

import jax

from jamp import scopes
from jamp.fp8.scope import _ACTIVE, _Scope
from jamp.fp8.state import Fp8State

_TAGS = re.compile(r"jamp_policy_\d+_/?")


def site_name(name_stack: str, counts: dict, calls: Optional[scopes.LinenCalls] = None) -> str:
    """A stable name for the next `dot_general` at `name_stack`: the params path of the module it
    runs in, "Block_0/SelfAttention_0/query/dot_general" (then "..._1" for a second one there;
    "dot_general" for the model's own), as `variables["params"]` nests the module: without the
    model's class name, a module re-entering its own method (`nn.SelfAttention`) once. `calls`:
    the linen module calls recorded while the program was traced (`jamp.scopes.LinenCalls`),
    which say that path; a `jamp.wrap`ped NNX model's scopes say it themselves
    ("blocks/0/mlp_in/dot_general"). Outside any module (`jamp.autocast` of a plain function)
    the name stack's own scopes name it ("encoder/proj/dot_general"). `counts` is the trace's
    running tally.

    Under `former_names`, the name jamp gave the site before (`_former_base`) is noted too."""
    stack = _TAGS.sub("", name_stack).strip("/")
    path = scopes.nnx_path(stack)
    if path is None and calls is not None:
        path = scopes.linen_path(stack, calls)
    if path is None:
        path = stack
    name = _numbered(f"{path}/dot_general" if path else "dot_general", counts)
    scope = _ACTIVE.get()
    if scope is not None and scope.former is not None:
        scope.former.setdefault(_numbered(_former_base(stack), scope.former_counts), name)
    return name


def _numbered(base: str, counts: dict) -> str:
    index = counts.get(base, 0)
    counts[base] = index + 1
    return base if index == 0 else f"{base}_{index}"


def _former_base(stack: str) -> str:
    """The name a site at `stack` (tags removed) had before site names were params paths, less
    its index: the name stack as linen spells it, the model's class name on top and a module
    re-entering its own method twice ("TransformerLM/Block_0/SelfAttention_0/SelfAttention_0/
    query/dot_general"); a wrapped NNX model's under its class name ("TransformerLM/blocks/0/
    mlp_in/dot_general")."""
    plain = scopes.plain(stack)
    return f"{plain}/dot_general" if plain else "dot_general"


def former_names(fn: Callable, *args, **kwargs) -> dict[str, str]:
    """`{former name: name}` for the fp8 sites that `fn(*args, **kwargs)` traces (as for
    `init_state`): the name each had before site names became params paths
    ("TinyTransformer/Block_0/SelfAttention_0/SelfAttention_0/query/dot_general" ->
    "Block_0/SelfAttention_0/query/dot_general"), one to one. A state stored under the former
    names is restored under the current ones with `renamed`."""
    former: dict[str, str] = {}
    token = _ACTIVE.set(_Scope(None, None, former=former))
    try:
        jax.eval_shape(lambda *a, **k: fn(*a, **k), *args, **kwargs)
    finally:
        _ACTIVE.reset(token)
    return former


def renamed(state: Fp8State, names: dict[str, str]) -> Fp8State:
    """`state` with each site named `names[site]` where `names` (`former_names`) has it.

    Raises ValueError where two sites would get one name (a state holding both spellings)."""
    sites: dict = {}
    for name, site in state.sites.items():
        new = names.get(name, name)
        if new in sites:
            raise ValueError(f"jamp.fp8: two sites of the state are both named {new!r} now")
        sites[new] = site
    return state.replace(sites=sites)
