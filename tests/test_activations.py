"""16-bit activations (`activations="compute"`): which operations run in 16 bits, and what stays exact.

These run on the CPU, where "auto" means float32 activations; "compute" is what GPUs get.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from test_wrap import MODELS, _loss_and_grad_jaxpr, _matmul_operand_dtypes

from jamp import activations
from jamp.autocast import autocast
from jamp.wrap import wrap

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


def _out_dtypes(jaxpr, acc=None):
    """primitive name -> set of dtypes of its float outputs of rank >= 2, sub-programs included."""
    acc = {} if acc is None else acc
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            aval = v.aval
            if jnp.issubdtype(aval.dtype, jnp.floating) and aval.ndim >= 2:
                acc.setdefault(eqn.primitive.name, set()).add(np.dtype(aval.dtype))
        for sub in jcore.jaxprs_in_params(eqn.params):
            _out_dtypes(sub, acc)
    return acc


def _forward_jaxpr(model, variables, x, kwargs):
    return jax.make_jaxpr(lambda p: model.apply({**variables, "params": p}, x, **kwargs))(
        variables["params"]
    ).jaxpr


def _grads(model, variables, x, kwargs):
    def loss(params):
        out = model.apply({**variables, "params": params}, x, **kwargs)
        out = out[0] if kwargs.get("mutable") else out
        assert out.dtype == F32
        return jnp.mean(out**2)

    return jax.jit(jax.grad(loss))(variables["params"])


def _flat(tree):
    return jnp.concatenate([g.ravel() for g in jax.tree.leaves(tree)])


def test_transformer_activations_are_16_bit_where_safe_and_fp32_where_fragile():
    module, x, kwargs = MODELS["transformer"]
    variables = module.init(jax.random.key(0), x)
    ops = {
        mode: _out_dtypes(
            _forward_jaxpr(wrap(module, "mixed_bfloat16", activations=mode), variables, x, kwargs)
        )
        for mode in ("float32", "compute")
    }
    # The MLP's GELU (tanh), the attention mask (select_n) and the scores' max: 16-bit.
    for name in ("tanh", "select_n", "integer_pow"):
        assert ops["compute"][name] == {BF16}, name
        assert ops["float32"][name] == {F32}, name
    # Exponentials and sums (softmax), LayerNorm's rsqrt: float32 in both modes.
    for name in ("exp", "reduce_sum", "rsqrt"):
        assert ops["compute"][name] == {F32}, name
    # Bias adds are 16-bit, the residual stream (fp32 embeddings + 16-bit branches) float32.
    assert ops["compute"]["add"] == {BF16, F32}


def test_dense_bias_add_stays_16_bit_but_a_strong_fp32_operand_promotes():
    class DenseThenAdd(nn.Module):
        @nn.compact
        def __call__(self, x, other):
            return nn.Dense(8)(x) + other  # the bias is a variable (weak); `other` is an input

    module = DenseThenAdd()
    x, other = jnp.ones((4, 8)), jnp.ones((4, 8))
    variables = module.init(jax.random.key(0), x, other)
    model = wrap(module, "mixed_bfloat16", activations="compute")
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x, other))(variables).jaxpr
    adds = [np.dtype(e.outvars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "add"]
    assert adds == [BF16, F32]  # x @ w + b in bf16; + other (a float32 input) in float32
    assert model.apply(variables, x, other).dtype == F32


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("compute, bound", [(BF16, 0.1), (F16, 1e-2)])
def test_compute_activations_keep_matmuls_16_bit_and_grads_close(name, compute, bound):
    module, x, kwargs = MODELS[name]
    variables = module.init(jax.random.key(0), x)
    model = wrap(module, f"p=f32,c={compute.name},o=f32", activations="compute")
    found = _matmul_operand_dtypes(_loss_and_grad_jaxpr(model, variables, x, kwargs))
    assert found and all(d == (compute, compute) for _, d in found), found
    got, ref = _grads(model, variables, x, kwargs), _grads(module, variables, x, kwargs)
    assert {g.dtype for g in jax.tree.leaves(got)} == {F32}
    # Measured: 0.6-5.8 % (bf16) and 0.09-0.6 % (f16), within 3x of float32 activations.
    err = float(jnp.linalg.norm(_flat(got) - _flat(ref)) / jnp.linalg.norm(_flat(ref)))
    assert err < bound, err


def test_compute_activations_keep_batch_stats_fp32_and_outputs_in_traced_dtypes():
    module, x, kwargs = MODELS["resnet"]
    variables = module.init(jax.random.key(0), x)
    out, state = wrap(module, "mixed_float16", activations="compute").apply(variables, x, **kwargs)
    assert out.dtype == F32
    assert {a.dtype for a in jax.tree.leaves(state)} == {F32}
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(state))


def test_custom_jvp_rule_is_kept_on_16_bit_operands():
    # relu's rule gives derivative 0 at 0; differentiating its body (max(x, 0)) would give 1/2.
    def f(x, w):
        return jnp.sum(jax.nn.relu(x @ w))

    x, w = jnp.ones((3, 4)), jnp.zeros((4, 5))
    for mode in ("float32", "compute"):
        g = jax.grad(autocast(f, jnp.bfloat16, activations=mode), argnums=1)(x, w)
        np.testing.assert_array_equal(g, np.zeros((4, 5), np.float32))
        assert g.dtype == F32


def test_scan_and_remat_run_with_16_bit_activations():
    class Scanned(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = nn.remat(nn.Dense)
            scan = nn.scan(
                lambda mdl, c, _: (jnp.tanh(mdl(c)), None),
                variable_broadcast="params",
                split_rngs={"params": False},
                length=3,
            )
            return scan(block(x.shape[-1]), x, None)[0]

    module, x = Scanned(), jax.random.normal(jax.random.key(1), (2, 4))
    variables = module.init(jax.random.key(0), x)
    model = wrap(module, "mixed_bfloat16", activations="compute")
    np.testing.assert_allclose(
        model.apply(variables, x), module.apply(variables, x), rtol=3e-2, atol=3e-2
    )
    got, ref = _grads(model, variables, x, {}), _grads(module, variables, x, {})
    assert float(jnp.linalg.norm(_flat(got) - _flat(ref)) / jnp.linalg.norm(_flat(ref))) < 5e-2


@pytest.mark.parametrize("name", ["transformer", "resnet"])
def test_auto_is_float32_activations_on_cpu_and_float32_policy_is_untouched(name):
    module, x, kwargs = MODELS[name]
    variables = module.init(jax.random.key(0), x)
    assert activations.resolve("auto") == "float32"  # these tests run on the CPU

    def outputs(model):
        out = model.apply(variables, x, **kwargs)
        return out[0] if kwargs.get("mutable") else out

    np.testing.assert_array_equal(
        outputs(wrap(module, "mixed_bfloat16")),
        outputs(wrap(module, "mixed_bfloat16", activations="float32")),
    )
    np.testing.assert_array_equal(
        outputs(module), outputs(wrap(module, "float32", activations="compute"))
    )


def test_primitive_lists_are_disjoint():
    assert not activations.FP32_PRIMITIVES & activations.POLYMORPHIC_PRIMITIVES


def test_bad_activations_value_is_one_clear_error():
    with pytest.raises(ValueError, match="activations='fast' is not one of 'auto', 'compute'"):
        wrap(MODELS["shared"][0], "mixed_bfloat16", activations="fast")
    with pytest.raises(ValueError, match="is not one of"):
        autocast(jnp.sin, jnp.bfloat16, activations="half")
