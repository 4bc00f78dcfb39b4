"""jamp.rounding and bfloat16 params in the train step: unbiased stochastic rounding, one random
stream for replicas, shards and a resumed run, skipped steps bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from toy import MLP, make_batch, make_loss_fn

from jamp import parallel, rounding, sharding
from jamp.loss_scale import DynamicLossScale
from jamp.state import TrainState
from jamp.step import make_train_step
from jamp.wrap import wrap

KEY = jax.random.key(0)
BF16_PARAMS = "mixed_bfloat16,params=bf16"


def _neighbours(x):
    """The bfloat16 values just below and above float32 `x` (x between them, x > 0)."""
    down = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return down.view(np.float32), (down + np.uint32(0x10000)).view(np.float32)


def test_stochastic_round_is_unbiased_and_lands_on_a_neighbour():
    # values at fractions 1/64 ... 63/64 of the way between two bfloat16s, over 38 decades and
    # both signs
    fractions = np.arange(1, 64) / 64
    bases = np.array([1.0, 3.0e-5, 7.0e3, 1.0e-30], np.float32)
    lo = np.array([_neighbours(b)[0] for b in bases])
    ulp = np.array([_neighbours(b)[1] - _neighbours(b)[0] for b in bases])
    x = (lo[:, None] + fractions[None, :] * ulp[:, None]).astype(np.float32)
    x = np.concatenate([x, -x]).ravel()
    draws = 4096
    samples = jax.vmap(lambda k: rounding.stochastic_round(jnp.asarray(x), k))(
        jax.random.split(KEY, draws)
    )
    samples = np.asarray(samples.astype(jnp.float32))
    below, above = _neighbours(np.abs(x))
    assert np.all((np.abs(samples) == below) | (np.abs(samples) == above))
    # unbiased: the mean lands within 4.5 standard errors of x (fixed keys: not flaky)
    ulps = above - below
    f = np.tile(fractions, 2 * len(bases))
    se = ulps * np.sqrt(f * (1 - f) / draws)
    err = np.abs(samples.mean(0) - x)
    assert np.all(err <= 4.5 * se), np.max(err / se)
    # and round-to-nearest is biased wherever x is not halfway (here: up to 31/64 of an ulp)
    nearest = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    assert np.max(np.abs(nearest - x) / ulps) > 0.45


def test_stochastic_round_keeps_non_finite_values():
    x = jnp.array([jnp.nan, jnp.inf, -jnp.inf, 0.0, -0.0], jnp.float32)
    out = rounding.stochastic_round(x, KEY)
    assert out.dtype == jnp.bfloat16
    assert np.isnan(out[0]) and out[1] == jnp.inf and out[2] == -jnp.inf
    assert np.all(np.asarray(out[3:], np.float32) == 0)


def test_round_tree_refuses_float16_and_unknown_modes():
    with pytest.raises(ValueError, match="not float16"):
        rounding.round_tree({"w": jnp.ones(2)}, {"w": jnp.ones(2, jnp.float16)}, "stochastic", KEY)
    with pytest.raises(ValueError, match="accepted: auto, stochastic, nearest"):
        rounding.round_tree({"w": jnp.ones(2)}, {"w": jnp.ones(2)}, "up", KEY)
    with pytest.raises(ValueError, match="param_rounding must be one of"):
        make_train_step(make_loss_fn(MLP()), optax.sgd(0.1), param_rounding="kahan!")


def test_rounding_is_the_same_on_every_shard():
    """The bits are a hash of each element's global index: a sharded array draws them as the
    whole array would, so FSDP shards round as one device does."""
    values = {"a": jax.random.normal(KEY, (64, 32)), "b": jax.random.normal(KEY, (32,))}
    like = jax.tree.map(lambda v: v.astype(jnp.bfloat16), values)
    mesh = sharding.make_mesh("data=2,fsdp=4")
    specs = {"a": P("fsdp", "data"), "b": P("fsdp")}
    placed = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), values, specs)
    fn = jax.jit(lambda v, k: rounding.round_tree(v, like, "stochastic", k))
    whole, split = fn(values, KEY), fn(placed, KEY)
    assert split["a"].sharding.spec == P("fsdp", "data")
    for w, s in zip(jax.tree.leaves(whole), jax.tree.leaves(split)):
        np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(s, np.float32))


def _setup(policy=BF16_PARAMS, lr=1e-2, **step_kw):
    model = wrap(MLP(), policy)
    batch = make_batch(64)
    params = model.init(jax.random.key(1), batch["x"])["params"]
    tx = optax.adam(lr)
    state = TrainState.create(params, tx, loss_scale=DynamicLossScale(2.0**15))
    return state, make_train_step(make_loss_fn(model), tx, **step_kw), batch


def test_bf16_params_are_stored_bf16_and_updated_from_float32():
    state, step, batch = _setup()
    assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    # the optimizer sees the params' float32 view: float32 moments unless wrapped (jamp.lowbit)
    assert {m.dtype for m in jax.tree.leaves(state.opt_state[0].mu)} == {jnp.dtype(jnp.float32)}
    new, metrics = jax.jit(step)(state, batch, KEY)
    assert jax.tree.map(lambda a: a.dtype, new) == jax.tree.map(lambda a: a.dtype, state)
    assert bool(metrics["grads_finite"])


def test_small_updates_accumulate_with_stochastic_rounding_and_stall_to_nearest():
    """Updates of ~1/10 of half a bfloat16 ulp: to nearest, no weight ever moves; stochastic
    rounding moves them by what float32 master weights would, on average."""
    x = jnp.linspace(1.0, 2.0, 4096, dtype=jnp.float32)
    start = x.astype(jnp.bfloat16)
    delta = 2.0**-7 / 20  # a bfloat16 ulp in [1, 2) is 2**-7
    keys = jax.random.split(KEY, 100)

    def run(mode):
        def body(p, k):
            return rounding.round_tree(p.astype(jnp.float32) + delta, p, mode, k), None

        return jax.lax.scan(body, start, keys)[0].astype(jnp.float32)

    moved = float(jnp.mean(run("stochastic") - start.astype(jnp.float32)))
    assert np.all(np.asarray(run("nearest")) == np.asarray(start, np.float32))
    assert abs(moved - 100 * delta) < 0.05 * 100 * delta


def test_replicas_round_alike_and_a_skipped_step_leaves_the_state_bit_identical():
    state, step, batch = _setup(axis_name="batch")
    p_step = parallel.make_p_train_step(step)
    placed = parallel.replicate(state)
    shards = parallel.shard(batch)
    for _ in range(3):
        placed, metrics = p_step(placed, shards, KEY)
    for leaf in jax.tree.leaves(placed.params):
        rows = np.asarray(leaf, np.float32)
        assert np.all(rows == rows[:1])  # no replica folded its index into the rounding
    # an overflowing step (scale 2**126 blows the float32 gradients up) keeps everything
    before = jax.tree.map(np.asarray, (placed.params, placed.opt_state))  # the step donates
    scale = placed.loss_scale
    huge = placed.replace(loss_scale=scale.replace(loss_scale=scale.loss_scale * 2.0**111))
    after, metrics = p_step(huge, shards, KEY)
    assert not bool(np.asarray(metrics["grads_finite"])[0])
    for a, b in zip(jax.tree.leaves((after.params, after.opt_state)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_a_resumed_run_rounds_as_the_uninterrupted_one(tmp_path):
    from jamp.train.checkpoint import Checkpointer

    state, step, batch = _setup()
    j_step = jax.jit(step)
    whole = state
    for _ in range(4):
        whole, _ = j_step(whole, batch, KEY)
    half = state
    for _ in range(2):
        half, _ = j_step(half, batch, KEY)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, half)
        resumed = ckpt.restore(state)
    assert jax.tree.map(lambda a: a.dtype, resumed) == jax.tree.map(lambda a: a.dtype, state)
    for _ in range(2):
        resumed, _ = j_step(resumed, batch, KEY)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # and the rounding is random: another run key rounds some weight differently
    other = state
    for _ in range(4):
        other, _ = j_step(other, batch, jax.random.key(9))
    assert any(
        np.any(np.asarray(a, np.float32) != np.asarray(b, np.float32))
        for a, b in zip(jax.tree.leaves(other.params), jax.tree.leaves(whole.params))
    )


def test_legacy_keys_and_float16_params_under_the_default_rounding():
    # a raw uint32[2] PRNGKey works as a typed key does
    state, step, batch = _setup()
    new, _ = jax.jit(step)(state, batch, jax.random.PRNGKey(0))
    assert new.params["Dense_0"]["kernel"].dtype == jnp.bfloat16
    # "auto" (the default): float16 params round to nearest, where "stochastic" refuses them
    state16, step16, batch = _setup(policy="float16")
    new16, metrics = jax.jit(step16)(state16, batch, KEY)
    assert new16.params["Dense_0"]["kernel"].dtype == jnp.float16
    values = {"h": jnp.full(4, 1.0 + 2**-13), "b": jnp.full(4, 1.0 + 2**-10)}
    like = {"h": jnp.ones(4, jnp.float16), "b": jnp.ones(4, jnp.bfloat16)}
    out = rounding.round_tree(values, like, "auto", KEY)
    assert out["h"].dtype == jnp.float16 and np.all(np.asarray(out["h"]) == 1.0)  # to nearest
    assert set(np.asarray(out["b"], np.float32)) <= {1.0, 1.0078125}  # one of the neighbours
