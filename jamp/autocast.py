"""Op-level autocast for any JAX function: `autocast(fn, policy)` (`jamp.autocast`).

A plain function, a Haiku or Equinox apply, or an Equinox module runs under a policy, with
overrides by name-scope path; the program is rewritten by `jamp.engine`.

Example::

  loss = jamp.autocast(lambda w, x: jnp.tanh(x @ w).sum(), "mixed_bfloat16")(w, x)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any, Callable, Sequence

import jax
from jax import custom_batching

from jamp import activations as act
from jamp import jax_compat, precision
from jamp.engine import AttentionFusion, ComputeFor, _rewrite, fusion_key, placing, rewrite

__all__ = ["autocast", "placing", "rewrite", "NORM_SCOPE_SUFFIXES"]


#: A name scope named like a normalization layer ("eqx.nn.LayerNorm", "rms_norm",
#: "vmap(BatchNorm)": letters only, any case) runs in float32 unless an override matches first.
NORM_SCOPE_SUFFIXES = ("batchnorm", "layernorm", "groupnorm", "rmsnorm", "instancenorm")
_NORM_SCOPES = object()  # the override key of that rule


def _scope_matches(key, parts) -> bool:
    if key is _NORM_SCOPES:
        letters = "".join(c for c in parts[-1].lower() if c.isalpha())
        return letters.endswith(NORM_SCOPE_SUFFIXES)
    return fnmatch.fnmatchcase("/".join(parts), key)


def _scope_rules(pairs) -> ComputeFor:
    """`compute_for` from (name-scope pattern, policy) pairs: an equation runs under the first
    pair that matches its innermost scope path, or an enclosing one (the longest path is tried
    first); otherwise it inherits its enclosing equation's choice."""
    chosen: dict[str, Any] = {}

    def choose(eqn, inherited, prefix=""):
        stack = "/".join(s for s in (prefix, str(eqn.source_info.name_stack)) if s)
        if stack not in chosen:
            parts = stack.split("/") if stack else []
            chosen[stack] = next(
                (
                    precision.autocast_dtype(policy)
                    for n in range(len(parts), 0, -1)
                    for key, policy in pairs
                    if _scope_matches(key, parts[:n])
                ),
                _INHERIT,
            )
        dtype = chosen[stack]
        return inherited if dtype is _INHERIT else dtype

    choose.reads_scope_prefix = True  # type: ignore[attr-defined]  # a function attribute (mypy#2087)
    return choose


_INHERIT = object()


def _array_leaves(tree) -> bool:
    leaves = jax.tree.leaves(tree)
    return not (len(leaves) == 1 and leaves[0] is tree) and any(map(_rewrite.is_traceable, leaves))


def autocast(
    fn: Callable,
    policy,
    *,
    overrides=None,
    activations: str = "auto",
    params_argnums: Sequence[int] = (),
    fuse_attention: AttentionFusion = True,
) -> Callable:
    """Return `fn`, any JAX function, running under a precision policy.

    Every matmul and convolution in the traced program, forward and backward, takes its operands
    in the policy's compute dtype and accumulates in float32; gradients reach float32 inputs in
    float32; sums, exponentials, normalization statistics and the other fragile operations stay
    float32 (`jamp.activations`); the function's float outputs are cast to the policy's output
    dtype. This reaches what no `dtype=` argument controls: matmuls inside `jit`, `scan`, `cond`,
    `while_loop`, `remat` and `shard_map`, and layers that hard-code their dtype. Under the
    float32 policy a float32 function runs exactly as written.

    Args:
      fn: a function of arrays and pytrees of arrays (other leaves are passed through as static
        values); or a callable pytree with array leaves, such as an Equinox module, whose leaves
        are then the parameters (as if passed at a `params_argnums` position).
      policy: a `jmp.Policy` or any spec `jamp.get_policy` accepts, e.g. "mixed_bfloat16".
      overrides: maps name-scope path patterns to policies: an operation whose `jax.named_scope`
        path (e.g. "decoder/head/dense"), or an enclosing part of it ("decoder/head"), matches a
        pattern (fnmatch, e.g. "*/head") runs under that pattern's policy; the first pattern in
        the mapping wins, the innermost scope before the outer ones. Where `fn` sets no name
        scopes there is nothing to match. After these, a scope named like a normalization layer
        (`NORM_SCOPE_SUFFIXES`: Equinox's "eqx.nn.LayerNorm", "rms_norm", ...) runs in float32.
      activations: where the float32 values between matmuls live under a 16-bit compute dtype:
        "float32" (as traced), "compute" (16-bit where `jamp.activations` allows) or "auto"
        (float32 on CPUs, compute elsewhere).
      params_argnums: the positional arguments that hold parameters: fp8 policies take a matmul
        with exactly one operand made of them alone as a layer's (fp8; without parameters no
        matmul is fp8), and with 16-bit activations they take the dtype of the activations they
        meet instead of promoting them.
      fuse_attention: under a 16-bit policy each attention recognised in the program runs as
        one call (cuDNN's fused kernel on NVIDIA GPUs); False leaves every attention as traced,
        and a mapping of name-scope path patterns to True / False decides per scope (the first
        pattern matching the path, or an enclosing part of it, decides; fused where none does).

    Under `jax.vmap` (Equinox's `jax.vmap(model)(x)`), the batched program is the one rewritten,
    so its matmuls are the batched ones, forward and backward, as `jamp.autocast` of the whole
    loss gives.

    Returns:
      A function with `fn`'s signature; for a callable pytree (an Equinox module, an Equinox
      filtered transform), an `Autocast`: called as `fn` is and a pytree with `fn`'s leaves, so
      that `model = jamp.autocast(model, policy)` once, outside the loss, trains `model`'s
      parameters (`.fn` is the module).

    Example::

      loss = jamp.autocast(lambda w, x: jnp.tanh(x @ w).sum(), "mixed_bfloat16")(w, x)
    """
    policy = precision.get_policy(policy)
    pairs: list[tuple[object, Any]] = []  # (pattern or _NORM_SCOPES, policy)
    for pattern, p in (overrides or {}).items():
        if not isinstance(pattern, str):
            raise TypeError(
                f"jamp.autocast override key {pattern!r}: expected a name-scope path pattern "
                '(a string such as "*/head"); module classes are keys of jamp.wrap.'
            )
        pairs.append((pattern, precision.get_policy(p)))
    pairs.append((_NORM_SCOPES, precision.get_policy("float32")))
    argnums = tuple(params_argnums)
    if any(not isinstance(i, int) or i < 0 for i in argnums):
        raise ValueError(f"params_argnums must be non-negative ints, got {params_argnums!r}.")
    if not callable(fn):
        raise TypeError(f"jamp.autocast expects a callable, got {type(fn).__name__}.")
    act.resolve(activations)  # a bad value fails here, with the accepted ones
    engine = functools.partial(rewrite, compute_for=_scope_rules(pairs))
    options = dict(
        activations=activations,
        reduce_dtype=precision.reduce_dtype(policy),
        fuse_attention=fusion_key(fuse_attention),  # a bad value fails here, in one line
    )
    compute = precision.autocast_dtype(policy)

    def call(fn, args, kwargs):
        if _array_leaves(fn):  # a callable pytree (an Equinox module): its leaves are parameters
            return _rewritten(
                engine,
                lambda module, *a, **kw: module(*a, **kw),
                (fn, *args),
                kwargs,
                (0,) + tuple(i + 1 for i in argnums),
                compute,
                options,
            )
        return _rewritten(engine, fn, args, kwargs, argnums, compute, options)

    if _is_pytree(fn):  # its leaves stay leaves: transforms see them, and updates reach them
        return Autocast(fn, _Call(call, policy))

    def run(*args, **kwargs):
        return policy.cast_to_output(call(fn, args, kwargs))

    return functools.update_wrapper(run, fn, updated=())


def _is_pytree(fn) -> bool:
    """Whether `fn` is a pytree of its own (an Equinox module, `eqx.filter_grad`'s wrapper, any
    registered callable), not a leaf as a function is."""
    leaves = jax.tree.leaves(fn)
    return not (len(leaves) == 1 and leaves[0] is fn)


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
    """How an `Autocast` calls its `fn`: the pytree's static part (compared by identity, so that
    `jit` traces an updated model again only when its structure changes)."""

    call: Callable
    policy: Any


class Autocast:
    """`jamp.autocast` of a callable pytree (an Equinox module): called as `fn` is, under the
    policy, and a pytree with `fn`'s leaves, so that `eqx.filter_value_and_grad`,
    `eqx.apply_updates`, `filter_jit` and `filter_vmap` see and update its parameters.

    `model = jamp.autocast(model, "mixed_bfloat16")` once, then train `model` as the module it
    wraps; `model.fn` is the module (trained, after training).
    """

    def __init__(self, fn: Any, how: _Call):
        self.fn = fn
        self._how = how

    def __call__(self, *args, **kwargs):
        return self._how.policy.cast_to_output(self._how.call(self.fn, args, kwargs))

    @property
    def __wrapped__(self):  # what `inspect.signature` and `inspect.unwrap` read
        return self.fn

    def __repr__(self) -> str:
        return f"jamp.autocast({self.fn!r}, {precision.describe(self._how.policy)})"


jax.tree_util.register_pytree_node(
    Autocast, lambda a: ((a.fn,), a._how), lambda how, children: Autocast(children[0], how)
)


def _rewritten(engine, fn, args, kwargs, argnums, compute, options):
    """`fn(*args, **kwargs)` rewritten by `engine`. Under `jax.vmap` (a call per example: the
    documented `jax.vmap(model)(x)` of Equinox) the vmap moves inside the rewrite, so that its
    matmuls are the batched program's: traced per example, each weight's gradient would be a
    product per example summed after (JAX batches a custom VJP's backward as a whole), which
    XLA does not turn back into one matmul."""
    axis = jax_compat.vmap_axis(jax.tree.leaves((args, kwargs)))
    if axis is None:
        return engine(fn, compute, weak_argnums=argnums, **options)(*args, **kwargs)
    leaves, tree = jax.tree.flatten((args, kwargs))
    at = [i for i, leaf in enumerate(leaves) if _rewrite.is_traceable(leaf)]
    params = {i for n in argnums if n < len(args) for i in _leaf_range(args, n)}

    def plain(*arrays):
        full = list(leaves)
        for i, x in zip(at, arrays):
            full[i] = x
        a, kw = jax.tree.unflatten(tree, full)
        return fn(*a, **kw)

    lifted = custom_batching.custom_vmap(plain)

    @lifted.def_vmap
    def _batched(size, in_batched, *arrays):
        mapped: list[bool] = []

        def one(*xs):  # one example's call, noting which outputs vary along the axis
            out = plain(*xs)
            mapped[:] = [jax_compat.vmap_axis([o]) is not None for o in jax.tree.leaves(out)]
            return out

        batched = jax.vmap(
            one,
            in_axes=[0 if b else None for b in in_batched],
            axis_size=size,
            axis_name=axis.name,
            spmd_axis_name=axis.spmd_name,
        )
        weak = tuple(k for k, i in enumerate(at) if i in params)
        out = engine(batched, compute, weak_argnums=weak, **options)(*arrays)
        flat, out_tree = jax.tree.flatten(out)
        flat = [x if m else x[0] for x, m in zip(flat, mapped)]  # (a psum's: one for all)
        return jax.tree.unflatten(out_tree, flat), jax.tree.unflatten(out_tree, mapped)

    return lifted(*[leaves[i] for i in at])


def _leaf_range(args, n) -> range:
    """The indices, in the flat leaves of `(args, kwargs)`, of `args[n]`'s leaves."""
    start = sum(len(jax.tree.leaves(a)) for a in args[:n])
    return range(start, start + len(jax.tree.leaves(args[n])))
