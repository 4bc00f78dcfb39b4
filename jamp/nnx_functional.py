"""An NNX model's functional side, for `jamp.make_train_step` (and so `jamp.parallel`'s pmap and
`jamp.sharding`'s sharded step): `split(model)` gives its params and model state as pytrees for a
`jamp.TrainState`, and a `Functional` that builds the step's loss function from
`loss(model, batch)` and its eval function from `metrics(model, batch)`. `jamp.nnx` re-exports
both (`jamp.nnx.split`); the model may be a `jamp.wrap`-ped one or any other `nnx.Module`.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import jax
from flax import nnx

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
    if not isinstance(model, nnx.Module):
        raise TypeError(f"jamp.nnx.split expects an nnx.Module, got {type(model).__name__}.")
    graphdef, *states = nnx.split(model, nnx.Param, nnx.RngState, ...)
    params, rng_state, model_state = states
    return Functional(graphdef, rng_state, _stream_names(rng_state)), params, model_state
