"""Tests for jamp.parallel on 8 simulated CPU devices (set by tests/conftest.py)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore
from toy import MLP, BNNet, make_batch, make_loss_fn

from jamp.loss_scale import DynamicLossScale
from jamp.parallel import (
    local_device_count,
    make_p_eval_step,
    make_p_train_step,
    make_spmd_train_step,
    replicate,
    shard,
    unreplicate,
)
from jamp.state import TrainState
from jamp.step import make_eval_step, make_train_step

KEY = jax.random.key(0)
NUM_DEVICES = 8


@pytest.fixture(autouse=True, scope="module")
def _eight_devices():
    if jax.local_device_count() != NUM_DEVICES:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py)")


def make_state(model, tx, loss_scale=None):
    variables = model.init(KEY, jnp.ones((2, 4)))
    params = variables.pop("params")
    return TrainState.create(params, tx, model_state=variables, loss_scale=loss_scale)


def assert_replicas_equal(tree):
    for x in jax.tree.leaves(tree):
        for replica in np.asarray(x)[1:]:
            np.testing.assert_array_equal(replica, np.asarray(x)[0])


def test_local_device_count():
    assert local_device_count() == NUM_DEVICES


def test_replicate_unreplicate_round_trip():
    scale = DynamicLossScale(loss_scale=2.0**12, growth_interval=7, min_loss_scale=4.0)
    state = make_state(BNNet(), optax.adam(1e-3), scale)
    replicated = replicate(state)
    for x, y in zip(jax.tree.leaves(replicated), jax.tree.leaves(state)):
        assert x.shape == (NUM_DEVICES,) + y.shape and x.dtype == y.dtype
        assert {s.device for s in x.addressable_shards} == set(jax.local_devices())
    assert_replicas_equal(replicated)
    restored = unreplicate(replicated)
    assert jax.tree.structure(restored) == jax.tree.structure(state)  # static fields kept
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert len(x.sharding.device_set) == 1  # usable beside single-device arrays in jit
        assert x.dtype == y.dtype and jax.typeof(x).weak_type == jax.typeof(y).weak_type
        np.testing.assert_array_equal(x, y)


def test_replicate_onto_chosen_devices():
    devices = jax.local_devices()[:2]
    replicated = replicate({"w": np.arange(3.0, dtype=np.float32)}, devices=devices)
    assert replicated["w"].shape == (2, 3)
    assert {s.device for s in replicated["w"].addressable_shards} == set(devices)


def test_shard_splits_the_leading_axis():
    batch = {"x": np.arange(16 * 3).reshape(16, 3), "y": jnp.arange(16)}
    sharded = shard(batch)
    assert sharded["x"].shape == (8, 2, 3) and sharded["y"].shape == (8, 2)
    np.testing.assert_array_equal(sharded["x"][1], batch["x"][2:4])
    assert shard(batch, num_devices=4)["x"].shape == (4, 4, 3)


def test_shard_rejects_an_indivisible_batch():
    with pytest.raises(ValueError, match=r"batch of size 10 across 8 devices"):
        shard({"x": np.zeros((10, 3))})


def test_make_p_train_step_rejects_a_step_built_for_another_axis():
    step = make_train_step(make_loss_fn(MLP()), optax.sgd(0.1))  # axis_name=None
    with pytest.raises(ValueError, match="axis_name=None"):
        make_p_train_step(step, axis_name="batch")


def test_pmapped_steps_match_single_device_steps():
    model, tx = MLP(), optax.adam(1e-2)
    scale = DynamicLossScale(loss_scale=2.0**10, growth_interval=2)
    batches = [make_batch(key=k) for k in range(5)]

    single = make_state(model, tx, scale)
    step = jax.jit(make_train_step(make_loss_fn(model), tx))
    p_step = make_p_train_step(make_train_step(make_loss_fn(model), tx, axis_name="batch"))
    replicated = replicate(make_state(model, tx, scale))
    for batch in batches:
        single, metrics = step(single, batch, KEY)
        replicated, p_metrics = p_step(replicated, shard(batch), KEY)
        assert_replicas_equal(p_metrics)
        np.testing.assert_allclose(unreplicate(p_metrics)["loss"], metrics["loss"], rtol=1e-5)

    assert_replicas_equal(replicated)
    parallel = unreplicate(replicated)
    for x, y in zip(jax.tree.leaves(parallel.params), jax.tree.leaves(single.params)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    assert float(parallel.loss_scale.loss_scale) == float(single.loss_scale.loss_scale) == 2.0**12
    assert int(parallel.step) == 5 and int(parallel.skipped_steps) == 0


def test_inf_on_one_device_skips_the_step_on_every_device():
    model, tx = BNNet(), optax.adam(1e-2)
    p_step = make_p_train_step(make_train_step(make_loss_fn(model), tx, axis_name="batch"))
    state = replicate(make_state(model, tx, DynamicLossScale(loss_scale=2.0**10)))
    state, _ = p_step(state, shard(make_batch()), KEY)
    assert_replicas_equal(state)  # batch statistics were averaged, not left per device
    before = jax.tree.map(np.array, state)  # host copies: the step donates its input buffers

    bad = make_batch()
    bad = {**bad, "x": bad["x"].at[7, 0].set(jnp.inf)}  # row 7 lives on device 3 only
    state, metrics = p_step(state, shard(bad), KEY)

    assert not np.asarray(metrics["grads_finite"]).any()
    for name in ("params", "opt_state", "model_state"):
        for x, y in zip(
            jax.tree.leaves(getattr(state, name)), jax.tree.leaves(getattr(before, name))
        ):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(state.skipped_steps, np.ones(NUM_DEVICES))
    np.testing.assert_array_equal(state.loss_scale.loss_scale, np.full(NUM_DEVICES, 2.0**9))
    np.testing.assert_array_equal(state.step, np.full(NUM_DEVICES, 2))


def test_pmapped_step_with_compute_params_matches_casting_and_skips_them_too():
    """Replicated bfloat16 copies of the params (`compute_dtype`): the same steps bit for bit as
    casting on each device, and an inf on one device leaves them as they were on every device."""
    from jamp import wrap

    model, tx = wrap(MLP(), "mixed_bfloat16"), optax.adam(1e-2)
    p_step = make_p_train_step(make_train_step(make_loss_fn(model), tx, axis_name="batch"))
    params = model.init(KEY, jnp.ones((2, 4)))["params"]
    scale = DynamicLossScale(loss_scale=2.0**10)
    cast = replicate(TrainState.create(params, tx, loss_scale=scale))
    kept = replicate(TrainState.create(params, tx, loss_scale=scale, compute_dtype=jnp.bfloat16))
    bad = make_batch(key=3)
    bad = {**bad, "x": bad["x"].at[7, 0].set(jnp.inf)}  # row 7 lives on device 3 only
    for batch in [make_batch(key=1), make_batch(key=2), bad]:
        before = jax.tree.map(np.array, kept.compute_params)
        cast, cast_metrics = p_step(cast, shard(batch), KEY)
        kept, metrics = p_step(kept, shard(batch), KEY)
        np.testing.assert_array_equal(metrics["loss"], cast_metrics["loss"])
        for x, y in zip(jax.tree.leaves(kept.params), jax.tree.leaves(cast.params)):
            np.testing.assert_array_equal(x, y)
    assert not np.asarray(metrics["grads_finite"]).any()
    copies = jax.tree.leaves(kept.compute_params)
    assert len(copies) == 2 and all(c.dtype == jnp.bfloat16 for c in copies)
    for x, y in zip(copies, jax.tree.leaves(before)):
        np.testing.assert_array_equal(x, y)
    assert_replicas_equal(kept.compute_params)


def test_p_train_step_compiles_once():
    model, tx = BNNet(), optax.adam(1e-3)
    p_step = make_p_train_step(make_train_step(make_loss_fn(model), tx, axis_name="batch"))
    state = replicate(make_state(model, tx, DynamicLossScale(loss_scale=2.0**8, growth_interval=1)))
    good = jax.tree.map(np.asarray, make_batch())
    bad = {**good, "x": good["x"].copy()}
    bad["x"][3, 0] = np.inf
    batches = [shard(b) for b in (good, good, bad, good)]  # numpy: no compiles of their own
    state, _ = p_step(state, batches[0], KEY)

    compiles = []

    def listener(name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:  # replicate() placed the state as pmap places its outputs: nothing left to compile
        for batch in batches[1:]:
            state, _ = p_step(state, batch, KEY)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert int(unreplicate(state).skipped_steps) == 1


def test_p_train_step_donates_the_state():
    model, tx = MLP(), optax.sgd(0.1)
    p_step = make_p_train_step(make_train_step(make_loss_fn(model), tx, axis_name="batch"))
    state = replicate(make_state(model, tx))
    p_step(state, shard(make_batch()), KEY)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))


def test_p_eval_step_averages_over_devices():
    model = BNNet()
    state = make_state(model, optax.sgd(0.1))
    batch = make_batch()

    def eval_fn(params, model_state, batch):
        out = model.apply({"params": params, **model_state}, batch["x"], train=False)
        return {"mse": jnp.mean((out[:, 0] - batch["y"]) ** 2)}

    expected = jax.jit(make_eval_step(eval_fn))(state, batch)
    p_eval = make_p_eval_step(make_eval_step(eval_fn, axis_name="batch"))
    metrics = p_eval(replicate(state), shard(batch))
    assert_replicas_equal(metrics)
    np.testing.assert_allclose(unreplicate(metrics)["mse"], expected["mse"], rtol=1e-5)


def test_p_train_step_averages_gradients_in_the_reduce_dtype():
    model, tx = MLP(), optax.sgd(0.1)
    batch = shard(make_batch(key=3))
    steps = {
        r: make_train_step(make_loss_fn(model), tx, axis_name="batch", reduce_dtype=r)
        for r in (None, jnp.bfloat16)
    }
    state = replicate(make_state(model, tx))
    # The psums of the gradients take bf16 operands; the other averages stay float32.
    p_narrow = jax.pmap(steps[jnp.bfloat16], axis_name="batch", in_axes=(0, 0, None))
    summed = collections.Counter()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "psum":
                summed.update(str(v.aval.dtype) for v in eqn.invars)
            for sub in jcore.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(p_narrow)(state, batch, KEY).jaxpr)
    assert summed["bfloat16"] == len(jax.tree.leaves(state.params)) and summed["float32"] >= 1
    (wide, _), (narrow, _) = (  # a fresh state each: the step donates its state
        make_p_train_step(steps[r])(replicate(make_state(model, tx)), batch, KEY) for r in steps
    )
    for a, b in zip(jax.tree.leaves(unreplicate(wide)), jax.tree.leaves(unreplicate(narrow))):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)  # one bf16 rounding of the grads


def test_spmd_train_step_is_the_pmapped_step_as_one_program():
    """What `jamp.compile_for` compiles for a pmap layout: the same steps as make_p_train_step
    (the batch global, the state passed once), to float32 rounding (two programs: XLA may sum
    the replicas' terms in another order; seen: one leaf 1 ulp apart after 3 steps on one CPU,
    equal on another), and an inf on one device's rows skips the step everywhere."""
    model, tx = BNNet(), optax.adam(1e-2)
    scale = DynamicLossScale(loss_scale=2.0**10, growth_interval=2)
    train_step = make_train_step(make_loss_fn(model), tx, axis_name="batch")
    p_step = make_p_train_step(train_step)
    s_step = make_spmd_train_step(train_step, jax.devices())
    replicated, state = replicate(make_state(model, tx, scale)), make_state(model, tx, scale)
    batches = [make_batch(key=k) for k in range(3)]
    batches[1]["x"] = batches[1]["x"].at[3].set(jnp.inf)
    for batch in batches:
        replicated, p_metrics = p_step(replicated, shard(batch), KEY)
        state, metrics = s_step(state, batch, KEY)
        np.testing.assert_allclose(metrics["loss"], unreplicate(p_metrics)["loss"], rtol=1e-6)
        assert bool(metrics["grads_finite"]) == bool(unreplicate(p_metrics)["grads_finite"])
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(unreplicate(replicated))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-9)
    assert int(state.skipped_steps) == 1 and int(state.step) == 3
    with pytest.raises(ValueError, match="axis_name"):
        make_spmd_train_step(make_train_step(make_loss_fn(model), tx), jax.devices())
