"""Who hears of a wrapped NNX model's calls while they are traced: the observers registered with
`observing_calls` (each call's module path and class: `jamp.inspect` names a program's
operations by module so), and the collectors of `capturing_outputs` (each module's largest
output: `jamp.inspect`'s fp16 range table and overflow attribution). `jamp.nnx` reports every
call, the model's and its submodules', to both, through the stacks and helpers below, and
re-exports the two contexts (`jamp.nnx.capturing_outputs`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

# The `observing_calls` observers, which every call of a wrapped NNX model calls.
call_observers: list[Callable[[str, type, Any], None]] = []


@contextlib.contextmanager
def observing_calls(observe: Callable[[str, type, Any], None]):
    """Calls `observe(path, cls, setup)` for every call of a wrapped NNX model and of its
    submodules traced inside this context: `path` as NNX spells it ("blocks/0/attn"; "" for the
    model), `cls` the module's own class, `setup` (the model's call only) what the model was
    wrapped with: `.policy`, `.overrides`, `.activations`. `jamp.inspect` records calls so."""
    call_observers.append(observe)
    try:
        yield
    finally:
        call_observers.remove(observe)


# Output maxima: `capturing_outputs()` collectors (outside), and the record of the call being
# traced (inside: what the scoped methods write to).
capturing: list[dict[str, jax.Array]] = []
recording: list[tuple[dict[str, jax.Array], Any]] = []  # (record, the call's trace)


@contextlib.contextmanager
def capturing_outputs():
    """Collects, for every call of a wrapped NNX model inside this context, the largest |value|
    of each submodule's float outputs (`{path: float32 scalar}`, "" for the model's own output),
    as values of the caller's trace: NNX's counterpart of linen's `capture_intermediates`, for
    `jamp.inspect`'s range table and overflow attribution. A module called twice keeps its larger
    output; a non-finite output gives a non-finite maximum. Outside this context nothing is
    added to the program.

    Example::

      with jamp.nnx.capturing_outputs() as maxima:
          logits = model(x)
      maxima["blocks/0/attention"]  # a float32 scalar
    """
    collected: dict[str, jax.Array] = {}
    capturing.append(collected)
    try:
        yield collected
    finally:
        remove(capturing, collected)


def remove(stack: list, item) -> None:
    """Removes `item` itself from `stack` (not an equal dict: `list.remove` compares by ==)."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is item:
            del stack[i]
            return


def record_output(record: dict[str, jax.Array], path: str, out) -> None:
    floats = [
        jnp.max(jnp.abs(x.astype(jnp.float32)))
        for x in jax.tree.leaves(out)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) and x.size
    ]
    if floats:
        top = jnp.max(jnp.stack(floats))
        record[path] = jnp.maximum(record[path], top) if path in record else top


def merge_maxima(into: dict[str, jax.Array], maxima: Mapping[str, jax.Array]) -> None:
    for path, value in maxima.items():
        into[path] = jnp.maximum(into[path], value) if path in into else value
