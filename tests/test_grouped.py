"""Grouped GEMMs (`jax.lax.ragged_dot`, a mixture of experts) under a policy: bf16 operands with
float32 accumulation forward and backward, float32 gradients for float32 experts, the same
values as JAX's own grouped GEMM within a bf16 rounding, and the float32 policy as written."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jamp
from jamp import grouped
from jamp.engine import _matmuls

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
TOKENS, D, F, EXPERTS, TOP_K = 32, 16, 24, 4, 2


class MoE(nn.Module):
    """A top-k mixture of experts as MoE layers write it: a router, the tokens sorted by expert,
    a gated MLP of grouped GEMMs (`lax.ragged_dot`), the outputs weighted back in place."""

    @nn.compact
    def __call__(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        logits = nn.Dense(EXPERTS, use_bias=False, name="router")(tokens)
        weights, experts = lax.top_k(jax.nn.softmax(logits), TOP_K)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat)
        rows = jnp.repeat(tokens, TOP_K, axis=0)[order]
        sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
        init = nn.initializers.lecun_normal()
        gate = self.param("gate", init, (EXPERTS, tokens.shape[-1], F))
        up = self.param("up", init, (EXPERTS, tokens.shape[-1], F))
        down = self.param("down", init, (EXPERTS, F, tokens.shape[-1]))
        h = jax.nn.silu(lax.ragged_dot(rows, gate, sizes)) * lax.ragged_dot(rows, up, sizes)
        out = lax.ragged_dot(h, down, sizes)
        out = jnp.zeros_like(out).at[order].set(out).reshape(-1, TOP_K, out.shape[-1])
        return (out * weights[..., None]).sum(1).reshape(x.shape)


class MoELM(nn.Module):
    @nn.compact
    def __call__(self, t):
        x = nn.Embed(64, D)(t)
        x = x + MoE()(nn.LayerNorm()(x))
        return nn.Dense(64)(nn.LayerNorm()(x))


def _ragged_dtypes(jaxpr) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) dtypes of every `ragged_dot_general`, sub-programs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ragged_dot_general":
            found.append(tuple(str(v.aval.dtype) for v in (*eqn.invars[:2], eqn.outvars[0])))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _ragged_dtypes(sub)
    return found


def _setup():
    tokens = jax.random.randint(jax.random.key(0), (4, 9), 0, 64)
    batch = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}
    params = MoELM().init(jax.random.key(1), batch["inputs"])["params"]
    return batch, params


def _loss_fn(model):
    def loss_fn(params, model_state, batch, rng):
        logits = model.apply({"params": params}, batch["inputs"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return loss, (model_state, {})

    return loss_fn


def _train(policy, steps=20):
    batch, params = _setup()
    model = jamp.wrap(MoELM(), policy) if policy else MoELM()
    tx = optax.adam(3e-3)
    state = jamp.TrainState.create(params, tx, loss_scale=jamp.loss_scale_for(policy or "float32"))
    step = jax.jit(jamp.make_train_step(_loss_fn(model), tx))
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch, jax.random.key(2))
        losses.append(float(metrics["loss"]))
    return state, losses, step, batch


def test_moe_experts_run_bf16_forward_and_backward():
    state, losses, step, batch = _train("mixed_bfloat16", steps=20)
    dtypes = _ragged_dtypes(jax.make_jaxpr(step)(state, batch, jax.random.key(2)).jaxpr)
    # 3 grouped GEMMs forward (gate, up, down), 2 backward each (the tokens', the experts').
    assert len(dtypes) == 9, dtypes
    assert all(lhs == rhs == "bfloat16" and out == "float32" for lhs, rhs, out in dtypes), dtypes
    # The experts' gradients reach their float32 params in float32.
    assert all(x.dtype == F32 for x in jax.tree.leaves(state.params))
    _, fp32, _, _ = _train(None, steps=20)
    assert losses[-1] < losses[0] * 0.8
    assert abs(losses[-1] - fp32[-1]) / fp32[-1] < 0.03, (losses[-1], fp32[-1])


def test_moe_under_the_float32_policy_is_the_model_as_written():
    _, f32_policy, _, _ = _train("float32", steps=5)
    _, unwrapped, _, _ = _train(None, steps=5)
    assert f32_policy == unwrapped


@pytest.mark.parametrize("out_dtype", [F32, BF16])
def test_mixed_ragged_dot_matches_jax_within_a_bf16_rounding(out_dtype):
    k = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k[0], (2, 12, 6))  # a batch axis, rows ragged along axis 1
    w = jax.random.normal(k[1], (2, 3, 6, 5))  # [batch, groups, d, f]
    sizes = jnp.array([4, 0, 8], jnp.int32)  # an empty group too
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([2], [2]), ([0], [0])),
        lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[1],
    )

    def ref(x, w):
        return lax.ragged_dot_general(x, w, sizes, dims)

    def got(x, w):
        return grouped.mixed_ragged_dot(x, w, sizes, dims, BF16, out_dtype)

    assert got(x, w).dtype == out_dtype
    np.testing.assert_allclose(got(x, w).astype(F32), ref(x, w), atol=0.1, rtol=0.02)

    def grads(f):
        return jax.grad(lambda x, w: jnp.sum(f(x, w).astype(F32) * ref(x, w)), (0, 1))(x, w)

    for a, b in zip(grads(ref), grads(got)):
        assert b.dtype == F32
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 1e-2
    # In float32 the same computation as JAX's own: equal values and gradients.
    exact = jax.grad(
        lambda x, w: jnp.sum(grouped.mixed_ragged_dot(x, w, sizes, dims, F32, F32) ** 2), (0, 1)
    )(x, w)
    want = jax.grad(lambda x, w: jnp.sum(ref(x, w) ** 2), (0, 1))(x, w)
    for a, b in zip(exact, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_an_uncovered_contraction_is_named_once(monkeypatch):
    """A grouped GEMM in a form jamp does not rewrite (its group offset set) runs as traced, in
    float32, and says so once."""
    monkeypatch.setattr(_matmuls, "_WARNED", set())
    x, w = jnp.ones((8, 4)), jnp.ones((2, 4, 3))
    sizes = jnp.array([3, 5], jnp.int32)
    monkeypatch.setattr(grouped, "covers", lambda eqn: False)
    fn = jamp.autocast(lambda x, w: lax.ragged_dot(x, w, sizes), "mixed_bfloat16")
    with pytest.warns(jamp.RecognitionWarning, match="`ragged_dot_general`"):
        out = fn(x, w)
    np.testing.assert_array_equal(out, lax.ragged_dot(x, w, sizes))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.RecognitionWarning)
        fn(x, w)  # once per process


@pytest.mark.gpu_compile
def test_h200_program_runs_the_experts_grouped_gemms_in_bf16():
    """The MoE LM's train step compiled for one H200 (deviceless): every GEMM XLA made of a
    grouped GEMM, forward and backward, multiplies bf16 operands."""
    from jamp import hlo

    batch, params = _setup()
    model = jamp.wrap(MoELM(), "mixed_bfloat16")
    tx = optax.adam(3e-3)
    state = jax.eval_shape(lambda: jamp.TrainState.create(params, tx))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    key = jax.eval_shape(lambda: jax.random.key(0))
    step = jax.jit(jamp.make_train_step(_loss_fn(model), tx))
    report = jamp.compile_for(step, state, abstract, key, target="h200")
    found = [g for g in hlo.gemms(hlo.parse(report.hlo_text)) if "ragged_dot" in g.op_name]
    passes = {"transpose" in g.op_name for g in found}
    assert passes == {False, True}, [(g.op_name, g.operands) for g in found]
    assert found and not any(g.is_fp32 for g in found), [(g.op_name, g.operands) for g in found]


def test_under_fp8_the_grouped_gemms_run_bf16():
    """jamp has no fp8 grouped GEMM: under "mixed_fp8" the experts run bf16, forward and
    backward (the layers' dense matmuls are fp8)."""
    batch, params = _setup()
    loss_fn = _loss_fn(jamp.wrap(MoELM(), "mixed_fp8"))
    grad = jax.grad(lambda p: loss_fn(p, {}, batch, None)[0])
    dtypes = _ragged_dtypes(jax.make_jaxpr(grad)(params).jaxpr)
    assert len(dtypes) == 9 and all(d[:2] == ("bfloat16", "bfloat16") for d in dtypes), dtypes
