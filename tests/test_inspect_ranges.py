"""fp16 range hazards (jamp.inspect.ranges): per-module magnitudes on a real batch."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from toy import NnxView, nnx_boom_net

import jamp
from jamp.inspect.ranges import range_report


class _Boom(nn.Module):
    """A Dense whose output is scaled by 1e4: past float16's 65504 for inputs of size ~10."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(x) * 1e4


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8)(x))
        x = _Boom(name="boom")(x)
        x = nn.LayerNorm()(x)  # brings the values back into range for what follows
        return nn.Dense(3)(x)


def _setup(model):
    x = 10.0 * jax.random.normal(jax.random.key(1), (16, 4))
    y = jnp.arange(16) % 3
    variables = model.init(jax.random.key(0), x)

    def loss(params):
        logits = model.apply({**variables, "params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return variables, x, loss


def test_ranges_flag_exactly_the_module_that_overflows_in_fp16():
    model = jamp.wrap(_Net(), "mixed_float16")
    variables, x, loss = _setup(model)
    ranges = range_report(model, variables, x, loss_fn=loss, loss_scale=jamp.StaticLossScale(1.0))
    assert ranges.flagged == ["boom"]
    boom = ranges.row("boom")
    assert boom.max_activation > 65504 and boom.activation_headroom < 0
    assert math.isclose(boom.activation_headroom, math.log2(65504 / boom.max_activation))
    assert ranges.row("boom/Dense_0").max_activation < 65504  # the Dense itself is fine
    table = ranges.table()
    assert table.count("overflows") == 1 and "overflowing: boom" in table
    # Paths are the Flax module paths, parents before children, in call order.
    assert [r.path for r in ranges.rows] == [
        "",
        "Dense_0",
        "boom",
        "boom/Dense_0",
        "LayerNorm_0",
        "Dense_1",
    ]


def test_ranges_scaled_gradients_overflow_at_a_too_large_loss_scale():
    model = jamp.wrap(_Net(), "mixed_float16")
    variables, x, loss = _setup(model)
    ranges = range_report(model, variables, x, loss_fn=loss, loss_scale=2.0**24)
    assert ranges.loss_scale == 2.0**24
    over = [r.path for r in ranges.rows if r.grad_headroom is not None and r.grad_headroom < 0]
    assert over and set(over) <= set(ranges.flagged)
    assert "scaled grad overflows" in ranges.table()


class _Tiny(nn.Module):
    """A layer whose gradients are ~1e-9: they round to zero in float16 without a loss scale."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="small")(x) * 1e-9 + nn.Dense(4, name="big")(x)


def test_ranges_show_what_the_loss_scale_buys_against_underflow():
    model = _Tiny()
    variables, x, loss = _setup(model)
    ranges = range_report(model, variables, x, loss_fn=loss, loss_scale=2.0**10)
    small, big = ranges.row("small"), ranges.row("big")
    assert small.flushed_unscaled > 0.5  # most of its gradient is lost at scale 1 ...
    assert small.flushed_scaled < 0.1  # ... and kept at 2^10
    assert big.flushed_unscaled < 0.1
    assert small.grad_count == 4 * 4 + 4
    assert not ranges.flagged


class _Normed(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(3)(nn.Dropout(0.5, deterministic=not train)(x))


def test_ranges_on_the_training_programs_state_and_loss_fn(tmp_path):
    model = jamp.wrap(_Normed(), "mixed_float16")
    x = jax.random.normal(jax.random.key(1), (16, 4))
    batch = {"image": x, "label": jnp.arange(16) % 3}
    variables = dict(model.init(jax.random.key(0), x))
    params = variables.pop("params")
    state = jamp.TrainState.create(
        params, optax.sgd(0.1), model_state=variables, loss_scale=jamp.DynamicLossScale(2.0**15)
    )

    def loss_fn(params, model_state, batch, rng):  # the training program's form
        logits, new_state = model.apply(
            {"params": params, **model_state},
            batch["image"],
            train=True,
            rngs={"dropout": rng},
            mutable=list(model_state),
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, (new_state, {})

    rng = jax.random.key(2)
    ranges = range_report(
        model,
        {"params": state.params, **state.model_state},
        batch["image"],
        loss_fn=lambda p: loss_fn(p, state.model_state, batch, rng)[0],
        loss_scale=state.loss_scale,
        train=True,
        rngs={"dropout": rng},
        mutable=list(state.model_state),
    )
    assert ranges.loss_scale == 2.0**15
    assert {r.path for r in ranges.rows} == {"", "Dense_0", "BatchNorm_0", "Dropout_0", "Dense_1"}
    assert ranges.row("Dense_0").max_scaled_grad > 0
    png = ranges.plot(tmp_path / "plots" / "ranges.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ranges_activations_only_without_a_loss():
    model = _Net()
    variables, x, _ = _setup(model)
    ranges = range_report(model, variables, x)
    assert ranges.flagged == ["boom"]
    assert all(r.max_scaled_grad is None and r.grad_count == 0 for r in ranges.rows)


# ----- a jamp.wrapped NNX model: outputs read with jamp.nnx.capturing_outputs


def test_nnx_capturing_outputs_reads_every_submodules_largest_output():
    model = nnx_boom_net("mixed_float16")
    x = 10.0 * jax.random.normal(jax.random.key(1), (16, 4))

    @jax.jit
    def run(x):  # the maxima are values of the caller's trace: returned from it
        with jamp.nnx.capturing_outputs() as maxima:
            logits = model(x)
        return logits, maxima

    logits, maxima = run(x)
    assert set(maxima) == {"", "hidden", "boom", "boom/linear", "norm", "head"}
    assert float(maxima[""]) == float(jnp.max(jnp.abs(logits)))
    assert float(maxima["boom"]) > 65504 > float(maxima["boom/linear"])
    assert float(maxima["norm"]) < 10
    # Outside the context the model's program holds no extra reductions.
    plain = jax.make_jaxpr(lambda x: model(x))(x)
    with jamp.nnx.capturing_outputs():
        captured = jax.make_jaxpr(lambda x: model(x))(x)
    assert len(str(captured)) > len(str(plain))


def test_ranges_flag_the_nnx_submodule_that_overflows_in_fp16():
    view = NnxView(nnx_boom_net("mixed_float16"))
    x = 10.0 * jax.random.normal(jax.random.key(1), (16, 4))
    y = jnp.arange(16) % 3

    def loss(params):
        logits = view.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    ranges = range_report(view, view.variables, x, loss_fn=loss, loss_scale=1.0)
    assert ranges.flagged == ["boom"]
    # NNX's attribute paths, parents before children, in call order (as for linen above).
    assert [r.path for r in ranges.rows] == ["", "hidden", "boom", "boom/linear", "norm", "head"]
    assert ranges.row("boom/linear").max_scaled_grad is not None


def test_nnx_capturing_outputs_keeps_to_the_models_own_trace():
    from flax import nnx

    class Inner(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return self.a(x)

    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.inner = jamp.wrap(Inner(rngs), "mixed_bfloat16")  # a wrapped model inside
            self.b = nnx.Linear(4, 4, rngs=rngs)
            self.c = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            y = self.b(self.inner(x))
            return jax.checkpoint(lambda y: self.c(y))(y)  # c runs in remat's own trace

    model = jamp.wrap(Outer(nnx.Rngs(0)), "mixed_float16")

    @jax.jit
    def run(x):
        with jamp.nnx.capturing_outputs() as outer:
            with jamp.nnx.capturing_outputs() as inner:  # nested contexts: both collect
                out = model(x)
            first = dict(inner)
        return out, first, outer

    out, first, outer = run(jnp.ones((2, 4)))
    # No value of another trace escapes (neither remat's nor the nested model's call), and
    # both contexts saw the model's own submodule and output.
    assert set(first) == set(outer) == {"", "b"}
    assert float(outer[""]) == float(jnp.max(jnp.abs(out)))


def test_ranges_take_an_nnx_model_as_users_hold_it():
    """range_report(model, x, loss_fn=lambda model: ...): the same table as through the
    training program's view of the model."""
    model = nnx_boom_net("mixed_float16")
    view = NnxView(nnx_boom_net("mixed_float16"))
    x = 10.0 * jax.random.normal(jax.random.key(1), (16, 4))
    y = jnp.arange(16) % 3

    def loss(logits):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    held = range_report(model, x, loss_fn=lambda m: loss(m(x)), loss_scale=8.0)
    program = range_report(
        view,
        view.variables,
        x,
        loss_fn=lambda p: loss(view.apply({"params": p}, x)),
        loss_scale=8.0,
    )
    assert held.flagged == program.flagged == ["boom"]
    assert [r.path for r in held.rows] == [r.path for r in program.rows]
    for a, b in zip(held.rows, program.rows):
        assert a.max_activation == b.max_activation, a.path
        assert a.grad_count == b.grad_count, a.path
        if b.max_scaled_grad is not None and math.isfinite(b.max_scaled_grad):
            assert math.isclose(a.max_scaled_grad, b.max_scaled_grad, rel_tol=1e-6), a.path
