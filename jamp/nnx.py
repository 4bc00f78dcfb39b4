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
so `jamp.inspect` splits an NNX model by module (`blocks/0/attn`).

`split(model)` is the functional side, for `jamp.make_train_step` (and so `jamp.parallel`'s
pmap and `jamp.sharding`'s sharded step): params and model state as pytrees for a
`jamp.TrainState`, and a loss function built from `loss(model, batch)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import types
import zlib
from typing import Any, Callable, Mapping, Optional, TypeGuard, TypeVar

import jax
import jax.numpy as jnp
import jmp
from flax import nnx

from jamp import activations as activations_lib
from jamp import jax_compat, precision, scopes
from jamp import overrides as overrides_lib
from jamp.engine import AttentionFusion, fusion_key, rewrite

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

_call_observers: list[Callable[[str, type, Any], None]] = []


@contextlib.contextmanager
def observing_calls(observe: Callable[[str, type, Any], None]):
    """Calls `observe(path, cls, setup)` for every call of a wrapped NNX model and of its
    submodules traced inside this context: `path` as NNX spells it ("blocks/0/attn"; "" for the
    model), `cls` the module's own class, `setup` (the model's call only) what the model was
    wrapped with: `.policy`, `.overrides`, `.activations`. `jamp.inspect` records calls so."""
    _call_observers.append(observe)
    try:
        yield
    finally:
        _call_observers.remove(observe)


# Output maxima: `capturing_outputs()` collectors (outside), and the record of the call being
# traced (inside: what the scoped methods write to).
_capturing: list[dict[str, jax.Array]] = []
_recording: list[tuple[dict[str, jax.Array], Any]] = []  # (record, the call's trace)


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
    _capturing.append(collected)
    try:
        yield collected
    finally:
        _remove(_capturing, collected)


def _remove(stack: list, item) -> None:
    """Removes `item` itself from `stack` (not an equal dict: `list.remove` compares by ==)."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is item:
            del stack[i]
            return


def _record_output(record: dict[str, jax.Array], path: str, out) -> None:
    floats = [
        jnp.max(jnp.abs(x.astype(jnp.float32)))
        for x in jax.tree.leaves(out)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) and x.size
    ]
    if floats:
        top = jnp.max(jnp.stack(floats))
        record[path] = jnp.maximum(record[path], top) if path in record else top


def _merge_maxima(into: dict[str, jax.Array], maxima: Mapping[str, jax.Array]) -> None:
    for path, value in maxima.items():
        into[path] = jnp.maximum(into[path], value) if path in into else value


@functools.lru_cache(maxsize=None)
def _scoped_class(cls: type, path: tuple, original: type) -> type:
    """`cls` whose methods run in the name scope of the submodule at `path`."""
    scope = scopes.call_scope(path)
    spelled = "/".join(map(str, path))

    def scoped(fn, records: bool):
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            for observe in tuple(_call_observers):
                observe(spelled, original, None)
            with jax.named_scope(scope):
                out = fn(self, *args, **kwargs)
                # Outputs of calls, as linen's capture_intermediates: not of other methods (a
                # mask, a tied head's `attend`), nor of calls inside a transform of the model's
                # program (nnx.scan, nnx.remat, vmap, cond), whose values live in that trace.
                if records and _recording and jax_compat.current_trace() is _recording[-1][1]:
                    _record_output(_recording[-1][0], spelled, out)
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
        for observe in tuple(_call_observers):
            observe("", setup.original, setup)
        shape = nnx.graphdef(copy)
        before = {path: v.get_value() for path, v in _variables(copies).items()}
        # The user's method: from above the wrapping class (which runs this), whatever the copy's
        # own class is.
        wrapping = next(c for c in type(copy).__mro__ if "_jamp_setup" in vars(c))
        method = getattr(super(wrapping, copy), name)
        index = overrides_lib.first_match(setup.overrides, copy, ())
        maxima: dict[str, jax.Array] = {}
        entry = (maxima, jax_compat.current_trace())
        if capture:
            _recording.append(entry)
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
                    _record_output(maxima, "", out)
        finally:
            if capture:
                _remove(_recording, entry)
        after = {path: v.get_value() for path, v in _variables(copies).items()}
        new = [path for path in after if path not in before]
        where = f"{setup.original.__name__}.{name}"
        if new:
            raise ValueError(
                f"{where} created variables during the call "
                f"({', '.join('/'.join(map(str, p)) for p in new[:3])}); a jamp-wrapped NNX "
                "module must create its variables (caches, sown intermediates) before it is "
                "wrapped."
            )
        if nnx.graphdef(copy) != shape:
            raise ValueError(
                f"{where} changed the module's attributes (not its variables) during the call, "
                "which a jamp-wrapped NNX module cannot carry back; keep such state in an "
                "nnx.Variable, or set it on the module before wrapping."
            )
        changed[:] = [path for path in after if after[path] is not before[path]]
        leaves, static["treedef"] = jax.tree.flatten(out)
        static["leaves"] = {i: x for i, x in enumerate(leaves) if not isinstance(x, jax.Array)}
        arrays = [x for i, x in enumerate(leaves) if i not in static["leaves"]]
        return arrays, [after[path] for path in changed], maxima

    # Fixed for this call's trace. A wrapped model called inside another's call (nested) does not
    # capture: its values live in the outer call's trace, which the collectors cannot see.
    nested = bool(_recording)
    capture = bool(_capturing) and not nested
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
        for collected in _capturing:
            _merge_maxima(collected, maxima)
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


# ----- the functional side: jamp.make_train_step's loss function for an NNX model

#: The state `split` keeps in `model_state` (what the step averages, selects and checkpoints):
#: everything but params and RNG streams, which the step reseeds from its own key.
MODEL_STATE = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))


def _stream_names(rng_state) -> tuple[str, ...]:
    names = {leaf.tag for leaf in jax.tree.leaves(rng_state, is_leaf=_is_key) if _is_key(leaf)}
    return tuple(sorted(names))


def _is_key(x) -> bool:
    return isinstance(x, nnx.RngKey)  # an NNX state holds the variables themselves


@dataclasses.dataclass(frozen=True)
class Functional:
    """An NNX model as `jamp.make_train_step` takes it; build it with `split`."""

    graphdef: Any
    rng_state: Any
    streams: tuple[str, ...]

    def merge(self, params, model_state) -> nnx.Module:
        """The NNX model with these params and model state (e.g. a trained `TrainState`'s)."""
        # Variables made anew in the caller's trace: NNX lets a trace mutate only the variables
        # created in it (the loss updates batch statistics and reseeds the RNG streams).
        states = jax.tree.map(lambda leaf: leaf, (params, self.rng_state, model_state))
        return nnx.merge(self.graphdef, *states)

    def seeded(self, params, model_state, rng) -> nnx.Module:
        """`merge`, with the model's RNG streams (dropout) seeded from `rng`."""
        model = self.merge(params, model_state)
        if self.streams:
            keys = {s: jax.random.fold_in(rng, zlib.crc32(s.encode())) for s in self.streams}
            nnx.reseed(model, **keys)  # type: ignore[arg-type]  # keys: stream names, not graph= / policy=
        return model

    def loss_fn(self, loss: Callable) -> Callable:
        """jamp's `loss_fn(params, model_state, batch, rng)` from `loss(model, batch)`, which
        returns the loss or `(loss, metrics)`; the model runs in training mode (`train()`),
        with its RNG streams (dropout) seeded from the step's key."""

        def loss_fn(params, model_state, batch, rng):
            model = self.seeded(params, model_state, rng)
            model.train()
            out = loss(model, batch)
            value, metrics = out if isinstance(out, tuple) else (out, {})
            return value, (nnx.state(model, MODEL_STATE), dict(metrics))

        return loss_fn

    def eval_fn(self, metrics: Callable) -> Callable:
        """jamp's `eval_fn(params, model_state, batch)` from `metrics(model, batch) -> dict`;
        the model runs in evaluation mode (`eval()`)."""

        def eval_fn(params, model_state, batch):
            model = self.merge(params, model_state)
            model.eval()
            return metrics(model, batch)

        return eval_fn


def split(model: nnx.Module) -> tuple[Functional, Any, Any]:
    """`(functional, params, model_state)` of an NNX model, for a `jamp.TrainState`.

    `params` holds the `nnx.Param`s, `model_state` the other variables (batch statistics and
    the like) except RNG streams, which `functional.loss_fn` reseeds from the step's key (so that
    replicas draw different dropout masks and a resumed run draws the same ones).
    """
    if not is_module(model):
        raise TypeError(f"jamp.nnx.split expects an nnx.Module, got {type(model).__name__}.")
    graphdef, *states = nnx.split(model, nnx.Param, nnx.RngState, ...)
    params, rng_state, model_state = states
    return Functional(graphdef, rng_state, _stream_names(rng_state)), params, model_state
