"""Run a Flax NNX module, unmodified, under a precision policy, and train it with jamp's step.

`jamp.wrap(module, policy)` on an `nnx.Module` returns a copy of it (the same variables, in
the same places: a checkpoint of one restores into the other) whose class is a subclass of the
module's that runs every call under the policy: `model(x)` and the model's own public methods
(`model.encode(x)`) take the path of `jamp.autocast` (every matmul and convolution, forward and
backward, in the compute dtype with float32 accumulation and float32 gradients; the fragile
operations in float32). It is used like the module: called directly or under `nnx.jit`,
`nnx.grad`, `nnx.value_and_grad`, with `nnx.Optimizer`, `nnx.split` / `nnx.merge`, dropout
drawing from its `nnx.Rngs`, `train()` / `eval()`. Its params stay float32 `nnx.Param`s, and
`BatchNorm`, `LayerNorm`, `GroupNorm`, `RMSNorm`, `InstanceNorm` (and any class named like one)
run in float32 with float32 statistics; overrides match NNX module classes and attribute paths
("blocks/0/attn", "*/head").

How a call runs: the module is split into its graph and state, merged again inside a trace that
`jamp.autocast`'s interpreter rewrites, and the variables the call changed (batch statistics,
RNG counts) are written back to the module. Overridden submodules of the merged copy get a class
that marks their calls on the traced program (`jamp.overrides`), and every submodule's calls run
in a name scope holding its attribute path (`CALL_SCOPE`), as Flax linen names its modules' calls,
so `jamp.inspect` splits an NNX model by module (`blocks/0/attn`). Every call is reported to the
observers and output collectors of `jamp.nnx_observers` (`observing_calls`, `capturing_outputs`).

`split(model)` is the functional side (`jamp.nnx_functional`), for `jamp.make_train_step` (and so
`jamp.parallel`'s pmap and `jamp.sharding`'s sharded step): params and model state as pytrees for
a `jamp.TrainState`, and a loss function built from `loss(model, batch)`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import Any, Callable, Mapping, Optional, TypeGuard, TypeVar

import jax
import jmp
from flax import nnx

from jamp import activations as activations_lib
from jamp import jax_compat, precision, scopes
from jamp import nnx_observers as observers
from jamp import overrides as overrides_lib
from jamp.engine import AttentionFusion, fusion_key, rewrite

# The functional side for the train step, and the observers of calls, each a module of its own;
# re-exported here, where their users reach them (`jamp.nnx.split`, `jamp.nnx.capturing_outputs`).
from jamp.nnx_functional import MODEL_STATE, Functional, split  # noqa: F401
from jamp.nnx_observers import capturing_outputs, observing_calls  # noqa: F401

#: NNX module classes that run in float32 unless `overrides` says otherwise.
FP32_MODULES: tuple[type, ...] = (
    nnx.BatchNorm,
    nnx.LayerNorm,
    nnx.GroupNorm,
    nnx.RMSNorm,
    nnx.InstanceNorm,
)


def is_module(value) -> TypeGuard[nnx.Module]:
    return isinstance(value, nnx.Module)


_N = TypeVar("_N")


def _nodes(root, kind: type[_N]) -> list[tuple[tuple, _N]]:
    """`(path, node)` for every node of `kind` in `root`'s graph (each shared node once)."""
    return [(path, node) for path, node in nnx.iter_graph(root) if isinstance(node, kind)]


def _variables(root) -> dict[tuple, nnx.Variable]:
    return dict(_nodes(root, nnx.Variable))


def _own_methods(cls) -> dict[str, Callable]:
    """The methods a user's module classes define (`__call__` and public ones), nearest first;
    not those of `nnx.Module` itself (`train`, `eval`, `sow`, ...)."""
    found: dict[str, Callable] = {}
    for klass in cls.__mro__:
        if not issubclass(klass, nnx.Module) or klass.__module__.startswith("flax.nnx.module"):
            continue
        if klass.__module__.startswith("flax.nnx.pytreelib"):
            continue
        for name, attr in vars(klass).items():
            if name == "__call__" or (not name.startswith("_") and inspect.isfunction(attr)):
                found.setdefault(name, attr)
    return found


def _policy_methods(cls) -> dict[str, Callable]:
    """The methods a wrapped model runs under the policy: `__call__`, and the public methods of
    the user's own classes (`encode`, `generate`) except setters (`set_*`); not those of Flax's
    layers (`set_view`, `set_mode`), which configure the module rather than compute."""
    return {
        name: fn
        for name, fn in _own_methods(cls).items()
        if name == "__call__"
        or not (
            name.startswith("set_") or _defining_class(cls, name).__module__.startswith("flax.")
        )
    }


def _defining_class(cls, name):
    return next(klass for klass in cls.__mro__ if name in vars(klass))


@functools.lru_cache(maxsize=None)
def _tagged_class(cls: type, index: int, policy: jmp.Policy) -> type:
    """`cls` whose methods run as override `index` (policy `policy`) of the traced program."""

    def tagged(fn):
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            with overrides_lib.running_under(index, policy, self, args, kwargs) as (a, kw):
                return overrides_lib.cast_output(policy, fn(self, *a, **kw))

        return method

    body = {name: tagged(fn) for name, fn in _own_methods(cls).items()}
    body["__module__"] = cls.__module__
    body["__qualname__"] = cls.__qualname__
    return types.new_class(cls.__name__, (cls,), {}, lambda ns: ns.update(body))


def _tag_overridden(root, pairs) -> None:
    """Give each overridden submodule of a merged copy its marking class."""
    for path, module in _nodes(root, nnx.Module):
        index = overrides_lib.first_match(pairs, module, path)
        if index is not None and path:  # the root's policy is the wrapper's own
            module.__class__ = _tagged_class(type(module), index, pairs[index][1])


#: The name scope of a wrapped NNX model's submodule calls: `jamp_nnx(blocks.0.attn)`, the
#: attribute path with "." between its parts (a "/" would split the scope in JAX's name stack).
CALL_SCOPE = scopes.CALL_SCOPE
#: The name scope of a wrapped NNX model's own call: `jamp_nnx_root(TransformerLM)`.
ROOT_SCOPE = scopes.ROOT_SCOPE


@functools.lru_cache(maxsize=None)
def _scoped_class(cls: type, path: tuple, original: type) -> type:
    """`cls` whose methods run in the name scope of the submodule at `path`."""
    scope = scopes.call_scope(path)
    spelled = "/".join(map(str, path))

    def scoped(fn, records: bool):
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            for observe in tuple(observers.call_observers):
                observe(spelled, original, None)
            with jax.named_scope(scope):
                out = fn(self, *args, **kwargs)
                # Outputs of calls, as linen's capture_intermediates: not of other methods (a
                # mask, a tied head's `attend`), nor of calls inside a transform of the model's
                # program (nnx.scan, nnx.remat, vmap, cond), whose values live in that trace.
                if (
                    records
                    and observers.recording
                    and jax_compat.current_trace() is observers.recording[-1][1]
                ):
                    observers.record_output(observers.recording[-1][0], spelled, out)
                return out

        return method

    body: dict[str, Any] = {
        name: scoped(fn, name == "__call__") for name, fn in _own_methods(cls).items()
    }
    body["__module__"] = cls.__module__
    body["__qualname__"] = cls.__qualname__
    return types.new_class(cls.__name__, (cls,), {}, lambda ns: ns.update(body))


def _scope_calls(root, originals: Mapping[tuple, type]) -> None:
    """Give each submodule of a merged copy the class that names its calls by its path; a
    wrapped model inside (and what is under it) is left to name its own calls when it runs."""
    nested = [path for path, module in _nodes(root, nnx.Module) if path and is_wrapped(module)]
    for path, module in _nodes(root, nnx.Module):
        if path and not any(path[: len(n)] == n for n in nested):
            module.__class__ = _scoped_class(type(module), path, originals[path])


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What a wrapped class runs under (a class attribute: part of the graph's static type)."""

    policy: jmp.Policy
    overrides: tuple
    activations: str
    original: type
    fuse_attention: Any = True  # `jamp.engine.fusion_key`: a bool, or (pattern, bool) pairs


def _is_node(x) -> bool:
    return nnx.graph.is_graph_node(x)


def _call(copy, setup: _Setup, name: str, call_args, call_kwargs, capture: bool):
    """The user's method `name` on `copy`, in the model's named scope and under the override the
    model itself matches, if any; returns its output and the maxima recorded when capturing."""
    # The user's method: from above the wrapping class (which runs this), whatever the copy's own
    # class is.
    wrapping = next(c for c in type(copy).__mro__ if "_jamp_setup" in vars(c))
    method = getattr(super(wrapping, copy), name)
    index = overrides_lib.first_match(setup.overrides, copy, ())
    maxima: dict[str, jax.Array] = {}
    entry = (maxima, jax_compat.current_trace())
    if capture:
        observers.recording.append(entry)
    try:
        with jax.named_scope(scopes.root_scope(setup.original.__name__)):
            if index is None:
                out = method(*call_args, **call_kwargs)
            else:  # the model itself matches an override (a wrapped LayerNorm is a norm)
                policy = setup.overrides[index][1]
                with overrides_lib.running_under(
                    index, policy, copy, call_args, call_kwargs
                ) as cast:
                    out = overrides_lib.cast_output(policy, method(*cast[0], **cast[1]))
            if capture:
                observers.record_output(maxima, "", out)
    finally:
        if capture:
            observers.remove(observers.recording, entry)
    return out, maxima


def _check_carried_back(where: str, before: dict, after: dict, changed_shape: bool) -> None:
    """Refuses a call that created variables or changed the module's attributes: what a wrapped
    module's call changes must be variables it had, to be written back after the rewrite."""
    new = [path for path in after if path not in before]
    if new:
        raise ValueError(
            f"{where} created variables during the call "
            f"({', '.join('/'.join(map(str, p)) for p in new[:3])}); a jamp-wrapped NNX "
            "module must create its variables (caches, sown intermediates) before it is "
            "wrapped."
        )
    if changed_shape:
        raise ValueError(
            f"{where} changed the module's attributes (not its variables) during the call, "
            "which a jamp-wrapped NNX module cannot carry back; keep such state in an "
            "nnx.Variable, or set it on the module before wrapping."
        )


def _run(module, setup: _Setup, name: str, args, kwargs):
    """`module.<name>(*args, **kwargs)` of the original class, under the policy."""
    # NNX objects among the arguments (an `nnx.Rngs`, another module) travel with the module, so
    # that what the call changes in them (RNG counts, statistics) is written back to them too.
    arg_leaves, arg_def = jax.tree.flatten((args, kwargs), is_leaf=_is_node)
    at = [i for i, leaf in enumerate(arg_leaves) if _is_node(leaf)]
    nodes = (module, *(arg_leaves[i] for i in at))
    graphdef, state = nnx.split(nodes)
    data = [leaf for i, leaf in enumerate(arg_leaves) if i not in at]
    changed: list[tuple] = []
    static: dict = {}  # the output's structure and its leaves that are not arrays

    def traced(state, data):
        copies = nnx.merge(graphdef, state)
        copy, it = copies[0], iter(copies[1:])
        values = iter(data)
        leaves = [next(it) if i in at else next(values) for i in range(len(arg_leaves))]
        call_args, call_kwargs = jax.tree.unflatten(arg_def, leaves)
        originals = {path: type(module) for path, module in _nodes(copy, nnx.Module)}
        _tag_overridden(copy, setup.overrides)
        _scope_calls(copy, originals)
        for observe in tuple(observers.call_observers):
            observe("", setup.original, setup)
        shape = nnx.graphdef(copy)
        before = {path: v.get_value() for path, v in _variables(copies).items()}
        out, maxima = _call(copy, setup, name, call_args, call_kwargs, capture)
        after = {path: v.get_value() for path, v in _variables(copies).items()}
        where = f"{setup.original.__name__}.{name}"
        _check_carried_back(where, before, after, nnx.graphdef(copy) != shape)
        changed[:] = [path for path in after if after[path] is not before[path]]
        leaves, static["treedef"] = jax.tree.flatten(out)
        static["leaves"] = {i: x for i, x in enumerate(leaves) if not isinstance(x, jax.Array)}
        arrays = [x for i, x in enumerate(leaves) if i not in static["leaves"]]
        return arrays, [after[path] for path in changed], maxima

    # Fixed for this call's trace. A wrapped model called inside another's call (nested) does not
    # capture: its values live in the outer call's trace, which the collectors cannot see.
    nested = bool(observers.recording)
    capture = bool(observers.capturing) and not nested
    arrays, values, maxima = rewrite(
        traced,
        precision.autocast_dtype(setup.policy),
        overrides_lib.compute_for(setup.overrides),
        activations=setup.activations,
        weak_argnums=(0,),  # the module's variables: see `jamp.activations` on weak values
        reduce_dtype=precision.reduce_dtype(setup.policy),
        fuse_attention=setup.fuse_attention,
    )(state, data)
    if capture:
        for collected in observers.capturing:
            observers.merge_maxima(collected, maxima)
    variables = _variables(nodes)
    for path, value in zip(changed, values):  # batch statistics, RNG counts, caches
        variables[path].set_value(value)
    it = iter(arrays)  # a method may also return Python values (a count, a config): as they were
    leaves = [
        static["leaves"][i] if i in static["leaves"] else next(it)
        for i in range(static["treedef"].num_leaves)
    ]
    return setup.policy.cast_to_output(jax.tree.unflatten(static["treedef"], leaves))


def _under_policy(name: str):
    def method(self, *args, **kwargs):
        return _run(self, type(self)._jamp_setup, name, args, kwargs)

    method.__name__ = name
    return method


@functools.lru_cache(maxsize=None)
def _wrapped_class(cls: type, setup: _Setup) -> type:
    body = {name: _under_policy(name) for name in _policy_methods(cls)}
    body["_jamp_setup"] = setup
    body["__module__"] = cls.__module__
    body["__qualname__"] = cls.__qualname__
    body["__doc__"] = f"{cls.__name__} under the policy {precision.describe(setup.policy)}."
    return types.new_class(cls.__name__, (cls,), {}, lambda ns: ns.update(body))


def is_wrapped(module) -> bool:
    return getattr(type(module), "_jamp_setup", None) is not None


def wrap(
    module: nnx.Module,
    policy,
    overrides: Optional[Mapping[Any, Any]] = None,
    *,
    activations: str = "auto",
    fuse_attention: AttentionFusion = True,
) -> nnx.Module:
    """An NNX module under a precision policy: see the module docstring and `jamp.wrap`.

    Returns a copy of `module` (a shallow one: its arrays are shared, its variables are its own)
    with the same state, whose class is a subclass of `module`'s; `module` is left as it was.
    Float params are cast to the policy's param dtype.
    """
    if is_wrapped(module):
        raise ValueError("module is already wrapped; wrap the original module once.")
    policy, pairs = overrides_lib.resolve(policy, overrides, FP32_MODULES, (nnx.Embed,))
    activations_lib.resolve(activations)  # reject a bad value here, with the accepted ones
    fusion = fusion_key(fuse_attention)  # a bad value fails here, in one line
    setup = _Setup(policy, pairs, activations, type(module), fusion)
    copy = nnx.clone(module)
    for _, param in _nodes(copy, nnx.Param):
        value = param.get_value()
        if hasattr(value, "dtype") and jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
            param.set_value(value.astype(policy.param_dtype))
    copy.__class__ = _wrapped_class(type(module), setup)
    return copy


def module_policies(model: nnx.Module, *args, **kwargs) -> dict[str, jmp.Policy]:
    """The policy each submodule of a wrapped NNX model runs under, by attribute path
    ("blocks/0/attention"; "" for the model), as `jamp.module_policies` gives a linen model's.

    One abstract (shape-only) call of `model(*args, **kwargs)`, which changes nothing in `model`;
    a submodule that no override matches runs under the policy of the nearest module above it
    that one does (the model's own otherwise). The paths come in the order their calls finish (a
    child before its parent, the model itself, "", last): the order a forward overflow travels
    in. Modules the call does not reach are left out; so are the submodules of a wrapped model
    within this one, which name their calls by their own paths and run under their own setup.

    Example::

      policies = jamp.nnx.module_policies(model, x)  # {"conv1": Policy(...), ..., "": ...}
    """
    if not is_wrapped(model):
        raise TypeError(f"module_policies takes a jamp.wrap-ped NNX module, got {type(model)}")
    setup: _Setup = type(model)._jamp_setup  # type: ignore[attr-defined]  # is_wrapped: set
    starts: list[str] = []
    graphdef, state = nnx.split(model)

    def call(state, args, kwargs):
        return nnx.merge(graphdef, state)(*args, **kwargs)

    with observing_calls(lambda path, cls, call_setup: starts.append(path)):
        jax.eval_shape(call, state, args, kwargs)
    modules = {"/".join(map(str, path)): (path, node) for path, node in _nodes(model, nnx.Module)}
    policies: dict[str, jmp.Policy] = {}
    for spelled in _finish_order(starts):
        if spelled not in modules:
            continue
        path, _ = modules[spelled]
        policy = setup.policy
        for depth in range(len(path) + 1):  # the innermost matching override wins
            prefix = "/".join(map(str, path[:depth]))
            if prefix in modules:
                index = overrides_lib.first_match(setup.overrides, modules[prefix][1], path[:depth])
                policy = setup.overrides[index][1] if index is not None else policy
        policies[spelled] = policy
    return policies


def _finish_order(starts: list[str]) -> list[str]:
    """Module paths in the order their calls finish, from the order they start: a call ends
    before the next call that is not inside it (by path) starts; each path once, first finish."""
    done: dict[str, None] = {}
    stack: list[str] = []

    def inside(path: str, outer: str) -> bool:
        return outer == "" or path == outer or path.startswith(outer + "/")

    for path in starts:
        while stack and not inside(path, stack[-1]):
            done.setdefault(stack.pop())
        stack.append(path)
    while stack:
        done.setdefault(stack.pop())
    return list(done)
