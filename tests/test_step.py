"""Tests for jamp.step: the mixed-precision train step, accumulation, skipping, and the eval step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore
from toy import MLP, BNNet, make_batch, make_loss_fn

import jamp
from jamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jamp.state import TrainState
from jamp.step import make_eval_step, make_train_step

KEY = jax.random.key(0)


def poison(batch, row=0):
    """Returns `batch` with one inf input: every gradient becomes non-finite."""
    return {**batch, "x": batch["x"].at[row, 0].set(jnp.inf)}


def make_state(model, tx, loss_scale=None):
    variables = model.init(KEY, jnp.ones((2, 4)))
    params = variables.pop("params")
    return TrainState.create(params, tx, model_state=variables, loss_scale=loss_scale)


def run(model, tx, batches, loss_scale=None, **kwargs):
    """Runs a jitted step over `batches`; returns the final state and the list of metrics."""
    state = make_state(model, tx, loss_scale)
    step = jax.jit(make_train_step(make_loss_fn(model), tx, **kwargs))
    history = []
    for batch in batches:
        state, metrics = step(state, batch, KEY)
        history.append(metrics)
    return state, history


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def test_train_step_reduces_loss():
    batch = make_batch()
    _, history = run(
        BNNet(),
        optax.adam(1e-2),
        [batch] * 40,
        loss_scale=DynamicLossScale(loss_scale=2.0**10, growth_interval=5),
    )
    assert float(history[-1]["loss"]) < 0.2 * float(history[0]["loss"])
    assert all(bool(m["grads_finite"]) for m in history)


def test_train_step_nonfinite_leaves_state_bit_identical():
    model, tx = BNNet(), optax.adam(1e-2)
    step = jax.jit(make_train_step(make_loss_fn(model), tx))
    state = make_state(model, tx, DynamicLossScale(loss_scale=2.0**10))
    for _ in range(2):  # non-trivial optimizer moments and batch statistics first
        state, _ = step(state, make_batch(), KEY)
    new, metrics = step(state, poison(make_batch()), KEY)
    assert_trees_equal(new.params, state.params)
    assert_trees_equal(new.opt_state, state.opt_state)
    assert_trees_equal(new.model_state, state.model_state)
    assert float(new.loss_scale.loss_scale) == 2.0**9
    assert int(new.skipped_steps) == 1 and int(new.step) == 3
    assert not bool(metrics["grads_finite"])
    assert int(metrics["skipped_steps"]) == 1 and float(metrics["loss_scale"]) == 2.0**9


def test_train_step_finite_changes_state():
    model, tx = BNNet(), optax.adam(1e-2)
    state = make_state(model, tx, DynamicLossScale(loss_scale=2.0**10))
    new, metrics = jax.jit(make_train_step(make_loss_fn(model), tx))(state, make_batch(), KEY)
    for old_tree, new_tree in [
        (state.params, new.params),
        (state.model_state, new.model_state),
        (state.opt_state, new.opt_state),
    ]:
        changed = [
            not np.array_equal(x, y)
            for x, y in zip(jax.tree.leaves(old_tree), jax.tree.leaves(new_tree))
        ]
        assert any(changed)
    assert bool(metrics["grads_finite"])
    assert int(new.step) == 1 and int(new.skipped_steps) == 0


def test_train_step_unscales_grads():
    batches = [make_batch(key=k) for k in range(3)]
    ref, ref_history = run(MLP(), optax.sgd(0.05), batches, loss_scale=NoOpLossScale())
    # growth_interval=1 grows the scale every step: unscaling by the adjusted scale would show.
    for scale in (
        StaticLossScale(2.0**10),
        DynamicLossScale(loss_scale=2.0**10, growth_interval=1),
    ):
        got, history = run(MLP(), optax.sgd(0.05), batches, loss_scale=scale)
        # A power-of-two scale is exact, but the scaled program may fuse and sum in another order
        # (seen with JAX 0.12 on one CPU); unscaling by the adjusted scale would be off by 2x.
        assert_trees_close(got.params, ref.params, rtol=1e-5, atol=1e-8)
        # The reported loss and norm are in true units, not scaled ones.
        np.testing.assert_allclose(history[-1]["loss"], ref_history[-1]["loss"], rtol=1e-5)
        np.testing.assert_allclose(
            history[-1]["grad_norm"], ref_history[-1]["grad_norm"], rtol=1e-5
        )


def test_train_step_clips_unscaled_grads():
    model, batch = MLP(), make_batch()
    state = make_state(model, optax.sgd(1.0), StaticLossScale(2.0**10))
    loss_fn = make_loss_fn(model)
    grads = jax.grad(lambda p: loss_fn(p, {}, batch, KEY)[0])(state.params)
    norm = float(optax.tree.norm(grads))
    max_norm = 0.1 * norm
    step = make_train_step(loss_fn, optax.sgd(1.0), max_grad_norm=max_norm)
    new, metrics = jax.jit(step)(state, batch, KEY)
    expected = jax.tree.map(lambda p, g: p - g * (max_norm / norm), state.params, grads)
    assert_trees_close(new.params, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-5)  # before clipping


def test_train_step_metrics():
    _, (metrics,) = run(
        MLP(), optax.sgd(0.1), [make_batch()], loss_scale=DynamicLossScale(loss_scale=2.0**10)
    )
    assert set(metrics) == {
        "loss",
        "mse",
        "grad_norm",
        "loss_scale",
        "grads_finite",
        "skipped_steps",
        "grads_finite_by_module",
    }
    for name in ("loss", "mse", "grad_norm", "loss_scale"):
        assert metrics[name].dtype == jnp.float32
    np.testing.assert_allclose(metrics["mse"], metrics["loss"])


def test_train_step_finishes_16bit_loss_in_fp32():
    def loss_fn(params, model_state, batch, rng):
        loss = jnp.sum(params["w"] ** 2).astype(jnp.bfloat16)
        return loss, (model_state, {})

    state = TrainState.create({"w": jnp.ones(3)}, optax.sgd(0.1))
    _, metrics = jax.jit(make_train_step(loss_fn, optax.sgd(0.1)))(state, {}, KEY)
    assert metrics["loss"].dtype == jnp.float32


def test_train_step_folds_step_into_rng():
    def loss_fn(params, model_state, batch, rng):
        noise = jax.random.uniform(rng)
        return jnp.sum(params["w"]) * 0.0, (model_state, {"noise": noise})

    tx = optax.sgd(0.1)
    state = TrainState.create({"w": jnp.ones(3)}, tx)
    step = jax.jit(make_train_step(loss_fn, tx))
    state, first = step(state, {}, KEY)
    _, second = step(state, {}, KEY)  # same base key, next step: fresh randomness
    assert float(first["noise"]) != float(second["noise"])


def test_dynamic_loss_scale_grows_and_is_reported_after_adjusting():
    _, history = run(
        MLP(),
        optax.sgd(0.01),
        [make_batch()] * 4,
        loss_scale=DynamicLossScale(loss_scale=2.0**4, growth_interval=2),
    )
    assert [float(m["loss_scale"]) for m in history] == [2.0**4, 2.0**5, 2.0**5, 2.0**6]


def test_accumulation_matches_one_step_on_the_whole_batch():
    batches = [make_batch(key=k) for k in range(3)]
    kwargs = dict(loss_scale=DynamicLossScale(loss_scale=2.0**10, growth_interval=2))
    whole, whole_history = run(MLP(), optax.adam(1e-2), batches, **kwargs)
    micro, micro_history = run(MLP(), optax.adam(1e-2), batches, accumulation_steps=4, **kwargs)
    assert_trees_close(micro.params, whole.params)
    assert_trees_close(micro.opt_state, whole.opt_state)
    assert float(micro.loss_scale.loss_scale) == float(whole.loss_scale.loss_scale)
    for m, w in zip(micro_history, whole_history):
        np.testing.assert_allclose(m["loss"], w["loss"], rtol=1e-5)
        np.testing.assert_allclose(m["grad_norm"], w["grad_norm"], rtol=1e-5)


def test_accumulation_threads_model_state_through_microbatches():
    model, tx = BNNet(), optax.sgd(0.1)
    state = make_state(model, tx)
    batch = make_batch(8)
    new, _ = jax.jit(make_train_step(make_loss_fn(model), tx, accumulation_steps=2))(
        state, batch, KEY
    )
    expected, loss_fn = state.model_state, make_loss_fn(model)
    for half in (slice(0, 4), slice(4, 8)):  # microbatches run in order, each updating the stats
        _, (expected, _) = loss_fn(
            state.params,
            expected,
            jax.tree.map(lambda x: x[half], batch),  # noqa: B023 (called at once)
            KEY,
        )
    assert_trees_close(new.model_state, expected)


def test_accumulation_one_bad_microbatch_skips_the_step():
    model, tx = BNNet(), optax.adam(1e-2)
    state = make_state(model, tx, DynamicLossScale(loss_scale=2.0**10))
    step = jax.jit(make_train_step(make_loss_fn(model), tx, accumulation_steps=4))
    new, metrics = step(state, poison(make_batch(), row=9), KEY)  # third microbatch only
    assert not bool(metrics["grads_finite"])
    assert_trees_equal(new.params, state.params)
    assert_trees_equal(new.opt_state, state.opt_state)
    assert_trees_equal(new.model_state, state.model_state)
    assert int(new.skipped_steps) == 1


def test_accumulation_rejects_an_indivisible_batch():
    model, tx = MLP(), optax.sgd(0.1)
    step = make_train_step(make_loss_fn(model), tx, accumulation_steps=4)
    with pytest.raises(ValueError, match=r"batch size 10 .*accumulation_steps=4"):
        step(make_state(model, tx), make_batch(10), KEY)


@pytest.mark.parametrize(
    "kwargs", [dict(accumulation_steps=0), dict(accumulation_steps=1.5), dict(max_grad_norm=0.0)]
)
def test_make_train_step_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        make_train_step(make_loss_fn(MLP()), optax.sgd(0.1), **kwargs)


@pytest.mark.parametrize(
    "loss_scale, kwargs",
    [
        (NoOpLossScale(), {}),
        (StaticLossScale(2.0**8), dict(max_grad_norm=1.0)),
        (DynamicLossScale(loss_scale=2.0**8, growth_interval=1), dict(accumulation_steps=2)),
    ],
    ids=["noop", "static-clip", "dynamic-accumulate"],
)
def test_jitted_train_step_compiles_once(loss_scale, kwargs):
    model, tx = BNNet(), optax.adam(1e-3)
    state = make_state(model, tx, loss_scale)
    step = jax.jit(make_train_step(make_loss_fn(model), tx, **kwargs))
    types = [jax.typeof(x) for x in jax.tree.leaves(state)]
    # Finite and non-finite steps alike: neither may change a leaf's dtype or weak type.
    for batch in (make_batch(), poison(make_batch()), make_batch()):
        state, _ = step(state, batch, KEY)
    assert [jax.typeof(x) for x in jax.tree.leaves(state)] == types
    assert step._cache_size() == 1


def test_train_step_rejects_model_state_of_another_structure():
    def loss_fn(params, model_state, batch, rng):
        return jnp.sum(params["w"] ** 2), ({"other": jnp.zeros(())}, {})

    tx = optax.sgd(0.1)
    state = TrainState.create({"w": jnp.ones(3)}, tx, model_state={"stats": jnp.zeros(())})
    with pytest.raises(ValueError, match="model_state"):
        make_train_step(loss_fn, tx)(state, {}, KEY)


def test_eval_step():
    model = BNNet()
    state = make_state(model, optax.sgd(0.1))
    batch = make_batch()

    def eval_fn(params, model_state, batch):
        out = model.apply({"params": params, **model_state}, batch["x"], train=False)
        return {"mse": jnp.mean((out[:, 0] - batch["y"]) ** 2), "count": batch["x"].shape[0]}

    metrics = jax.jit(make_eval_step(eval_fn))(state, batch)
    np.testing.assert_allclose(
        metrics["mse"], eval_fn(state.params, state.model_state, batch)["mse"], rtol=1e-6
    )
    assert metrics["count"].dtype == jnp.float32 and float(metrics["count"]) == 16.0


class Loud(nn.Module):
    """A zero-initialised Dense whose output is multiplied by `gain`: it adds nothing to the
    forward pass, but its own gradients are `gain` times larger."""

    gain: float

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, kernel_init=nn.initializers.zeros)(x) * self.gain


class TwoHeads(nn.Module):
    """`quiet` and `loud` read the same input and add up: an overflow in one stays there."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, name="quiet")(x) + Loud(1e35, name="loud")(x)


def test_train_step_names_the_modules_whose_grads_overflowed():
    model, batch = TwoHeads(), make_batch()
    # 1e35 x 2**15 overflows float32 in loud's gradients only.
    state, (metrics,) = run(model, optax.sgd(0.1), [batch], loss_scale=StaticLossScale(2.0**15))
    flags = {name: bool(v) for name, v in metrics["grads_finite_by_module"].items()}
    assert flags == {"quiet": True, "loud": False}
    assert not bool(metrics["grads_finite"])
    assert int(state.skipped_steps) == 1
    # Finite everywhere: every flag True, and the same flags whatever the scale.
    _, (healthy,) = run(MLP(), optax.sgd(0.1), [batch], loss_scale=StaticLossScale(2.0**15))
    healthy_flags = {k: bool(v) for k, v in healthy["grads_finite_by_module"].items()}
    assert healthy_flags == {"Dense_0": True, "Dense_1": True}


def test_train_step_attribution_is_agreed_across_replicas():
    # The flags come from the averaged grads: the same on every replica even when the inf came
    # from one replica's shard of the batch.
    from jamp import parallel

    n = jax.local_device_count()
    batch = poison(make_batch(size=4 * n), row=0)  # the inf lands on replica 0 only
    model = MLP()
    tx = optax.sgd(0.1)
    state = parallel.replicate(make_state(model, tx))
    step = parallel.make_p_train_step(
        make_train_step(make_loss_fn(model), tx, axis_name=parallel.AXIS_NAME)
    )
    _, metrics = step(state, parallel.shard(batch), KEY)
    for name, flags in metrics["grads_finite_by_module"].items():
        assert np.asarray(flags).shape == (n,)
        assert not np.asarray(flags).any(), name


def test_train_step_attribution_depth_zero_is_the_single_flag():
    batch = make_batch()
    model = TwoHeads()
    state, (metrics,) = run(
        model, optax.sgd(0.1), [batch], StaticLossScale(2.0**15), attribution_depth=0
    )
    assert "grads_finite_by_module" not in metrics
    assert not bool(metrics["grads_finite"]) and int(state.skipped_steps) == 1
    with pytest.raises(ValueError, match="attribution_depth"):
        make_train_step(make_loss_fn(MLP()), optax.sgd(0.1), attribution_depth=-1)


def test_step_warns_once_about_float16_without_a_loss_scale(monkeypatch):
    import warnings

    from jamp.step import _float16 as step_lib

    monkeypatch.setattr(step_lib, "_WARNED_UNSCALED", [])
    model = jamp.wrap(nn.Dense(4), "mixed_float16")
    x = jnp.ones((2, 3))
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.sgd(0.1)

    def loss_fn(p, s, b, r):
        return jnp.mean(model.apply({"params": p}, b)), (s, {})

    def run(**kw):
        state = jamp.TrainState.create(params, tx, **kw)
        jax.jit(jamp.make_train_step(loss_fn, tx))(state, x, jax.random.key(0))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(loss_scale=jamp.loss_scale_for("mixed_float16"))
        assert not caught
        run()
        run()
    (warning,) = caught
    assert "without a loss scale" in str(warning.message)
    assert "jamp.loss_scale_for(policy)" in str(warning.message)


def test_bare_loss_gets_one_line_saying_what_loss_fn_returns():
    params = {"w": jnp.ones(3)}
    tx = optax.sgd(0.1)
    step = jamp.make_train_step(lambda p, s, b, r: jnp.sum(p["w"] * b), tx)
    with pytest.raises(
        TypeError, match=r"loss_fn must return \(loss, \(new_model_state, metrics\)\)"
    ):
        step(jamp.TrainState.create(params, tx), jnp.ones(3), jax.random.key(0))


def _lm_run(compute_dtype, batches, accumulation_steps=1):
    """A wrapped TransformerLM under mixed_bfloat16 (a dynamic scale), stepped over `batches`."""
    from jamp.models import TransformerLM

    model = jamp.wrap(
        TransformerLM(vocab_size=64, num_layers=2, d_model=32, num_heads=2, mlp_dim=64),
        "mixed_bfloat16",
    )
    tokens = jnp.zeros((1, 9), jnp.int32)
    params = model.init(KEY, tokens[:, :-1])["params"]
    tx = optax.adam(1e-2)

    def loss_fn(p, model_state, batch, rng):
        logits = model.apply({"params": p}, batch["tokens"][:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        return loss.mean() * batch["scale"][0], (model_state, {})  # inf: every gradient overflows

    state = TrainState.create(
        params, tx, loss_scale=DynamicLossScale(2.0**10), compute_dtype=compute_dtype
    )
    step = jax.jit(make_train_step(loss_fn, tx, accumulation_steps=accumulation_steps))
    states, history = [state], []
    for batch in batches:
        state, metrics = step(state, batch, KEY)
        states.append(state)
        history.append(metrics)
    return states, history, (step, loss_fn)


def _tokens(key, rows=4, scale=1.0):
    tokens = jax.random.randint(jax.random.key(key), (rows, 9), 0, 64)
    return {"tokens": tokens, "scale": jnp.full((rows,), scale)}


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_compute_params_are_read_instead_of_cast_and_change_no_bit(accumulation_steps):
    """With `compute_dtype`, the state keeps bfloat16 copies of the params' matrices that the
    update writes and the matmuls read: the same bits as casting every step, a skipped step
    included (its copies stay the same), and no cast of a param left in the forward pass."""
    batches = [_tokens(1), _tokens(2), _tokens(3, scale=jnp.inf), _tokens(4)]
    cast, cast_history, _ = _lm_run(None, batches, accumulation_steps)
    kept, kept_history, (step, _) = _lm_run(jnp.bfloat16, batches, accumulation_steps)
    for a, b in zip(cast, kept):
        assert_trees_equal(a.params, b.params)
        assert_trees_equal(a.opt_state, b.opt_state)
        assert_trees_equal(jamp.copies.compute_copies(b.params, jnp.bfloat16), b.compute_params)
    for a, b in zip(cast_history, kept_history):
        assert_trees_equal(a, b)
    assert [int(m["skipped_steps"]) for m in kept_history] == [0, 0, 1, 1]
    assert_trees_equal(kept[3].compute_params, kept[2].compute_params)
    copies = [c for c in jax.tree.leaves(kept[0].compute_params)]
    assert copies and all(c.dtype == jnp.bfloat16 and c.ndim >= 2 for c in copies)
    # the matrices are all that is copied: biases and norm scales stay float32 only
    assert len(copies) < len(jax.tree.leaves(kept[0].params))

    # In the step's program, no cast of a float32 param to bfloat16 is left in the model: the
    # step casts each once, for the next step's copies (without copies the model casts each
    # matrix it multiplies, Embed.attend's transposed table included).
    def param_casts(state):
        shapes = {p.shape for p in jax.tree.leaves(state.params) if p.ndim >= 2}
        jaxpr = jax.make_jaxpr(step)(state, batches[0], KEY)
        found = {"model": 0, "step": 0}

        def walk(jx):
            for eqn in jx.eqns:
                if eqn.primitive.name == "convert_element_type":
                    (x,), (y,) = eqn.invars, eqn.outvars
                    if (x.aval.dtype, y.aval.dtype) == (jnp.float32, jnp.bfloat16):
                        if x.aval.shape in shapes:
                            model = "Wrapped.apply" in str(eqn.source_info.name_stack)
                            found["model" if model else "step"] += 1
                for sub in jcore.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jaxpr.jaxpr)
        return found

    paths = [
        jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(kept[0].params)
    ]
    kernels = sum("kernel" in k for k in paths) + 1  # and the tied embedding

    assert param_casts(kept[0]) == {"model": 0, "step": len(copies)}
    assert param_casts(cast[0])["model"] >= kernels


def test_replacing_params_makes_their_compute_copies_again():
    states, _, _ = _lm_run(jnp.bfloat16, [])
    state = states[0]
    doubled = jax.tree.map(lambda p: p * 2, state.params)
    new = state.replace(params=doubled)
    assert_trees_equal(new.compute_params, jamp.copies.compute_copies(doubled, jnp.bfloat16))
    # copies given with the params are kept as given; a state without copies gets none
    assert new.replace(params=doubled, compute_params=None).compute_params is None
    assert TrainState.create(doubled, optax.adam(1e-2)).compute_params is None
