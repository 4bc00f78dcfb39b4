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
from jamp.autocast import rewrite as autocast
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
    # The MLP's GELU (tanh, its cube): 16-bit.
    for name in ("tanh", "integer_pow"):
        assert ops["compute"][name] == {BF16}, name
        assert ops["float32"][name] == {F32}, name
    # Exponentials and sums (attention's softmax, run as one call whose softmax is float32),
    # LayerNorm's rsqrt: float32 in both modes.
    for name in ("exp", "reduce_sum", "rsqrt"):
        assert ops["compute"][name] == {F32}, name
    # Bias adds and the residual stream (16-bit embeddings + 16-bit branches) are 16-bit;
    # LayerNorm's statistics float32.
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


def test_a_16_bit_bias_gradient_is_summed_in_fp32():
    """A bias added in bf16 gets its gradient summed over batch x length rows in float32 and
    rounded once: in bf16 the accumulator stops growing (here 32768 ones summed to 8192), and
    the bias gradients of an MLP were 4-7 % off float32's where its kernels' were 0.4 %."""

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.gelu(nn.Dense(32)(x)))

    x = jax.random.normal(jax.random.key(1), (64, 512, 8))
    y = jax.random.normal(jax.random.key(2), (64, 512, 8))
    variables = MLP().init(jax.random.key(0), x)
    model = wrap(MLP(), "mixed_bfloat16", activations="compute")

    def loss(p, y):
        return jnp.sum(model.apply({"params": p}, x).astype(F32) * y)

    grad = jax.make_jaxpr(jax.grad(loss))(variables["params"], y).jaxpr
    summed = [e.invars[0].aval.dtype for e in grad.eqns if e.primitive.name == "reduce_sum"]
    assert summed and all(np.dtype(d) == F32 for d in summed), summed
    ones = jax.jit(jax.grad(loss))(variables["params"], jnp.ones_like(y))
    np.testing.assert_array_equal(ones["Dense_0"]["bias"], 64 * 512)  # the output layer
    got = jax.jit(jax.grad(loss))(variables["params"], y)
    ref = jax.grad(lambda p: jnp.sum(MLP().apply({"params": p}, x) * y))(variables["params"])

    def err(layer, leaf):
        diff = got[layer][leaf] - ref[layer][leaf]
        return float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref[layer][leaf]))

    for layer in ("Dense_0", "Dense_1"):  # measured: 0.40 % and 0.55 %, kernels 0.44 %
        assert err(layer, "bias") < 0.015, (layer, err(layer, "bias"), err(layer, "kernel"))


def test_an_embedding_lookup_is_16_bit_data_and_its_gradient_sums_in_fp32():
    # An embedding lookup is data (table weak, token ids strong), carried in the compute dtype
    # as a 16-bit model's embedding returns it (Flax `dtype=`, Keras), so the residual stream it
    # starts is 16-bit; the lookup itself is float32, so the table's gradient rows are summed
    # (a scatter-add over repeated ids) in float32.
    def f(table, w, ids):
        x = table[ids]
        return x + jnp.tanh(x @ w)

    table, w, ids = jnp.ones((10, 8)), jnp.ones((8, 8)), jnp.array([1, 1, 2, 3])
    fn = autocast(f, jnp.bfloat16, activations="compute", weak_argnums=(0, 1))
    ops = _out_dtypes(jax.make_jaxpr(fn)(table, w, ids).jaxpr)
    assert ops["tanh"] == {BF16} and ops["add"] == {BF16} and ops["gather"] == {F32}
    grad = jax.make_jaxpr(jax.grad(lambda t: fn(t, w, ids).astype(F32).sum()))(table).jaxpr
    assert _out_dtypes(grad)["scatter-add"] == {F32}
    got = jax.grad(lambda t: fn(t, w, ids).astype(F32).sum())(table)
    want = jax.grad(lambda t: f(t, w, ids).sum())(table)
    np.testing.assert_allclose(got, want, rtol=2e-2)


@pytest.mark.parametrize("compute", [BF16, F16])
def test_masking_with_the_fp32_minimum_stays_finite_in_16_bits(compute):
    # Flax masks attention with finfo(float32).min, which overflows to -inf in bf16 and f16; a
    # fully masked row would then be NaN. Weak fills are clipped to the 16-bit range instead.
    def f(x, w, mask):
        s = jnp.where(mask, x @ w, jnp.finfo(jnp.float32).min)
        return jax.nn.softmax(s, axis=-1)

    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    mask = jnp.array([[True] * 4, [False] * 4])
    got = autocast(f, compute, activations="compute")(x, w, mask)
    np.testing.assert_allclose(got, f(x, w, mask), rtol=1e-6)
    # An explicit infinity is kept: fully masked with -inf is NaN in fp32 and stays NaN.
    inf = autocast(lambda x, w, m: jnp.where(m, x @ w, -jnp.inf), compute, activations="compute")
    assert np.isneginf(np.asarray(inf(x, w, mask))[1]).all()


def test_fp16_squares_run_in_fp32_so_norms_of_large_activations_do_not_overflow():
    # fp16 overflows at 65504: squares of values from 256 on. An RMSNorm and a vector norm on
    # activations of ~300 stay finite; with bf16 (fp32's range) squares stay 16-bit.
    def f(x, w):
        h = x @ w
        rms = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6)
        return rms, jnp.linalg.norm(h, axis=-1), jnp.mean(h**2, -1)

    x, w = jnp.full((2, 8), 10.0), jnp.full((8, 4), 4.0)  # h = 320
    ref = f(x, w)
    got = autocast(f, jnp.float16, activations="compute")(x, w)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=2e-3)
    ops = _out_dtypes(jax.make_jaxpr(autocast(f, jnp.bfloat16, activations="compute"))(x, w).jaxpr)
    assert BF16 in ops["square"] and BF16 in ops["integer_pow"]


def test_typed_prng_keys_pass_through_16_bit_regions():
    def f(x, w, key):
        k = jax.random.split(key)[0]  # slicing a key array is a shape operation on a key dtype
        return jnp.tanh(x @ w) * jax.random.normal(k, (4, 8))

    x, w, key = jnp.ones((4, 8)), jnp.ones((8, 8)), jax.random.key(0)
    got = autocast(f, jnp.bfloat16, activations="compute")(x, w, key)
    np.testing.assert_allclose(got, f(x, w, key), rtol=2e-2, atol=2e-2)


def test_init_with_output_creates_the_same_variables_as_init():
    module, x, _ = MODELS["transformer"]
    model = wrap(module, "mixed_bfloat16", activations="compute")
    _, got = model.init_with_output(jax.random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, model.init(jax.random.key(0), x), got)


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
    # Inside the scanned body the layer's variables stay weak: bias add and tanh run in bf16,
    # while the carry keeps its fp32 type.
    jaxpr = _forward_jaxpr(model, variables, x, {})
    ops = _out_dtypes(jaxpr)
    assert ops["tanh"] == {BF16} and BF16 in ops["add"]
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
