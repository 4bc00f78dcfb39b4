"""Tests for jamp.state: TrainState creation, dtypes, and that every field survives pytree round trips."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

from jamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jamp.state import TrainState


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))
        return nn.Dense(1)(nn.relu(x))


def _variables():
    variables = _BNNet().init(jax.random.key(0), jnp.ones((2, 3)))
    params = variables.pop("params")
    return params, variables


def _state(loss_scale=None):
    params, model_state = _variables()
    return TrainState.create(
        params, optax.adam(1e-3), model_state=model_state, loss_scale=loss_scale
    )


def _assert_trees_equal(a, b):
    """Same structure (static fields included), same leaves, same dtypes and weak types."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert jax.typeof(x) == jax.typeof(y)
        np.testing.assert_array_equal(x, y)


def test_create_defaults():
    params, _ = _variables()
    tx = optax.adam(1e-3)
    state = TrainState.create(params, tx)
    assert state.model_state == {}
    assert isinstance(state.loss_scale, NoOpLossScale)
    assert int(state.step) == 0 and int(state.skipped_steps) == 0
    _assert_trees_equal(state.opt_state, tx.init(params))
    assert state.params is params


def test_create_counters_are_strong_int32_arrays():
    state = _state(DynamicLossScale())
    for counter in (state.step, state.skipped_steps):
        # A weak type or python int would make the second jitted step compile again.
        assert isinstance(counter, jax.Array)
        assert jax.typeof(counter) == jax.typeof(jnp.zeros((), jnp.int32))
        assert not jax.typeof(counter).weak_type


def test_create_keeps_model_state_and_loss_scale():
    params, model_state = _variables()
    scale = StaticLossScale(2.0**8)
    state = TrainState.create(params, optax.sgd(0.1), model_state=model_state, loss_scale=scale)
    assert state.model_state is model_state
    assert state.loss_scale is scale


def test_state_holds_no_functions():
    state = _state()
    names = [f.name for f in dataclasses.fields(state)]
    assert names == [
        "step",
        "params",
        "opt_state",
        "model_state",
        "loss_scale",
        "skipped_steps",
        "fp8_state",
        "adaptive_state",
        "compute_params",
    ]
    assert not any(callable(leaf) for leaf in jax.tree.leaves(state))


@pytest.mark.parametrize(
    "loss_scale",
    [
        NoOpLossScale(),
        StaticLossScale(2.0**10),
        DynamicLossScale(
            loss_scale=2.0**12, growth_interval=7, min_loss_scale=4.0, max_loss_scale=2.0**20
        ),
    ],
    ids=["noop", "static", "dynamic"],
)
def test_tree_flatten_unflatten_round_trip(loss_scale):
    state = _state(loss_scale)
    leaves, treedef = jax.tree.flatten(state)
    restored = jax.tree.unflatten(treedef, leaves)
    # The treedef carries the static hyperparameters, so equal structures mean equal settings.
    _assert_trees_equal(restored, state)


def test_jit_round_trip_keeps_every_field():
    scale = DynamicLossScale(loss_scale=2.0**12, growth_interval=7, min_loss_scale=4.0)
    state = _state(scale)
    restored = jax.jit(lambda s: s)(state)
    _assert_trees_equal(restored, state)
    # Static hyperparameters live in the treedef: the jmp pitfall was losing min_loss_scale here.
    assert restored.loss_scale.min_loss_scale == 4.0
    assert restored.loss_scale.growth_interval == 7


def test_serialization_round_trip():
    scale = DynamicLossScale(loss_scale=2.0**12, growth_interval=7, min_loss_scale=4.0)
    state = _state(scale)
    # Stand in for a checkpoint: bytes out, restored into a fresh target of the same shape.
    changed = state.replace(step=jnp.asarray(5, jnp.int32), skipped_steps=jnp.asarray(2, jnp.int32))
    target = _state(scale)
    restored = serialization.from_bytes(target, serialization.to_bytes(changed))
    assert int(restored.step) == 5 and int(restored.skipped_steps) == 2
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(changed)):
        np.testing.assert_array_equal(x, y)
        assert np.asarray(x).dtype == np.asarray(y).dtype
    assert restored.loss_scale.min_loss_scale == 4.0


def test_compute_copies_of_an_abstract_state_are_abstract():
    """A state of shapes (a restore target, a plan) gets copies of shapes, on the params'
    shardings: `create` under `jax.eval_shape` and `replace` with abstract params alike."""
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    tx = optax.sgd(0.1)
    abstract = jax.eval_shape(lambda: TrainState.create(params, tx, compute_dtype=jnp.bfloat16))
    assert abstract.compute_params["w"].dtype == jnp.bfloat16
    assert abstract.compute_params["b"] is None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state = TrainState.create(params, tx, compute_dtype=jnp.bfloat16).replace(params=shapes)
    assert state.compute_params["w"] == jax.ShapeDtypeStruct((4, 3), jnp.bfloat16)
    assert state.compute_params["b"] is None
    with pytest.raises(ValueError, match="compute_dtype must be a float dtype"):
        TrainState.create(params, tx, compute_dtype=jnp.int8)


@pytest.mark.parametrize("name", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_the_readmes_pattern_runs_under_every_policy(name):
    """`compute_dtype=policy.compute_dtype` as the README writes it: under the float32 policy
    it means no copies (it was refused: a script switching policies failed), under the 16-bit
    ones the copies the update writes; the step trains in each."""
    import jamp

    policy = jamp.get_policy(name)
    model = jamp.wrap(nn.Dense(2), policy)
    x = jax.random.normal(jax.random.key(0), (32, 4))
    batch = {"x": x, "y": (x[:, 0] > 0).astype(jnp.int32)}
    params = model.init(jax.random.key(1), x)["params"]

    def loss_fn(params, model_state, batch, rng):
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (model_state, {})

    tx = optax.adam(1e-2)
    state = TrainState.create(
        params, tx, loss_scale=jamp.loss_scale_for(policy), compute_dtype=policy.compute_dtype
    )
    copies = jax.tree.leaves(state.compute_params)
    assert [c.dtype for c in copies] == ([] if name == "float32" else [policy.compute_dtype])
    step = jax.jit(jamp.make_train_step(loss_fn, tx))
    first = None
    for _ in range(20):
        state, metrics = step(state, batch, jax.random.key(2))
        first = float(metrics["loss"]) if first is None else first
    assert float(metrics["loss"]) < first
