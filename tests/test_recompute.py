"""The engine's recomputed activation functions (jamp.engine._recompute): GELU's elementwise
region found in the traced program and evaluated under jax.checkpoint, with the same values and
gradients; on the H200 program its tanh is no longer kept for the backward."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp.engine import _recompute, rewrite


class MLP(nn.Module):
    act: str = "gelu"

    @nn.compact
    def __call__(self, x):
        act = {
            "gelu": nn.gelu,
            "gelu_exact": lambda y: nn.gelu(y, approximate=False),
            "silu": nn.silu,
        }[self.act]
        return nn.Dense(x.shape[-1])(act(nn.Dense(4 * x.shape[-1])(x)))


@pytest.fixture(autouse=True)
def _small_regions(monkeypatch):
    monkeypatch.setattr(_recompute, "MIN_ELEMENTS", 16)


def _jaxpr_of(act):
    model = MLP(act)
    x = jnp.ones((8, 16))
    params = model.init(jax.random.key(0), x)
    return jax.make_jaxpr(lambda p: model.apply(p, x))(params).jaxpr


@pytest.mark.parametrize("act, seed", [("gelu", "tanh"), ("gelu_exact", "erfc")])
def test_gelu_is_one_region_from_the_matmul_to_the_matmul(act, seed):
    jaxpr = _jaxpr_of(act)
    (region,) = _recompute.regions(jaxpr).values()
    names = [jaxpr.eqns[i].primitive.name for i in region.members]
    assert seed in names and "dot_general" not in names
    (x,) = region.inputs  # the first matmul's result
    (out,) = region.outputs  # read by the second matmul
    users = [e for e in jaxpr.eqns if out in e.invars]
    assert [e.primitive.name for e in users] == ["dot_general"]
    assert any(x in e.outvars and e.primitive.name == "add" for e in jaxpr.eqns)  # + bias


def test_silu_and_small_activations_are_left_as_traced(monkeypatch):
    assert _recompute.regions(_jaxpr_of("silu")) == {}  # XLA recomputes a sigmoid itself
    monkeypatch.setattr(_recompute, "MIN_ELEMENTS", 1 << 20)
    assert _recompute.regions(_jaxpr_of("gelu")) == {}


@pytest.mark.parametrize("act", ["gelu", "gelu_exact"])
def test_recomputed_region_gives_the_same_values_and_gradients(act):
    model = MLP(act)
    x = jax.random.normal(jax.random.key(1), (8, 16))
    params = model.init(jax.random.key(0), x)

    def loss(p):
        return jnp.sum(model.apply(p, x) ** 2)

    run = rewrite(loss, jnp.bfloat16, activations="compute")
    value, grads = jax.jit(jax.value_and_grad(run))(params)
    text = str(jax.make_jaxpr(jax.grad(run))(params))
    assert "remat" in text or "checkpoint" in text
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_recompute, "regions", lambda jaxpr: {})
        value_ref, grads_ref = jax.jit(jax.value_and_grad(run))(params)
        assert "remat" not in str(jax.make_jaxpr(jax.grad(run))(params))
    np.testing.assert_allclose(value, value_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu_compile
def test_h200_step_keeps_no_gelu_intermediate():
    """A wrapped 2-layer LM's gradient on the H200 program (XLA's plan, not a measured peak): with
    the GELU recomputed, less bf16 at the peak by about one [tokens, mlp] array per layer."""
    from jamp.models.transformer import TransformerLM

    batch, length, mlp, layers = 8, 256, 1024, 2
    model = jamp.wrap(
        TransformerLM(512, num_layers=layers, d_model=128, num_heads=2, mlp_dim=mlp),
        "mixed_bfloat16",
    )
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)

    def bf16_at_peak():
        grad = jax.grad(lambda p, t: jnp.mean(model.apply(p, t)))
        report = jamp.compile_for(grad, params, tokens, target="h200")
        return report.memory.temporaries_by_dtype["bf16"]

    recomputed = bf16_at_peak()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_recompute, "regions", lambda jaxpr: {})
        kept = bf16_at_peak()
    one = batch * length * mlp * 2
    assert kept - recomputed >= 0.9 * layers * one, (kept, recomputed)
