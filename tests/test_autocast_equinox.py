"""jamp.autocast with Equinox as its users write it: a module autocast once, outside the loss, is a
pytree of its parameters (the filtered transforms see and update them), Equinox's wrappers raise
no warning of theirs, and `jax.vmap(model)(x)` (Equinox's per-example call) compiles to the
batched program's matmuls, not to a weight gradient per example."""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore

import jamp

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
X = jax.random.normal(jax.random.key(1), (64, 8))
Y = jnp.sin(X[:, :4] + X[:, 4:])


def _mlp():
    return eqx.nn.MLP(8, 4, 32, 2, key=jax.random.key(0))


def _train(model, steps=20):
    """Adam on a regression, the Equinox way: the loss vmaps the model over the batch."""
    tx = optax.adam(1e-2)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state):
        def loss(model):
            return jnp.mean((jax.vmap(model)(X) - Y) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    losses = []
    for _ in range(steps):
        model, opt_state, value = step(model, opt_state)
        losses.append(float(value))
    return model, losses


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def test_a_module_autocast_outside_the_loss_trains_as_fp32_does():
    """`model = jamp.autocast(model, policy)` once: the result holds the module's parameters as
    its leaves, so the gradients are not empty and Adam moves the loss as in fp32 (before, a
    plain function with no leaves: the loss stayed where it started)."""
    model = _mlp()
    wrapped = jamp.autocast(model, "mixed_bfloat16")
    assert len(_arrays(wrapped)) == len(_arrays(model)) > 0
    _, fp32 = _train(model)
    trained, bf16 = _train(wrapped)
    assert fp32[-1] < 0.5 * fp32[0]
    assert bf16[-1] < 0.5 * bf16[0]
    assert abs(bf16[-1] - fp32[-1]) < 0.1 * fp32[-1]
    assert isinstance(trained, jamp.Autocast) and isinstance(trained.fn, eqx.nn.MLP)
    # the trained parameters are the module's, in float32
    moved = [not np.array_equal(a, b) for a, b in zip(_arrays(trained.fn), _arrays(model))]
    assert all(moved) and {a.dtype for a in _arrays(trained.fn)} == {F32}


def test_the_float32_policy_outside_the_loss_is_bit_identical():
    model = _mlp()
    plain, _ = _train(model, steps=5)
    wrapped, _ = _train(jamp.autocast(model, "float32"), steps=5)
    for a, b in zip(_arrays(plain), _arrays(wrapped.fn)):
        np.testing.assert_array_equal(a, b)


def test_equinox_wrappers_around_autocast_raise_no_warning():
    """`filter_vmap(autocast(model))` and `filter_jit(autocast(filter_value_and_grad(f)))` drew
    Equinox's "Possibly assigning a JAX-transformed callable as an attribute" warning: jamp's
    wrapper was a plain function whose `__wrapped__` held the module's arrays."""
    model = _mlp()

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = eqx.filter_vmap(jamp.autocast(model, "mixed_bfloat16"))(X)
        value, grads = eqx.filter_jit(
            jamp.autocast(eqx.filter_value_and_grad(loss), "mixed_bfloat16")
        )(model, X)
    assert out.shape == (64, 4) and out.dtype == F32
    assert _arrays(grads) and {g.dtype for g in _arrays(grads)} == {F32}


def _matmul_operands(jaxpr):
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            yield tuple(np.dtype(v.aval.dtype) for v in e.invars)
        for sub in jcore.jaxprs_in_params(e.params):
            yield from _matmul_operands(sub)


def _optimized_cpu_program(loss, model):
    params, static = eqx.partition(model, eqx.is_array)

    def grads(p, x):
        return eqx.filter_value_and_grad(loss)(eqx.combine(p, static), x)

    return jax.jit(grads).lower(params, X).compile().as_text()


def _dots(hlo: str) -> list[str]:
    return re.findall(r"= \w+\[([\d,]*)\]\{?[\d,]*\}? dot\(", hlo)


@pytest.mark.parametrize(
    "form",
    ["vmap of the autocast module", "autocast outside the loss, vmapped in it"],
)
def test_vmap_of_an_autocast_module_compiles_to_the_batched_matmuls(form):
    """`jax.vmap(jamp.autocast(model))(x)` compiled for the CPU: the weight gradients are matmuls
    over the batch, as in fp32 and as `jamp.autocast(loss)` gives, not a product per example
    summed after (a (64, 32, 8) value per layer, which XLA kept: 2x the step's time at batch
    128 before)."""
    model = _mlp()
    wrapped = jamp.autocast(model, "mixed_bfloat16")

    def loss(m, x):
        if form == "vmap of the autocast module":
            m = jamp.autocast(m, "mixed_bfloat16")
        return jnp.mean(jax.vmap(m)(x) ** 2)

    subject = model if form.startswith("vmap") else wrapped
    ref = _optimized_cpu_program(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), model)
    got = _optimized_cpu_program(loss, subject)
    assert len(_dots(got)) == len(_dots(ref)) == 8  # 3 forward, 2 + 3 backward
    assert not re.search(r"\[64,(32|8|4),(32|8|4)\]", got)  # no per-example weight gradient
    # and still bf16 operands, forward and backward
    jaxpr = eqx.filter_make_jaxpr(eqx.filter_grad(loss))(subject, X)[0].jaxpr
    operands = set(_matmul_operands(jaxpr))
    assert operands == {(BF16, BF16)}


class _BNNet(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    out: eqx.nn.Conv2d

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.out = eqx.nn.Conv2d(8, 4, 3, padding=1, key=k2)

    def __call__(self, x, state):
        x, state = self.norm(jax.nn.relu(self.conv(x)), state)
        return self.out(x).mean(), state


def test_batchnorm_state_under_a_named_vmap_is_one_for_the_batch():
    """Equinox's BatchNorm: `jax.vmap(model, axis_name="batch", out_axes=(0, None))` over an
    autocast module; the statistics are a `pmean` over the named axis, and the state comes back
    unbatched (out_axes None), as without jamp; float32 bit-identical, bf16 close."""
    images = jax.random.normal(jax.random.key(2), (16, 3, 8, 8))
    model, state = eqx.nn.make_with_state(_BNNet)(jax.random.key(0))

    def run(m, state):
        def loss(m, state):
            out, state = jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
                images, state
            )
            return jnp.mean((out - 1.0) ** 2), state

        return eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(m, state)

    (ref, ref_state), ref_grads = run(model, state)
    (same, same_state), same_grads = run(jamp.autocast(model, "float32"), state)
    (bf16, bf16_state), bf16_grads = run(jamp.autocast(model, "mixed_bfloat16"), state)
    assert float(same) == float(ref)
    for a, b in zip(_arrays(ref_grads), _arrays(same_grads.fn)):
        np.testing.assert_array_equal(a, b)
    assert abs(float(bf16) - float(ref)) < 0.02 * abs(float(ref))
    for a, b in zip(jax.tree.leaves(ref_state), jax.tree.leaves(bf16_state)):
        assert a.shape == b.shape and a.dtype == b.dtype


def test_a_plain_function_under_vmap_keeps_its_unbatched_outputs_and_nested_vmaps():
    """Not Equinox only: `jax.vmap(jamp.autocast(f))` of a plain function, with an output that
    does not vary along the axis, keyword arguments, and a vmap inside a vmap."""
    w = jax.random.normal(jax.random.key(3), (8, 4))

    def f(w, x, *, scale):
        return jnp.tanh(x @ w) * scale, jnp.sum(w)

    mixed = jamp.autocast(f, "mixed_bfloat16", params_argnums=(0,))
    (y, total) = jax.vmap(lambda x: mixed(w, x, scale=2.0), out_axes=(0, None))(X)
    ref_y, ref_total = jax.vmap(lambda x: f(w, x, scale=2.0), out_axes=(0, None))(X)
    np.testing.assert_allclose(y, ref_y, atol=3e-2)
    assert float(total) == pytest.approx(float(ref_total), rel=1e-6)
    nested = jax.vmap(jax.vmap(lambda x: mixed(w, x, scale=1.0)[0]))(X.reshape(8, 8, 8))
    np.testing.assert_allclose(nested.reshape(64, 4), ref_y / 2, atol=3e-2)
    grads = jax.grad(lambda w: jnp.sum(jax.vmap(lambda x: mixed(w, x, scale=1.0)[0])(X)))(w)
    ref = jax.grad(lambda w: jnp.sum(jax.vmap(lambda x: f(w, x, scale=1.0)[0])(X)))(w)
    assert grads.dtype == F32
    np.testing.assert_allclose(grads, ref, rtol=5e-2, atol=5e-2)
