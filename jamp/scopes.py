"""The name scopes jamp opens around a wrapped NNX model's calls, and what they say.

Flax linen names every module call's scope by the module's name, so a traced equation's name
stack reads `TransformerLM/DecoderBlock_0/Dense_0`. NNX opens no scopes; a `jamp.wrap`ped NNX
model opens them instead: its own call in `jamp_nnx_root(TransformerLM)` (`ROOT_SCOPE`), each
submodule's calls in one holding its whole attribute path, `jamp_nnx(blocks.0.attention)`
(`CALL_SCOPE`; "." between the parts, as a "/" would split the scope in JAX's name stack).
`jamp.inspect` and the fp8 site names read them back (`plain`).

`SUM_SCOPE` names no module: jamp's engine sums a 16-bit operand's gradient over the axes it was
broadcast along (a position embedding's, over the batch) as a product with ones in it, so that
those GEMMs are told apart from the layer's own; module paths leave it out.
"""

from __future__ import annotations

import re

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
