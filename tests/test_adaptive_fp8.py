"""Adaptive precision under an fp8 policy: a matmul site whose values keep being clipped moves
to bfloat16 alone, and the fp8 state follows the new site set.

The model: `grows` reads an input that is 3 times larger every step (a stand-in for activations
that outgrow their delayed scale: under delayed scaling each step's values are quantised with the
scale of the previous steps' amax, so they are clipped by a factor 3); `steady` reads a layer
norm of its output and is never clipped; the output head is bfloat16 under the policy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp import adaptive, fp8, scopes
from jamp.step import FP8_SATURATION

BATCH = 8


class Grows(nn.Module):
    @nn.compact
    def __call__(self, x, gain):
        h = nn.Dense(16, name="grows")(x * gain)
        h = nn.relu(nn.Dense(16, name="steady")(nn.LayerNorm()(h)))
        return nn.Dense(4, name="head")(h)  # an fp8 policy keeps the output head in bf16


def _setup(overrides=None):
    model = jamp.wrap(Grows(), "mixed_fp8", overrides)
    x = jax.random.normal(jax.random.key(1), (BATCH, 8))
    y = jnp.arange(BATCH) % 4

    def loss_fn(params, model_state, batch, rng):
        logits = model.apply({"params": params}, batch["x"], batch["gain"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return loss.mean(), (model_state, {})

    return model, loss_fn, x


def _batch(x, step):
    return {"x": x, "gain": jnp.float32(3.0**step)}


def _fp8_dots(loss_fn, params, x) -> int:
    """The forward and backward matmuls of the loss's gradient that take E4M3 operands."""
    grad = jax.grad(lambda p: loss_fn(p, {}, _batch(x, 1), None)[0])
    text = jax.jit(grad).lower(params).as_text()
    return sum("f8E4M3FN" in line for line in text.splitlines() if "dot_general" in line)


def test_a_site_clipped_on_k_of_n_steps_moves_to_bfloat16_alone_and_the_state_follows():
    model, loss_fn, x = _setup()
    params = model.init(jax.random.key(0), x, jnp.float32(1.0))["params"]
    tx = optax.sgd(1e-3)
    f8 = fp8.init_state(loss_fn, params, {}, _batch(x, 0), jax.random.key(0), history=4)
    assert sorted(f8.sites) == ["grows/dot_general", "steady/dot_general"]
    state = jamp.TrainState.create(params, tx, fp8_state=f8)
    step = jax.jit(jamp.make_train_step(loss_fn, tx))
    assert _fp8_dots(loss_fn, params, x) == 5
    modules = ["grows", "LayerNorm_0", "steady", "head"]
    ctl = adaptive.Controller("mixed_fp8", modules, k=6, n=50, start={"LayerNorm_0": "float32"})
    cstate = ctl.init()
    seen, decided = [], {}
    for t in range(1, 8):
        state, metrics = step(state, _batch(x, t), jax.random.key(0))
        got = jax.device_get(metrics[FP8_SATURATION])
        assert all(np.shape(v) == (3,) for v in got.values())  # x, w and g
        ratios = {k: float(np.max(v)) for k, v in got.items()}
        seen.append(ratios)
        assert bool(metrics["grads_finite"])  # clipping skips nothing: it is silent
        clipped = adaptive.saturated(ratios, modules)
        cstate = ctl.observe(cstate, t, skipped=False, at_floor=False, saturated=clipped)
        if t >= 6:
            cstate, decided[t] = ctl.decide(cstate, t)
    # The first step only measures (a fresh state); then `grows` is clipped by 3 each step.
    assert seen[0]["grows/dot_general"] == 0.0
    assert all(r["grows/dot_general"] == pytest.approx(3.0, rel=1e-3) for r in seen[1:])
    assert all(r["steady/dot_general"] < adaptive.SATURATION_LIMIT for r in seen)
    assert decided[6] == []  # steps 2-6: 5 clipped steps of the 6 needed
    changes = decided[7]
    assert [(c.module, c.from_dtype, c.to_dtype) for c in changes] == [
        ("grows", "float8_e4m3fn", "bfloat16")
    ]
    assert "saturated its fp8 range on 6 of the last 50 steps" in changes[0].describe()

    # The model under the promotion: `grows` multiplies in bfloat16, its site is gone; the
    # surviving site keeps its history and scale bit for bit.
    model, loss_fn, _ = _setup(ctl.overrides(cstate))
    fresh = fp8.init_state(loss_fn, state.params, {}, _batch(x, 0), jax.random.key(0), history=4)
    rebuilt = fp8.carry_over(fresh, state.fp8_state)
    assert list(rebuilt.sites) == ["steady/dot_general"]
    old = state.fp8_state.sites["steady/dot_general"]
    jax.tree.map(np.testing.assert_array_equal, rebuilt.sites["steady/dot_general"], old)
    assert float(jnp.max(old.amax_history)) > 0  # a real history was carried over
    # steady's forward, input and weight gradients; grows's forward and weight gradient gone
    assert _fp8_dots(loss_fn, state.params, x) == 3
    state = state.replace(fp8_state=rebuilt)
    step = jax.jit(jamp.make_train_step(loss_fn, tx))
    state, metrics = step(state, _batch(x, 8), jax.random.key(0))
    assert bool(metrics["grads_finite"])
    assert list(metrics[FP8_SATURATION]) == ["steady/dot_general"]


def test_saturation_counts_only_for_modules_computing_in_fp8():
    ctl = adaptive.Controller("mixed_fp8", ["a", "norm"], k=2, n=10, start={"norm": "float32"})
    s = ctl.init()
    s = ctl.observe(s, 1, skipped=False, at_floor=False, saturated=["a", "norm", "other"])
    # Clipped on a step skipped at the loss scale's floor for another module's overflow: it
    # counts towards k, but only an overflow at the floor promotes at once.
    s = ctl.observe(s, 2, skipped=True, at_floor=True, blamed=["norm"], saturated=["a"])
    assert np.asarray(s.history).sum(axis=0).tolist() == [2, 1]
    assert np.asarray(s.floor_blamed).tolist() == [False, True]
    s, changes = ctl.decide(s, 2)
    assert [(c.module, c.to_dtype) for c in changes] == [("a", "bfloat16")]  # norm: float32
    # in bfloat16 now, `a` has no fp8 range to saturate
    s = ctl.observe(s, 3, skipped=False, at_floor=False, saturated=["a"])
    assert not np.asarray(s.history)[:, 0].any()


def test_sites_belong_to_the_module_their_name_gives_the_params_path_of():
    modules = ["DecoderBlock_0", "DecoderBlock_0/Dense_0", "blocks/0/mlp_in", "mlp_in"]
    assert adaptive.site_module("DecoderBlock_0/Dense_0/dot_general_1", modules) == (
        "DecoderBlock_0/Dense_0"
    )
    assert adaptive.site_module("blocks/0/mlp_in/dot_general", modules) == "blocks/0/mlp_in"
    assert adaptive.site_module("dot_general", modules) == ""  # the model's own (a tied head)
    # a module not in `modules` (not a candidate): the nearest one enclosing it
    assert adaptive.site_module("DecoderBlock_0/Dense_1/dot_general", modules) == "DecoderBlock_0"
    assert adaptive.site_module("encoder/proj/dot_general", modules) == ""  # autocast's scopes
    ratios = {"DecoderBlock_0/Dense_0/dot_general": 2.5, "blocks/0/mlp_in/dot_general": 1.9}
    assert adaptive.saturated(ratios, modules) == ("DecoderBlock_0/Dense_0",)
    assert adaptive.saturated({"mlp_in/dot_general": float("nan")}, modules) == ()


def test_nnx_fp8_sites_are_named_by_attribute_path():
    assert scopes.plain(
        "jamp_nnx_root(LM)/jamp_nnx(blocks.0)/jamp_nnx(blocks.0.mlp_in)/dot_general"
    ) == ("LM/blocks/0/mlp_in/dot_general")
    assert scopes.plain("jamp_nnx_root(LM)/dot_general") == "LM/dot_general"
    assert scopes.plain("LM/Dense_0/dot_general") == "LM/Dense_0/dot_general"
    # a wrapped model called inside another's submodule names its own sites
    nested = "jamp_nnx_root(Outer)/jamp_nnx(enc)/jamp_nnx_root(Inner)/dot_general"
    assert scopes.plain(nested) == "Inner/dot_general"
    # the fp8 site's module: the innermost call scope's attribute path, without the class name
    stack = "jamp_nnx_root(LM)/jamp_nnx(blocks.0)/jamp_nnx(blocks.0.mlp_in)/einsum/BSD,DF->BSF"
    assert scopes.nnx_path(stack) == "blocks/0/mlp_in"
    assert scopes.nnx_path("jamp_nnx_root(LM)/head") == ""  # the model's own
    assert scopes.nnx_path(nested) == ""  # the inner model's own
    assert scopes.nnx_path("LM/Dense_0") is None  # linen's scopes: no NNX model's
