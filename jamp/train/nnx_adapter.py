"""An NNX model in the training program: jamp.wrap's NNX path behind linen's init / apply.

The program (tasks, the fp8 state, checkpoints, the precision report) speaks linen's protocol:
`variables = model.init(key, x, train=False)` and `model.apply(variables, x, train=...,
rngs={"dropout": key}, mutable=["batch_stats"])`. `LinenView` gives an NNX model that protocol:
`init` builds the model for the input's shape and wraps it under the policy; the variables are
plain nested dicts (`{"params": ..., "batch_stats": ...}`), so the train state, its checkpoints
and its sharding are those of any linen model; `apply` merges them into the wrapped NNX model,
sets `train()` / `eval()`, seeds its RNG streams from the dropout key and calls it.
"""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx

from jamp import nnx as jamp_nnx
from jamp.models import NnxModel
from jamp.wrap import wrap

_STATS = "batch_stats"  # the collection name the program's tasks pass as `mutable`


class LinenView:
    """`spec` (a `jamp.models.NnxModel`) under `policy`, used through `init` / `apply`."""

    def __init__(self, spec: NnxModel, policy, activations: str = "auto", overrides=None):
        self.spec, self.policy, self.activations = spec, policy, activations
        self.overrides = overrides
        self._built: Optional[tuple] = None  # (functional, params treedef, model-state treedef)
        self._input_shape: tuple = ()

    def init(self, rng, x, train: bool = False) -> dict:
        del train
        rngs = nnx.Rngs(params=rng, dropout=jax.random.fold_in(rng, 1))
        self._input_shape = tuple(x.shape[1:])
        module = self.spec.build(self._input_shape, rngs)
        model = wrap(module, self.policy, self.overrides, activations=self.activations)
        functional, params, model_state = jamp_nnx.split(model)
        variables = {"params": nnx.to_pure_dict(params)}
        if jax.tree.leaves(model_state):
            variables[_STATS] = nnx.to_pure_dict(model_state)
        pure = {name: jax.tree.structure(tree) for name, tree in variables.items()}
        self._built = (
            functional,
            jax.tree.structure(params),
            jax.tree.structure(model_state),
            pure,
        )
        return variables

    def with_overrides(self, overrides) -> "LinenView":
        """The same model under the same policy with `overrides` instead, ready to `apply` the
        variables this view's `init` made (adaptive precision's rebuild): the new wrapping is
        built abstractly (no parameter is drawn) and keeps this view's RNG state."""
        view = LinenView(self.spec, self.policy, self.activations, overrides)
        if self._built is None:
            return view
        functional, params_def, state_def, pure = self._built
        found = {}

        def build(shape):
            module = self.spec.build(shape, nnx.Rngs(0))
            model = wrap(module, self.policy, overrides, activations=self.activations)
            graphdef, params, _, model_state = nnx.split(model, nnx.Param, nnx.RngState, ...)
            found["graphdef"] = graphdef
            found["defs"] = (jax.tree.structure(params), jax.tree.structure(model_state))
            return 0

        jax.eval_shape(lambda: build(self._input_shape))
        if found["defs"] != (params_def, state_def):
            raise ValueError(f"{self.spec.name}: overrides changed the model's variables")
        rebuilt = jamp_nnx.Functional(found["graphdef"], functional.rng_state, functional.streams)
        view._built = (rebuilt, params_def, state_def, pure)
        view._input_shape = self._input_shape
        return view

    def _model(self, variables, train: bool, rngs):
        if self._built is None:
            raise RuntimeError(f"{self.spec.name}: call init() before apply()")
        functional, params_def, state_def, pure = self._built
        for name, structure in pure.items():  # the leaves are matched to variables by position
            if jax.tree.structure(variables[name]) != structure:
                raise ValueError(
                    f"{self.spec.name}: the {name} given have another structure than init's "
                    "(renamed or re-keyed entries, e.g. list indices as strings)"
                )
        params = jax.tree.unflatten(params_def, jax.tree.leaves(variables["params"]))
        model_state = jax.tree.unflatten(state_def, jax.tree.leaves(variables.get(_STATS, {})))
        if rngs and "dropout" in rngs:
            model = functional.seeded(params, model_state, rngs["dropout"])
        else:
            model = functional.merge(params, model_state)
        model.train() if train else model.eval()
        return model

    def apply(self, variables, x, train: bool = False, rngs=None, mutable=False):
        model = self._model(variables, train, rngs)
        out = model(x)
        if not mutable:
            return out
        updated = {}
        if _STATS in variables:
            updated[_STATS] = nnx.to_pure_dict(nnx.state(model, jamp_nnx.MODEL_STATE))
        return out, updated
