"""jamp.autocast, the public form: any JAX function under a policy (plain functions, Equinox)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import jamp

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
F8 = {np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)}
MATMULS = ("dot_general", "conv_general_dilated")


def _matmuls(jaxpr, scope=""):
    """(primitive, operand dtypes, name stack) of every matmul and convolution."""
    found = []
    for eqn in jaxpr.eqns:
        stack = f"{scope}/{eqn.source_info.name_stack}"
        if eqn.primitive.name in MATMULS:
            dtypes = tuple(np.dtype(v.aval.dtype) for v in eqn.invars)
            found.append((eqn.primitive.name, dtypes, stack))
        for sub in jcore.jaxprs_in_params(eqn.params):
            found += _matmuls(sub, stack)
    return found


# ----- a plain function that sets name scopes


def _init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (6, 16)) / 3,
        "w2": jax.random.normal(k2, (16, 16)) / 4,
        "head": jax.random.normal(k3, (16, 3)) / 4,
    }


def mlp(params, x):
    with jax.named_scope("encoder"):
        h = jnp.tanh(x @ params["w1"])
        with jax.named_scope("block"):
            h = h + jnp.tanh(h @ params["w2"])
    with jax.named_scope("head"):
        return h @ params["head"]


def _loss(fn):
    return lambda params, x: jnp.sum(jnp.sin(fn(params, x)))


PARAMS = _init(jax.random.key(0))
X = jax.random.normal(jax.random.key(1), (4, 6))


@pytest.mark.parametrize("compute", [BF16, F16])
def test_autocast_every_matmul_in_compute_dtype_forward_and_backward(compute):
    fn = jamp.autocast(mlp, f"p=f32,c={compute.name},o=f32")
    jaxpr = jax.make_jaxpr(jax.value_and_grad(_loss(fn)))(PARAMS, X).jaxpr
    found = _matmuls(jaxpr)
    assert len(found) >= 9  # 3 forward, 6 backward
    assert {d for _, d, _ in found} == {(compute, compute)}
    assert {d for _, d, _ in _matmuls(jax.make_jaxpr(jax.grad(_loss(mlp)))(PARAMS, X).jaxpr)} == {
        (F32, F32)
    }


def test_autocast_outputs_in_output_dtype_grads_fp32_and_close_to_fp32():
    fn = jamp.autocast(mlp, "mixed_bfloat16")
    assert fn(PARAMS, X).dtype == F32
    assert jamp.autocast(mlp, "p=f32,c=bf16,o=bf16")(PARAMS, X).dtype == BF16
    got = jax.jit(jax.grad(_loss(fn)))(PARAMS, X)
    ref = jax.grad(_loss(mlp))(PARAMS, X)
    assert {g.dtype for g in jax.tree.leaves(got)} == {F32}
    for name in PARAMS:
        rel = np.linalg.norm(got[name] - ref[name]) / np.linalg.norm(ref[name])
        assert rel < 2e-2, (name, rel)


def test_autocast_float32_policy_is_bit_identical():
    fn = jamp.autocast(mlp, "float32")
    for run in (lambda f: f, jax.jit):
        np.testing.assert_array_equal(run(mlp)(PARAMS, X), run(fn)(PARAMS, X))
        ref = run(jax.grad(_loss(mlp)))(PARAMS, X)
        got = run(jax.grad(_loss(fn)))(PARAMS, X)
        jax.tree.map(np.testing.assert_array_equal, ref, got)


def test_autocast_overrides_by_name_scope_path():
    def dtypes_by_scope(overrides):
        fn = jamp.autocast(mlp, "mixed_bfloat16", overrides=overrides)
        found = _matmuls(jax.make_jaxpr(jax.grad(_loss(fn)))(PARAMS, X).jaxpr)
        return found

    found = dtypes_by_scope({"head": "float32"})
    head = [d for _, d, s in found if "head" in s]
    rest = [d for _, d, s in found if "head" not in s]
    assert head and set(head) == {(F32, F32)}  # forward and backward of the head
    assert set(rest) == {(BF16, BF16)}
    # A pattern matches an enclosing scope: encoder/block is covered by "enc*"; the innermost
    # scope's override wins over its enclosing scope's.
    found = dtypes_by_scope({"encoder/block": "p=f32,c=f16,o=f32", "enc*": "float32"})
    kinds = {d for _, d, _ in found}
    assert kinds == {(F16, F16), (F32, F32), (BF16, BF16)}
    with pytest.raises(TypeError, match="name-scope path pattern"):
        jamp.autocast(mlp, "mixed_bfloat16", overrides={int: "float32"})


def test_autocast_fp8_needs_params_argnums_to_find_layer_matmuls():
    def fp8_dots(fn):
        jaxpr = jax.make_jaxpr(jax.grad(_loss(fn)))(PARAMS, X).jaxpr
        return [d for _, d, _ in _matmuls(jaxpr) if set(d) & F8]

    assert fp8_dots(jamp.autocast(mlp, "mixed_fp8")) == []  # no parameters named: bf16
    found = fp8_dots(jamp.autocast(mlp, "mixed_fp8", params_argnums=(0,)))
    assert len(found) >= 2  # the two encoder matmuls (the head, the last matmul, stays bf16)


def test_autocast_bad_arguments_fail_at_once_with_one_line():
    with pytest.raises(ValueError, match="activations"):
        jamp.autocast(mlp, "mixed_bfloat16", activations="fp8")
    with pytest.raises(ValueError, match="params_argnums"):
        jamp.autocast(mlp, "mixed_bfloat16", params_argnums=(-1,))
    with pytest.raises(TypeError, match="callable"):
        jamp.autocast(3, "mixed_bfloat16")
    with pytest.raises(ValueError):
        jamp.autocast(mlp, "no_such_policy")


# ----- Equinox: a module is a callable pytree; its leaves are the parameters


class EqxCNN(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 8, kernel_size=3, padding=1, key=a)
        self.norm = eqx.nn.LayerNorm((8, 8, 8))
        self.mlp = eqx.nn.MLP(8, 4, width_size=16, depth=2, key=b)

    def __call__(self, x_CHW):
        h = jax.nn.relu(self.norm(self.conv(x_CHW)))
        return self.mlp(h.mean(axis=(1, 2)))


EQX_MODEL = EqxCNN(jax.random.key(2))
EQX_X = jax.random.normal(jax.random.key(3), (2, 3, 8, 8))


def _eqx_loss(policy, **kwargs):
    def loss(model, x):
        out = jax.vmap(jamp.autocast(model, policy, **kwargs) if policy else model)(x)
        return jnp.sum(out**2)

    return loss


def _eqx_grad_jaxpr(policy, **kwargs):
    params, static = eqx.partition(EQX_MODEL, eqx.is_array)

    def f(params):
        return jax.value_and_grad(
            lambda p: _eqx_loss(policy, **kwargs)(eqx.combine(p, static), EQX_X)
        )(params)

    return jax.make_jaxpr(f)(params).jaxpr


@pytest.mark.parametrize("compute", [BF16, F16])
def test_autocast_equinox_model_matmuls_and_convs_in_compute_dtype(compute):
    found = _matmuls(_eqx_grad_jaxpr(f"p=f32,c={compute.name},o=f32"))
    # (A 3-channel convolution may run as a matmul of its patches: jamp.mixed_ops on CPUs.)
    assert len(found) >= 11
    assert {d for _, d, _ in found} == {(compute, compute)}
    assert {d for _, d, _ in _matmuls(_eqx_grad_jaxpr(None))} == {(F32, F32)}


def test_autocast_equinox_grads_fp32_float32_bit_identical_and_norm_in_fp32():
    grads = eqx.filter_jit(eqx.filter_grad(_eqx_loss("mixed_bfloat16")))(EQX_MODEL, EQX_X)
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    assert leaves and {g.dtype for g in leaves} == {F32}
    ref = eqx.filter_grad(_eqx_loss(None))(EQX_MODEL, EQX_X)
    got = eqx.filter_grad(_eqx_loss("float32"))(EQX_MODEL, EQX_X)
    jax.tree.map(
        np.testing.assert_array_equal,
        eqx.filter(ref, eqx.is_array),
        eqx.filter(got, eqx.is_array),
    )
    # 16-bit activations between matmuls, but Equinox's LayerNorm (its scope
    # "eqx.nn.LayerNorm") normalizes in fp32: its rsqrt sees fp32.
    params, static = eqx.partition(EQX_MODEL, eqx.is_array)
    fn = jamp.autocast(
        lambda p, x: jax.vmap(eqx.combine(p, static))(x),
        "mixed_bfloat16",
        activations="compute",
        params_argnums=(0,),
    )
    jaxpr = jax.make_jaxpr(fn)(params, EQX_X).jaxpr
    rsqrt = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "rsqrt":
                rsqrt.append(np.dtype(e.invars[0].aval.dtype))
            for sub in jcore.jaxprs_in_params(e.params):
                walk(sub)

    walk(jaxpr)
    assert rsqrt and set(rsqrt) == {F32}


def test_autocast_path_overrides_reach_across_jit_and_scan():
    @jax.jit
    def inner(w, x):
        with jax.named_scope("head"):
            return x @ w

    def with_jit(w, x):
        with jax.named_scope("block"):
            return inner(w, x)

    def with_scan(w, x):
        with jax.named_scope("block"):

            def body(h, _):
                with jax.named_scope("head"):
                    return jnp.tanh(h @ w), None

            return jax.lax.scan(body, x, None, length=2)[0]

    w, x = jnp.ones((6, 6)) / 6, jnp.ones((2, 6))
    for fn in (with_jit, with_scan):
        for pattern in ("block/head", "*/head"):
            mixed = jamp.autocast(fn, "mixed_bfloat16", overrides={pattern: "float32"})
            found = _matmuls(jax.make_jaxpr(jax.grad(lambda w, f=mixed: jnp.sum(f(w, x))))(w).jaxpr)
            assert found and {d for _, d, _ in found} == {(F32, F32)}, (fn.__name__, pattern)
        mixed = jamp.autocast(fn, "mixed_bfloat16", overrides={"other/head": "float32"})
        found = _matmuls(jax.make_jaxpr(mixed)(w, x).jaxpr)
        assert {d for _, d, _ in found} == {(BF16, BF16)}
