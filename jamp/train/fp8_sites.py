"""The fp8 sites of a training run through its life: a fresh state's sites traced from the train
step's loss, the sites kept through a checkpoint restore (renamed from the names jamp gave them
before, or fewer after a promotion) and through adaptive precision's promotions and demotions,
and whether the next step must calibrate fresh sites."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jamp import fp8
from jamp.train import adapting, tasks
from jamp.train.checkpoint import CheckpointError
from jamp.train.steps import replicated


def fp8_state_for(model, info, params, model_state, fp8_scaling) -> fp8.Fp8State:
    """A fresh fp8 state (`(recipe, history, margin)`) with a site for every fp8 matmul of the
    train step's loss on `model`; `params` and `model_state` may be abstract."""
    recipe, history, margin = fp8_scaling
    loss_fn, args = loss_and_args(model, info, params, model_state)
    return fp8.init_state(loss_fn, *args, recipe=recipe, history=history, margin=margin)


def loss_and_args(model, info, params, model_state):
    """The train step's loss on `model` and example arguments for it, which trace its fp8 sites."""
    dtype = jnp.int32 if info.task == "lm" else jnp.float32
    dummy = jnp.zeros((1, *info.input_shape), dtype)
    if info.task == "lm":
        batch = {"tokens": jnp.zeros((1, info.input_shape[0] + 1), jnp.int32)}
    else:
        batch = {"image": dummy, "label": jnp.zeros((1,), jnp.int32)}
    return tasks.make_loss_fn(model, info.task), (params, model_state, batch, jax.random.key(0))


def sites_of(run, model, info) -> fp8.Fp8State:
    """A fresh fp8 state for `model` under `run`'s scaling, from an abstract init (the model
    rebuilt with other overrides: its site set)."""
    variables = dict(adapting.abstract_variables(model, info))
    params = variables.pop("params")
    return fp8_state_for(model, info, params, variables, run.fp8)


def after_promotion(run, model, info, state):
    """The placed fp8 state for `model` (rebuilt with other overrides): a site for each of its
    fp8 matmuls, the surviving sites' histories and scales carried over as they are on the
    devices, a site that is new (a demotion back to fp8) fresh; and whether there is one."""
    fresh = sites_of(run, model, info)
    new = {name: site for name, site in fresh.sites.items() if name not in state.fp8_state.sites}
    new = replicated(run, new)  # like every fp8 site; the kept ones stay where they are
    placed = fresh.replace(sites={name: new.get(name, site) for name, site in fresh.sites.items()})
    return fp8.carry_over(placed, state.fp8_state), bool(new)


def needs_calibration(run, state) -> bool:
    """Whether the next step must fill fresh delayed fp8 sites (`fp8.calibrating`)."""
    return bool(run.fp8) and run.fp8[0] == "delayed" and fp8.uses_state(state.fp8_state)


class Fp8Sites:
    """What the restore target's fp8 sites are made to be: the checkpoint's, where the run allows
    them to differ. Adaptive precision under fp8: a promotion before the checkpoint removed some
    (`adaptive`). Any fp8 run: a checkpoint written before site names were params paths names
    them as the name stack spelt them ("TransformerLM/DecoderBlock_0/Dense_0/dot_general", now
    "DecoderBlock_0/Dense_0/dot_general"): restored under those names, then renamed (`current`)
    by the map `jamp.fp8.former_names` traces from `model`'s loss."""

    def __init__(self, model, info, adaptive: bool):
        self.model, self.info, self.adaptive = model, info, adaptive
        self._former: dict[str, str] | None = None

    def former(self) -> dict[str, str]:
        """{former site name: current name} for `model`'s loss (traced once, when needed;
        none without a model)."""
        if self._former is None and self.model is None:
            self._former = {}
        if self._former is None:
            variables = dict(adapting.abstract_variables(self.model, self.info))
            params = variables.pop("params")
            loss_fn, args = loss_and_args(self.model, self.info, params, variables)
            self._former = fp8.former_names(loss_fn, *args)
        return self._former

    def __call__(self, target, stored_tree):
        """`fit` for `Checkpointer.restore`: the target with the stored tree's fp8 site names,
        shaped like this run's sites (its history length) and placed like them."""
        stored = stored_tree.get("fp8_state") if isinstance(stored_tree, dict) else None
        sites = stored.get("sites") if isinstance(stored, dict) else None
        if not isinstance(sites, dict) or target.fp8_state is None:
            return target
        names, current = set(sites), set(target.fp8_state.sites)
        if names == current:
            return target
        like = next(iter(target.fp8_state.sites.values()), None)
        if like is None:  # a model without fp8 matmuls: nothing to hold them
            return target
        stale = names - current
        if stale and stale & set(self.former()):  # named as before
            unknown = sorted(stale - set(self.former()))
            renamed = {self.former().get(n, n) for n in names}
            if unknown or not (renamed <= current if self.adaptive else renamed == current):
                odd = unknown or sorted(current ^ renamed)
                raise CheckpointError(
                    "the checkpoint's fp8 matmul sites are named as jamp named them before site "
                    f"names were params paths, and not all are this model's ({odd[0]!r}); use "
                    "another --workdir or the original config"
                )
        elif not self.adaptive:
            return target  # another model's sites: the restore says what differs

        def spec(leaf):  # this run's shapes (its history length), the checkpoint's names
            sharding = getattr(leaf, "sharding", None)
            return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

        made = {name: jax.tree.map(spec, like) for name in sites}
        return target.replace(fp8_state=target.fp8_state.replace(sites=made))

    def current(self, state):
        """The restored state with its fp8 sites under their current names."""
        if state.fp8_state is None or self._former is None:
            return state  # no site was named as before (the map was never needed)
        if not set(state.fp8_state.sites) & set(self._former):
            return state
        return state.replace(fp8_state=fp8.renamed(state.fp8_state, self._former))


def check_sites(run, model, info, state) -> None:
    """Raises CheckpointError when the restored fp8 sites are not those of the model the restored
    promotions give (a checkpoint of another model or config)."""
    want = set(sites_of(run, model, info).sites)
    got = set(state.fp8_state.sites)
    if want != got:
        extra = sorted(got - want) or sorted(want - got)
        raise CheckpointError(
            f"the checkpoint's fp8 matmul sites are not this model's under its promotions "
            f"({extra[0]!r} differs); use another --workdir or the original config"
        )
