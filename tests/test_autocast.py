"""jamp.autocast on programs beyond plain layers: kernels, shard_map, primitives it does not know."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jamp.autocast import rewrite as autocast
from jamp.jax_compat import UnsupportedProgramError
from jamp.wrap import wrap

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
pl = pytest.importorskip("jax.experimental.pallas")


def _matmul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)


def pallas_matmul(x, w):
    """A Pallas matmul kernel, in interpret mode so that it runs on the CPU."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return pl.pallas_call(_matmul_kernel, out_shape=out, interpret=True)(x, w)


class KernelModel(nn.Module):
    """A Dense, a hand-written kernel on its output (as fused attention kernels are), a Dense."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(8)(x))
        w = self.param("kernel_w", nn.initializers.lecun_normal(), (8, 8))
        return nn.Dense(3)(pallas_matmul(h, w))


def _eqns(jaxpr):
    """Every equation, in sub-programs too, but not inside kernels."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call":
            continue
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("activations", ["float32", "compute"])
def test_autocast_runs_a_pallas_kernel_as_written(activations):
    x = jax.random.normal(jax.random.key(0), (4, 5))
    module = KernelModel()
    variables = module.init(jax.random.key(1), x)
    model = wrap(module, "mixed_bfloat16", activations=activations)
    got = jax.jit(model.apply)(variables, x)
    ref = module.apply(variables, x)
    np.testing.assert_allclose(got, ref, rtol=0.05, atol=0.05)

    jaxpr = jax.make_jaxpr(model.apply)(variables, x).jaxpr
    (kernel,) = [e for e in _eqns(jaxpr) if e.primitive.name == "pallas_call"]
    # The kernel takes its operands in the dtypes it was written for, and its body is untouched.
    assert [np.dtype(v.aval.dtype) for v in kernel.invars] == [F32, F32]
    ref_kernel = [
        e
        for e in _eqns(jax.make_jaxpr(module.apply)(variables, x).jaxpr)
        if e.primitive.name == "pallas_call"
    ][0]
    assert str(kernel.params["jaxpr"]) == str(ref_kernel.params["jaxpr"])
    # Every matmul outside the kernel runs in bf16.
    outside = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(outside) == 2
    assert all(np.dtype(v.aval.dtype) == BF16 for e in outside for v in e.invars)


def test_autocast_rewrites_matmuls_inside_shard_map_forward_and_backward():
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))

    @jax.jit
    def loss(x, w):
        f = jax.shard_map(
            lambda a, b: jax.lax.psum(jnp.tanh(a @ b), "d"),
            mesh=mesh,
            in_specs=(P("d"), P()),
            out_specs=P(),
        )
        return jnp.sum(f(x, w) ** 2)

    x = jax.random.normal(jax.random.key(0), (8, 4))
    w = jax.random.normal(jax.random.key(1), (4, 4))
    cast = autocast(loss, jnp.bfloat16)
    grad = jax.grad(cast, argnums=(0, 1))
    got, ref = grad(x, w), jax.grad(loss, argnums=(0, 1))(x, w)
    for g, r in zip(got, ref):
        assert g.dtype == F32
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2
    dots = [e for e in _eqns(jax.make_jaxpr(grad)(x, w).jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # forward, and both operands' gradients
    assert all(np.dtype(v.aval.dtype) == BF16 for e in dots for v in e.invars)


@pytest.mark.parametrize("activations", ["float32", "compute"])
def test_autocast_collectives_inside_shard_map_sum_in_float32(activations):
    """A psum in a model's own shard_map is a reduction: it stays float32, forward and backward,
    also where the activations between matmuls are carried in 16 bits."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))

    def loss(x, w):
        f = jax.shard_map(
            lambda a, b: jax.lax.psum(a @ b, "d"), mesh=mesh, in_specs=(P("d"), P()), out_specs=P()
        )
        return jnp.sum(f(x, w) ** 2)

    x, w = jnp.ones((8, 4)), jnp.ones((4, 4))
    grad = jax.grad(autocast(loss, jnp.bfloat16, activations=activations), argnums=(0, 1))
    eqns = list(_eqns(jax.make_jaxpr(grad)(x, w).jaxpr))
    sums = [e for e in eqns if e.primitive.name.startswith("psum")]
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert sums and all(np.dtype(v.aval.dtype) == F32 for e in sums for v in e.invars)
    assert dots and all(np.dtype(v.aval.dtype) == BF16 for e in dots for v in e.invars)


# A higher-order primitive that jamp has never heard of: it calls a closed jaxpr.
_unknown_p = jcore.Primitive("jamp_test_unknown_call")
_unknown_p.multiple_results = True
_unknown_p.def_impl(lambda *args, body: jcore.jaxpr_as_fun(body)(*args))
_unknown_p.def_abstract_eval(lambda *avals, body: [v.aval for v in body.jaxpr.outvars])


def _unknown_call(fn, *args):
    return _unknown_p.bind(*args, body=jax.make_jaxpr(fn)(*args))


def test_autocast_unknown_higher_order_primitive_with_matmul_fails_at_trace_time():
    x = jnp.ones((4, 4))
    fn = autocast(lambda a: _unknown_call(lambda b: jnp.tanh(b @ b), a)[0], jnp.bfloat16)
    with pytest.raises(UnsupportedProgramError) as info:
        jax.make_jaxpr(fn)(x)
    message = str(info.value)
    assert "'jamp_test_unknown_call'" in message and f"JAX {jax.__version__}" in message
    assert "\n" not in message


def test_autocast_unknown_primitive_runs_as_traced_when_nothing_inside_changes():
    x = jnp.arange(16.0).reshape(4, 4)
    matmul = autocast(lambda a: _unknown_call(lambda b: b @ b, a)[0], jnp.float32)
    np.testing.assert_array_equal(matmul(x), x @ x)  # float32: nothing to rewrite
    no_matmul = autocast(lambda a: _unknown_call(jnp.tanh, a)[0] @ a, jnp.bfloat16)
    np.testing.assert_allclose(no_matmul(x), jnp.tanh(x) @ x, rtol=2e-2)
