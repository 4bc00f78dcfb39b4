"""The training program's side of adaptive precision (`--config.adaptive_precision=true`) and of
static placement (`--config.keep_in_float32`).

`jamp.adaptive.Controller` decides; this module feeds it the step metrics, applies its decisions
(a model wrapped with the new overrides, so the step is built and compiled once more) and tells
the user. Decisions are taken at fixed steps, every `k` steps and at each checkpoint, from the
steps' metrics alone: a run resumed from a checkpoint promotes exactly where the original did.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jamp import adaptive, precision
from jamp import nnx as jamp_nnx
from jamp.finite import finite_by_group
from jamp.loss_scale import DynamicLossScale
from jamp.step import FP8_SATURATION
from jamp.train.overflow_watch import BY_MODULE, FORWARD
from jamp.wrap import Wrapped, module_policies, wrap

# What the controller reads of each step's metrics; the rest stays on the device.
_READ = ("grads_finite", "loss_scale", BY_MODULE, FORWARD, FP8_SATURATION)


def _dummy(info):
    dtype = jnp.int32 if info.task == "lm" else jnp.float32
    return jnp.zeros((1, *info.input_shape), dtype)


def layout(model, info) -> tuple[dict, list[str]]:
    """`({module path: compute dtype} in the order the calls finish, top-level paths in call
    order)` of a wrapped model, from an abstract init and call (nothing runs). An NNX model (its
    program view): attribute paths (`blocks/0/attention`), its top-level submodules in the order
    its constructor assigned them, a list of blocks as its items (`blocks/0`, `blocks/1`, ...)."""
    x = _dummy(info)
    if not isinstance(model, Wrapped):
        return _nnx_dtypes(model, x), _nnx_top_level(model, x)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
    policies = module_policies(model, variables, x, train=False)
    dtypes = {path: np.dtype(precision.autocast_dtype(p)) for path, p in policies.items()}
    return dtypes, [p for p in policies if p and "/" not in p]


def _nnx_dtypes(view, x) -> dict:
    """Each submodule's compute dtype under the view's policy and overrides, from an abstract
    build and call (the view itself is left as it was)."""
    from flax import nnx

    found: dict = {}

    def run():
        module = view.spec.build(tuple(x.shape[1:]), nnx.Rngs(0))
        model = wrap(module, view.policy, view.overrides, activations=view.activations)
        model.eval()
        found.update(jamp_nnx.module_policies(model, x))
        return 0

    jax.eval_shape(run)
    return {path: np.dtype(precision.autocast_dtype(p)) for path, p in found.items()}


def abstract_variables(model, info) -> dict:
    """The model's variables' shapes and dtypes, from an abstract init (an NNX view's own build
    is left as it was: a fresh view is initialised)."""
    if not isinstance(model, Wrapped):
        model = type(model)(model.spec, model.policy, model.activations, model.overrides)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), _dummy(info)))


def module_paths(model, info) -> list[str]:
    """Every module path of a wrapped model ("" for the root), from an abstract init (linen:
    as `jamp.wrap` overrides match them) or build (NNX: attribute paths, `blocks/0/attention`)."""
    x = _dummy(info)
    if isinstance(model, Wrapped):
        variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
        return list(module_policies(model, variables, x, train=False))
    from flax import nnx

    paths: list[str] = []

    def build():
        module = model.spec.build(tuple(x.shape[1:]), nnx.Rngs(0))
        for path, node in nnx.iter_graph(module):
            if isinstance(node, nnx.Module):
                paths.append("/".join(map(str, path)))
        return 0

    jax.eval_shape(build)
    return paths


def _nnx_top_level(view, x) -> list[str]:
    """An NNX model's submodule attributes in the order its constructor assigned them (a list
    of modules as its items, `blocks/0` ...): its variables' own order is alphabetical."""
    from flax import nnx

    names: list[str] = []

    def build():
        module = view.spec.build(tuple(x.shape[1:]), nnx.Rngs(0))
        for key, value in vars(module).items():
            if isinstance(value, nnx.Module):
                names.append(key)
            elif (
                isinstance(value, (list, tuple, nnx.List))
                and value
                and all(isinstance(v, nnx.Module) for v in value)
            ):
                names.extend(f"{key}/{i}" for i in range(len(value)))
        return 0

    jax.eval_shape(build)
    return names


def rewrap(model, overrides):
    """The same model under the same policy with `overrides` (path -> policy) instead."""
    if isinstance(model, Wrapped):
        return wrap(model.module, model.policy, overrides, activations=model.activations)
    return model.with_overrides(overrides)


class Adapting:
    """Feeds a `jamp.adaptive.Controller` from the loop and rebuilds the model on a change.

    Args:
      run: the RunConfig (`run.adaptive` is `(k, n, demote_after)`).
      model: the wrapped model as `build_model` made it (static overrides included).
      info: the dataset's info (the input shape, for the abstract call).
      static: the static overrides the model was wrapped with (`keep_in_float32`).
    """

    def __init__(self, run, model, info, static):
        k, n, demote_after = run.adaptive
        dtypes, _ = layout(model, info)
        # The gradient groups the step's flags name (top-level modules, each block of a list)
        # that are not modules of their own (a parameter of the model itself).
        groups = jax.eval_shape(finite_by_group, abstract_variables(model, info)["params"])
        modules = [p for p in dtypes if p] + [g for g in groups if g not in dtypes]
        self.controller = adaptive.Controller(
            run.policy, modules, k=k, n=n, demote_after=demote_after, start=dtypes
        )
        self.order = [p for p in dtypes]  # call finish order, for the forward flags
        self.k = k
        self.checkpoint_every = run.checkpoint_every_steps
        self.static = dict(static)
        self.base = model
        self.model = model
        self.pending: list = []  # (step, device metrics) not yet observed
        # Only a dynamic scale has a floor to fall to; under a static or no scale every skip
        # counts towards k of n like any other.
        self._floor = (
            np.float32(run.loss_scale.min_loss_scale)
            if isinstance(run.loss_scale, DynamicLossScale)
            else None
        )
        self._initial_scale = np.float32(run.loss_scale.loss_scale)
        self._scale = self._initial_scale  # the scale the next step runs with
        self.last_blamed: tuple[str, ...] = ()
        self.ctl = self.controller.init()  # the controller state; the device copy is stale

    def init_state(self) -> adaptive.AdaptiveState:
        return self.ctl

    def resume(self, state):
        """Takes the controller state of a restored TrainState and rebuilds the model with it;
        returns the state with the controller state in it (a fresh one when the checkpoint was
        written without adaptive precision)."""
        self._scale = np.float32(jax.device_get(state.loss_scale.loss_scale))
        restored = state.adaptive_state
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(restored)):
            return state.replace(adaptive_state=self.ctl)  # switched on for this run: fresh
        ctl = jax.tree.map(np.asarray, jax.device_get(restored))
        self.controller.check(ctl)
        self.ctl = ctl
        self._rebuild(ctl)
        return state

    def with_state(self, host_state):
        """`host_state` carrying the controller's current state, for a checkpoint."""
        return host_state.replace(adaptive_state=self.ctl)

    def _rebuild(self, ctl) -> None:
        overrides = {**self.controller.overrides(ctl), **self.static}
        self.model = rewrap(self.base, overrides) if overrides != self.static else self.base

    def add(self, step: int, metrics) -> None:
        self.pending.append((step, {k: metrics[k] for k in _READ if k in metrics}))

    def due(self, step: int) -> bool:
        """Whether to decide after `step`: every k steps and at checkpoints (absolute steps, so
        a resumed run decides where the original did); the run's last step is not one of its own."""
        return step % self.k == 0 or step % self.checkpoint_every == 0

    def observe(self, fetch) -> None:
        """Records the pending steps in the controller state (no decision)."""
        ctl = self.ctl
        fetched = jax.device_get([metrics for _, metrics in self.pending])  # one transfer
        for (step, _), metrics in zip(self.pending, fetched):
            m = fetch(metrics)
            skipped = not bool(np.all(m["grads_finite"]))
            blamed: tuple[str, ...] = ()
            if skipped:
                blamed = adaptive.blame(m.get(BY_MODULE, {}), m.get(FORWARD), self.order)
                self.last_blamed = blamed or self.last_blamed
            # the scale this step ran with, not the one it adjusted to
            at_floor = skipped and self._floor is not None and self._scale <= self._floor
            self._scale = np.float32(m["loss_scale"])
            clipped = adaptive.saturated(m.get(FP8_SATURATION, {}), self.controller.modules)
            ctl = self.controller.observe(
                ctl, step, skipped=skipped, at_floor=at_floor, blamed=blamed, saturated=clipped
            )
        self.pending = []
        self.ctl = ctl

    def decide(self, step: int) -> list:
        """The changes decided at `step`; with changes, `self.model` is the model to build the
        step from."""
        self.ctl, changes = self.controller.decide(self.ctl, step)
        if changes:
            self._rebuild(self.ctl)
            self._scale = self._initial_scale  # the loop starts the scale afresh
        return changes

    def why_stuck(self) -> str | None:
        """For the persistent-overflow stop: what adaptive precision could not do."""
        if not self.last_blamed:
            return "adaptive precision could not trace the overflow to a module"
        if self.nothing_left():
            return (
                f"adaptive precision has nothing left to promote: {', '.join(self.last_blamed)} computes in "
                "float32 already, so this is not the number format: look for a bug in the data "
                "(nan/inf inputs) or the model (a diverging loss, a division by zero)"
            )
        return None

    def nothing_left(self) -> bool:
        """Whether every module the last overflow was blamed on computes in float32 already."""
        done = self.controller.exhausted(self.ctl, self.last_blamed)
        return bool(self.last_blamed) and len(done) == len(self.last_blamed)

    def summary(self) -> str:
        lines = self.controller.promotions(self.ctl)
        return "; ".join(lines) if lines else "none"
