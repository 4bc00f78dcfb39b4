"""Run any Flax linen module, unmodified, under a precision policy.

`wrap(module, policy)` returns a module that is initialised and applied exactly like `module` (same
variables, same call arguments) but:

* every matmul and convolution takes operands in the policy's compute dtype, accumulates in
  float32 and hands float32 gradients back to float32 parameters (see `jamp.autocast`); this
  reaches layers that hard-code `dtype=jnp.float32`, raw `x @ self.param(...)` products and shared
  or nested submodules alike;
* reductions, softmax, normalization statistics and the loss stay float32; the activations
  between matmuls stay float32 on CPUs (XLA:CPU computes 16-bit elementwise math in float32
  anyway, while bf16 x bf16 -> fp32 matmuls run at nearly twice the float32 rate) and are
  carried in the compute dtype on GPUs and TPUs, where elementwise work is bandwidth-bound
  (`activations=`, see `jamp.activations`);
* normalization layers (Flax's own and any class named like one, and anything else named in
  `overrides`) run under their own policy, float32 by default;
* under an fp8 policy ("mixed_fp8"), matmuls take fp8 operands (`jamp.fp8`) except the
  model's last matmul (its output head) and `nn.Embed`'s, which stay in the compute dtype
  (bfloat16), as do convolutions; an override (e.g. `{"lm_head": "mixed_fp8"}`) decides
  otherwise;
* parameters are created in the policy's param dtype and outputs are cast to its output dtype;
* under `jamp.sharding`'s steps, a parameter split over devices is cast to the compute dtype
  on its shard, before it is gathered, and its matmul gradients are summed across devices in
  the policy's reduce dtype (float32 unless the policy names another, e.g.
  "mixed_bfloat16,reduce=bf16").

Example::

  model = jamp.wrap(ResNet18(num_classes=10), "mixed_bfloat16")
  variables = model.init(key, images, train=False)
  logits, updates = model.apply(variables, images, train=True, mutable=["batch_stats"])
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Mapping, Optional, overload

import flax.linen as nn
import jax
import jmp
from flax.core import DenyList

from jamp import activations as activations_lib
from jamp import nnx as nnx_lib
from jamp import overrides as overrides_lib
from jamp import precision
from jamp.engine import AttentionFusion, fusion_key, rewrite
from jamp.precision import reduce_dtype

if TYPE_CHECKING:
    from flax import nnx

PolicyLike = overrides_lib.PolicyLike
OverrideKey = overrides_lib.OverrideKey

#: Module classes that run in float32 unless `overrides` says otherwise: their statistics and
#: rescaling are where 16-bit arithmetic loses accuracy first.
FP32_MODULES: tuple[type, ...] = (nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
FP32_MODULE_NAME_SUFFIXES = overrides_lib.FP32_MODULE_NAME_SUFFIXES


class _Paths:
    """Submodule paths as a user names them, also for modules run through a nested `apply`.

    Flax gives a module applied from inside another's method (`self.lm_head.apply({"params":
    ...}, x)`, how Hugging Face's Flax models tie an LM head to the embedding) a scope of its own
    with an empty path. Its path is the calling module's path plus its name; its submodules' paths
    are relative to it. Lifted transforms (`nn.scan`, `nn.remat`, ...) also start scopes of their
    own, but these keep paths relative to the module that holds them.
    """

    def __init__(self):
        self._roots: list[tuple[Any, tuple[str, ...]]] = []  # (root scope, path prefix)
        self._calls: list[tuple[str, ...]] = []  # paths of the module methods running now

    def of(self, module: nn.Module) -> tuple[str, ...]:
        own = tuple(str(p) for p in module.path)
        assert module.scope is not None  # a bound module: it is running
        root = module.scope.root
        prefix = next((pre for r, pre in self._roots if r is root), None)
        if prefix is None:
            caller = self._calls[-1] if self._calls else ()
            if not own:  # a nested apply (or a lifted transform's wrapper): under its caller
                prefix = caller + ((module.name,) if self._calls and module.name else ())
            elif caller[len(caller) - len(own) :] == own:  # a lifted scope, under its wrapper
                prefix = caller[: len(caller) - len(own)]
            else:
                prefix = ()
            self._roots.append((root, prefix))
        return prefix + own

    @contextlib.contextmanager
    def calling(self, path: tuple[str, ...]):
        self._calls.append(path)
        try:
            yield
        finally:
            self._calls.pop()


class Wrapped(nn.Module):
    """A linen module that runs `module` under `policy`; build it with `jamp.wrap`."""

    module: nn.Module
    policy: jmp.Policy
    overrides: tuple[tuple[OverrideKey, jmp.Policy], ...] = ()
    activations: str = "auto"
    fuse_attention: Any = True  # `jamp.engine.fusion_key`: a bool, or (pattern, bool) pairs

    # ----- how a call runs. `nowrap`: Flax must not treat these helpers as module methods, or the
    # interceptor would intercept itself.

    @nn.nowrap
    def _interceptor(self, paths: _Paths, next_fun, args, kwargs, context):
        """Mark calls of overridden submodules so that their equations get the override's dtype."""
        if context.method_name == "setup" or context.module.scope is None:
            return next_fun(*args, **kwargs)
        path = paths.of(context.module)
        index = overrides_lib.first_match(self.overrides, context.module, path)
        with paths.calling(path):
            if index is None:
                return next_fun(*args, **kwargs)
            policy = self.overrides[index][1]
            with overrides_lib.running_under(index, policy, context.module, args, kwargs) as cast:
                return overrides_lib.cast_output(policy, next_fun(*cast[0], **cast[1]))

    @nn.nowrap
    def _run(self, fn, *args, **kwargs):
        def traced(*a, **kw):
            interceptor = functools.partial(self._interceptor, _Paths())
            with nn.intercept_methods(interceptor):
                return fn(*a, **kw)

        # The first argument is `variables` (or init's rngs): weak, so that `x @ w + b` keeps
        # a 16-bit activation 16-bit when activations are carried in the compute dtype.
        return rewrite(
            traced,
            precision.autocast_dtype(self.policy),
            overrides_lib.compute_for(self.overrides),
            activations=self.activations,
            weak_argnums=(0,),
            reduce_dtype=reduce_dtype(self.policy),
            fuse_attention=self.fuse_attention,
        )(*args, **kwargs)

    # ----- the linen entry points, with the inner module's signatures

    def init_with_output(
        self,
        rngs,
        *args,
        method=None,
        mutable=DenyList("intermediates"),
        capture_intermediates=False,
        **kwargs,
    ):
        """Like `module.init_with_output`; params come back in the policy's param dtype."""
        out, variables = self._run(
            self.module.init_with_output,
            rngs,
            *args,
            method=method,
            mutable=mutable,
            capture_intermediates=capture_intermediates,
            **kwargs,
        )
        variables = dict(variables)
        if "params" in variables:
            variables["params"] = self.policy.cast_to_param(variables["params"])
        return self.policy.cast_to_output(out), variables

    def init(
        self,
        rngs,
        *args,
        method=None,
        mutable=DenyList("intermediates"),
        capture_intermediates=False,
        **kwargs,
    ):
        """Like `module.init`: the same variables, with params in the policy's param dtype."""
        variables = self.module.init(
            rngs,
            *args,
            method=method,
            mutable=mutable,
            capture_intermediates=capture_intermediates,
            **kwargs,
        )
        variables = dict(variables)
        if "params" in variables:
            variables["params"] = self.policy.cast_to_param(variables["params"])
        return variables

    def apply(
        self,
        variables,
        *args,
        rngs=None,
        method=None,
        mutable=False,
        capture_intermediates=False,
        **kwargs,
    ):
        """Like `module.apply`, under the policy; the module's output is cast to the output dtype."""
        result = self._run(
            self.module.apply,
            variables,
            *args,
            rngs=rngs,
            method=method,
            mutable=mutable,
            capture_intermediates=capture_intermediates,
            **kwargs,
        )
        if mutable is False:
            return self.policy.cast_to_output(result)
        out, state = result
        return self.policy.cast_to_output(out), state

    def __call__(self, *args, **kwargs):
        raise TypeError(
            "A jamp-wrapped module is used through .init() / .apply(); to use a policy inside a "
            "larger model, wrap the outer model instead."
        )


@overload
def wrap(
    module: nn.Module,
    policy: PolicyLike,
    overrides: Optional[Mapping[OverrideKey, PolicyLike]] = None,
    *,
    activations: str = "auto",
    fuse_attention: AttentionFusion = True,
) -> Wrapped: ...


@overload
def wrap(
    module: nnx.Module,
    policy: PolicyLike,
    overrides: Optional[Mapping[OverrideKey, PolicyLike]] = None,
    *,
    activations: str = "auto",
    fuse_attention: AttentionFusion = True,
) -> nnx.Module: ...


def wrap(
    module: nn.Module | nnx.Module,
    policy: PolicyLike,
    overrides: Optional[Mapping[OverrideKey, PolicyLike]] = None,
    *,
    activations: str = "auto",
    fuse_attention: AttentionFusion = True,
) -> Wrapped | nnx.Module:
    """Return `module` running under a precision policy, without editing the module.

    Args:
      module: any unbound `flax.linen.Module`, or any `flax.nnx.Module` (see `jamp.nnx`: the
        result is a copy of it, used like it, whose calls run under the policy).
      policy: a `jmp.Policy` or any spec `jamp.get_policy` accepts, e.g. "mixed_bfloat16".
      overrides: maps module classes (matched with isinstance) or path patterns (fnmatch against
        the submodule path, e.g. "Decoder_0/head*"; for NNX the attribute path, e.g.
        "blocks/0/attn") to the policy that submodules they match run
        under. The first match in this mapping wins; the classes in `FP32_MODULES`, and classes
        whose names end in one of `FP32_MODULE_NAME_SUFFIXES` (other libraries' normalization
        layers), run in float32 unless a key here matches them first. Paths are as the user names
        them also for a module applied from inside another (`self.lm_head.apply(...)`).
      activations: where the float32 values between matmuls live under a 16-bit compute dtype:
        "float32" (as the model traced them; the fast form on CPUs), "compute" (16-bit wherever
        `jamp.activations` allows: half the memory traffic, the fast form on GPUs and TPUs) or
        "auto" (float32 on CPUs, compute elsewhere). Normalization layers, sums, exponentials
        and the loss stay float32 either way.
      fuse_attention: under a 16-bit policy each attention recognised in the program runs as
        one call (cuDNN's fused kernel on NVIDIA GPUs); False leaves every attention as traced,
        and a mapping of module path patterns to True / False decides per module (e.g.
        `{"*/cross_attn": False}`: the first pattern matching the path, or an enclosing part of
        it, decides; fused where none matches).

    Returns:
      For linen, a `Wrapped` module with `module`'s `init` / `init_with_output` / `apply`
      signatures; for NNX, a copy of `module` with the same state, of a subclass of its class.

    Example::

      model = jamp.wrap(Transformer(cfg), "mixed_bfloat16", {"*/lm_head": "float32"})
    """
    if nnx_lib.is_module(module):
        return nnx_lib.wrap(
            module, policy, overrides, activations=activations, fuse_attention=fuse_attention
        )
    if isinstance(module, Wrapped):
        raise ValueError("module is already wrapped; wrap the original module once.")
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"wrap() expects a flax.linen.Module or a flax.nnx.Module, got "
            f"{type(module).__name__}; for any other JAX function use jamp.autocast."
        )
    policy, pairs = overrides_lib.resolve(policy, overrides, FP32_MODULES, (nn.Embed,))
    activations_lib.resolve(activations)  # reject a bad value here, with the accepted ones
    fusion = fusion_key(fuse_attention)  # a bad value fails here, in one line
    return Wrapped(
        module=module,
        policy=policy,
        overrides=pairs,
        activations=activations,
        fuse_attention=fusion,
    )


def module_policies(model: Wrapped, variables, *args, **kwargs) -> dict[str, jmp.Policy]:
    """The policy each submodule of a wrapped linen model runs under, by path.

    One abstract (shape-only) call of `model.apply(variables, *args, **kwargs)`; a submodule
    that no override matches runs under its caller's policy, the model itself under `policy`.
    The paths come in the order their calls finish (a child before its parent, the model itself,
    "", last): the order a forward overflow travels in.

    Example::

      policies = jamp.module_policies(model, variables, x)  # {"Conv_0": Policy(...), ...}
      dtypes = {path: policy.compute_dtype for path, policy in policies.items()}
    """
    if not isinstance(model, Wrapped):
        raise TypeError(f"module_policies takes a jamp.wrap-ped linen module, got {type(model)}")
    found: dict[str, jmp.Policy] = {}
    paths, stack = _Paths(), [model.policy]

    def record(next_fun, fn_args, fn_kwargs, context):
        if context.method_name == "setup" or context.module.scope is None:
            return next_fun(*fn_args, **fn_kwargs)
        path = paths.of(context.module)
        index = overrides_lib.first_match(model.overrides, context.module, path)
        stack.append(stack[-1] if index is None else model.overrides[index][1])
        try:
            with paths.calling(path):
                return next_fun(*fn_args, **fn_kwargs)
        finally:
            found.setdefault("/".join(path), stack.pop())

    def run(variables, args, kwargs):
        with nn.intercept_methods(record):
            return model.module.apply(variables, *args, **kwargs)

    mutable = [c for c in variables if c != "params"] or False
    static = {k: v for k, v in kwargs.items() if not _is_arrays(v)}
    dynamic = {k: v for k, v in kwargs.items() if k not in static}
    jax.eval_shape(
        lambda v, a, d: run(v, a, {**d, **static, "mutable": mutable}), variables, args, dynamic
    )
    return found


def _is_arrays(value) -> bool:
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves)
