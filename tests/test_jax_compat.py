"""jamp.jax_compat: reading JAX's traced programs on every supported release, or one clear error."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jamp import jax_compat


def _only_eqn(fn, *args):
    (eqn,) = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return eqn


def _scan_eqn():
    def f(carry, xs, k):
        return lax.scan(lambda c, x: (c * x * k, c + x), carry, xs)

    return _only_eqn(f, 1.0, jnp.ones(3), 2.0)


def test_jax_compat_scan_split_counts_consts_and_carry_on_this_jax():
    # Operands are [consts..., carry..., xs...]: here k, then the carry, then xs.
    assert jax_compat.scan_split(_scan_eqn()) == (1, 1)


def test_jax_compat_scan_split_reads_both_param_forms():
    eqn = _scan_eqn()
    old = {k: v for k, v in eqn.params.items() if k not in ("ft_in", "ft_out")}
    old.update(num_consts=2, num_carry=3)  # JAX 0.10's form
    assert jax_compat.scan_split(eqn.replace(params=old)) == (2, 3)


def test_jax_compat_scan_without_expected_params_is_one_line_error():
    eqn = _scan_eqn()
    params = {k: v for k, v in eqn.params.items() if k not in ("ft_in", "num_consts", "num_carry")}
    with pytest.raises(jax_compat.UnsupportedProgramError) as info:
        jax_compat.scan_split(eqn.replace(params=params))
    message = str(info.value)
    assert "'scan'" in message and f"JAX {jax.__version__}" in message
    assert "\n" not in message


def test_jax_compat_missing_param_names_primitive_and_what_it_has():
    eqn = _only_eqn(lambda x: lax.while_loop(lambda c: c < 3.0, lambda c: c + 1.0, x), 0.0)
    assert jax_compat.while_split(eqn) == (0, 0)
    params = {k: v for k, v in eqn.params.items() if k != "body_nconsts"}
    with pytest.raises(jax_compat.UnsupportedProgramError, match="'while'.*body_nconsts"):
        jax_compat.while_split(eqn.replace(params=params))


def test_jax_compat_kernels_are_recognised_by_their_buffer_operands():
    pl = pytest.importorskip("jax.experimental.pallas")

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), interpret=True)
    assert jax_compat.is_kernel(_only_eqn(call, jnp.ones(4)))
    assert not jax_compat.is_kernel(_scan_eqn())


def test_jax_compat_single_device_sharding_without_the_deprecated_class():
    import warnings

    import numpy as np

    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    with warnings.catch_warnings():
        # JAX 0.12.1 deprecates jax.sharding.SingleDeviceSharding: jamp must not touch it there.
        if hasattr(jax.sharding, "is_single_device_sharding"):
            warnings.simplefilter("error", DeprecationWarning)
        one = jax.sharding.make_single_device_sharding(device)
        assert jax_compat.is_single_device_sharding(one)
        named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        assert not jax_compat.is_single_device_sharding(named)


def test_jax_compat_cached_cpu_collectives_hang_from_jax_0_12_1():
    assert jax_compat._release("0.12.0.1") == (0, 12, 0, 1)
    assert jax_compat._release("0.13.0.dev20261201") == (0, 13, 0)
    assert not jax_compat.cached_cpu_collectives_hang("0.10.0")
    assert not jax_compat.cached_cpu_collectives_hang("0.12.0.1")
    assert jax_compat.cached_cpu_collectives_hang("0.12.1")
    assert jax_compat.cached_cpu_collectives_hang("0.13.0.dev20261201")
