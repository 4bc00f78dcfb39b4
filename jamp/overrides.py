"""Override rules shared by every way of running a model under a policy (linen, NNX).

An override maps a key to a policy: a module class (matched with isinstance), a class-name
ending (`NamedLike`, how other libraries' normalization layers are found) or a path pattern
(fnmatch against the submodule path, "/"-joined). A call of a matched module is marked on the
traced program with a name scope holding the override's index (`tag`), and `compute_for` reads
that mark back from each equation's name stack, so the interpreter in `jamp.autocast` runs the
module's equations in the override's compute dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jmp

from jamp import precision
from jamp.precision import get_policy

PolicyLike = Union[str, jmp.Policy]
OverrideKey = Union[type, str]

#: Normalization layers of other libraries are their own classes (flaxmodels' BatchNorm, Hugging
#: Face's FlaxT5LayerNorm and FlaxLlamaRMSNorm, ...): a class whose name, or a base class's, ends
#: in one of these (any case) runs in float32 too.
FP32_MODULE_NAME_SUFFIXES: tuple[str, ...] = (
    "BatchNorm",
    "LayerNorm",
    "GroupNorm",
    "RMSNorm",
    "InstanceNorm",
)

#: The prefix of the name scope that marks an overridden module's call (`jamp.inspect` reads it).
TAG_PREFIX = "jamp_policy_"


def tag(index: int) -> str:
    """The name scope that marks a call of the module matched by override `index`."""
    return f"{TAG_PREFIX}{index}_"


#: The name scope of an overridden module's output cast (`cast_output`). Under 16-bit activations
#: the engine carries a 16-bit output through it as it is: an override that only changes the
#: compute dtype (fp8's embeddings in bf16) must not turn what follows into float32 activations.
OUTPUT_SCOPE = "jamp_override_output"


def cast_output(policy: jmp.Policy, out):
    """An overridden module's result in `policy`'s output dtype, cast under `OUTPUT_SCOPE`."""
    with jax.named_scope(OUTPUT_SCOPE):
        return policy.cast_to_output(out)


def tag_index(name_stack: str) -> Optional[int]:
    """The index of the innermost policy tag on a name stack, if any."""
    at = name_stack.rfind(TAG_PREFIX)
    if at < 0:
        return None
    digits = name_stack[at + len(TAG_PREFIX) :].split("_", 1)[0]
    return int(digits)


@dataclasses.dataclass(frozen=True)
class NamedLike:
    """An override key matching module classes by the ending of their (or a base's) name."""

    suffixes: tuple[str, ...]

    def matches(self, module: Any) -> bool:
        ends = tuple(s.lower() for s in self.suffixes)
        return any(cls.__name__.lower().endswith(ends) for cls in type(module).__mro__)


def matches(key, module: Any, path: Sequence[Any]) -> bool:
    if isinstance(key, type):
        return isinstance(module, key)
    if isinstance(key, NamedLike):
        return key.matches(module)
    return fnmatch.fnmatchcase("/".join(str(p) for p in path), key)


def first_match(pairs, module: Any, path: Sequence[Any]) -> Optional[int]:
    """The index of the first override in `pairs` that matches `module` at `path`."""
    for index, (key, _) in enumerate(pairs):
        if matches(key, module, path):
            return index
    return None


def resolve(
    policy: PolicyLike,
    overrides: Optional[Mapping[OverrideKey, PolicyLike]],
    fp32_classes: Sequence[type],
    embed_classes: Sequence[type] = (),
) -> tuple[jmp.Policy, tuple[tuple[Any, jmp.Policy], ...]]:
    """The policy and the override pairs, in matching order: the user's first; then, under an fp8
    policy, embeddings in its 16-bit form (a tied head's `attend` stays 16-bit); then the
    normalization classes and class names in float32."""
    for key in overrides or {}:
        if not isinstance(key, (type, str)):
            raise TypeError(
                f"override key {key!r}: expected a module class or a path pattern (a string)."
            )
    pairs: list[tuple[Any, jmp.Policy]] = [
        (key, get_policy(p)) for key, p in (overrides or {}).items()
    ]
    policy = get_policy(policy)
    fp32 = get_policy("float32")
    if precision.is_fp8(policy):
        pairs += [(cls, precision.without_fp8(policy)) for cls in embed_classes]
    pairs += [(cls, fp32) for cls in fp32_classes]
    pairs.append((NamedLike(FP32_MODULE_NAME_SUFFIXES), fp32))
    return policy, tuple(pairs)


def compute_for(pairs):
    """The `jamp.autocast` per-equation choice that reads the override tags."""

    def choose(eqn, inherited):
        index = tag_index(str(eqn.source_info.name_stack))
        return inherited if index is None else precision.autocast_dtype(pairs[index][1])

    return choose


@contextlib.contextmanager
def computing_in(module: Any, dtype):
    """Make a layer with a `dtype` attribute compute in `dtype` for the duration of one call.

    Casting a layer's inputs is not enough: Flax layers cast to their own `dtype` attribute (a
    LayerNorm built with `dtype=jnp.bfloat16` normalizes in bf16 whatever it is given). The module
    is a per-call copy (a bound linen clone, or an NNX module merged for this trace), so setting
    the attribute for the call changes nothing outside it.
    """
    if dataclasses.is_dataclass(module):  # linen: frozen dataclasses
        has = "dtype" in {f.name for f in dataclasses.fields(module)}
    else:  # NNX: plain attributes
        has = "dtype" in vars(module)
    if not has:
        yield
        return
    saved = module.dtype
    object.__setattr__(module, "dtype", dtype)
    try:
        yield
    finally:
        object.__setattr__(module, "dtype", saved)


@contextlib.contextmanager
def running_under(index: int, policy: jmp.Policy, module: Any, args, kwargs):
    """One call of an overridden module: tagged, in its policy's compute dtype; yields the cast
    arguments; the caller casts the result with `cast_output`."""
    with jax.named_scope(tag(index)), computing_in(module, policy.compute_dtype):
        yield policy.cast_to_compute((args, kwargs))
