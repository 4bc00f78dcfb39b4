"""jamp.mixed_ops: the mixed matmul and convolution against plain autodiff on rounded operands."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jamp import conv_patches, mixed_ops

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


def _conv_params(lhs, rhs, **kwargs):
    """The conv_general_dilated primitive's parameters, as jamp.autocast sees them."""
    jaxpr = jax.make_jaxpr(lambda a, b: lax.conv_general_dilated(a, b, **kwargs))(lhs, rhs)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    return dict(eqn.params)


# (lhs shape, rhs shape, conv_general_dilated keywords): NHWC and NCHW layouts, strides, uneven
# padding, 1-D and 1x1 convolutions. Channels <= 4 take the patch-matmul lowering on CPU.
CASES = {
    "nhwc_3x3_same": (
        (2, 9, 9, 3),
        (3, 3, 3, 5),
        dict(
            window_strides=(1, 1),
            padding=((1, 1), (1, 1)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
    ),
    "nchw_strided_uneven": (
        (2, 3, 11, 10),
        (6, 3, 3, 2),
        dict(
            window_strides=(2, 3),
            padding=((0, 2), (1, 0)),
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        ),
    ),
    "conv1d_valid": (
        (3, 17, 1),
        (5, 1, 4),
        dict(window_strides=(2,), padding=((0, 0),), dimension_numbers=("NWC", "WIO", "NWC")),
    ),
    "one_by_one": (
        (2, 5, 5, 2),
        (1, 1, 2, 7),
        dict(
            window_strides=(1, 1),
            padding=((0, 0), (0, 0)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
    ),
    "many_channels_native": (
        (2, 6, 6, 9),
        (3, 3, 9, 4),
        dict(
            window_strides=(1, 1),
            padding=((1, 1), (1, 1)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
    ),
}


def _inputs(case):
    lhs_shape, rhs_shape, kwargs = CASES[case]
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k1, lhs_shape)
    rhs = jax.random.normal(k2, rhs_shape) * 0.3
    out = jax.eval_shape(lambda a, b: lax.conv_general_dilated(a, b, **kwargs), lhs, rhs)
    cot = jax.random.normal(k3, out.shape)
    return lhs, rhs, cot, kwargs


def _reference(lhs, rhs, cot, kwargs, compute):
    """fp32 autodiff of the convolution of operands (and cotangent) rounded to `compute`."""

    def rnd(x):
        return x.astype(compute).astype(F32)

    def conv(a, b):
        return lax.conv_general_dilated(a, b, precision=lax.Precision.HIGHEST, **kwargs)

    out, vjp = jax.vjp(conv, rnd(lhs), rnd(rhs))
    return out, vjp(rnd(cot))


def _mixed(lhs, rhs, cot, kwargs, compute):
    params = _conv_params(lhs, rhs, **kwargs)
    out, vjp = jax.vjp(lambda a, b: mixed_ops.mixed_conv(a, b, params, compute, F32), lhs, rhs)
    return out, vjp(cot)


@pytest.mark.parametrize("compute", [BF16, F16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("jit", [False, True])
def test_mixed_conv_matches_autodiff_of_rounded_operands(case, compute, jit):
    lhs, rhs, cot, kwargs = _inputs(case)
    run = jax.jit(_mixed, static_argnums=(3, 4)) if jit else _mixed
    out, (d_lhs, d_rhs) = run(lhs, rhs, cot, _Hashable(kwargs), compute)
    ref_out, (ref_lhs, ref_rhs) = _reference(lhs, rhs, cot, kwargs, compute)
    assert out.dtype == F32 and d_lhs.dtype == F32 and d_rhs.dtype == F32
    assert out.shape == ref_out.shape and d_lhs.shape == lhs.shape and d_rhs.shape == rhs.shape
    # The forward sums exact products of rounded operands in fp32: equal up to summation order.
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    # Backward: both lowerings return fp32 sums of exact products of rounded operands.
    tol = 1e-5
    for got, ref in ((d_lhs, ref_lhs), (d_rhs, ref_rhs)):
        scale = float(jnp.max(jnp.abs(ref)))
        assert float(jnp.max(jnp.abs(got - ref))) <= tol * scale, case


def test_mixed_conv_backward_convolutions_take_16_bit_operands_and_give_fp32():
    # A scaled weight gradient sums the whole batch: in fp16 it could overflow at 65504 even
    # where every term fits, so the transposed convolutions ask for fp32 results.
    lhs, rhs, cot, kwargs = _inputs("many_channels_native")
    jaxpr = jax.make_jaxpr(_mixed, static_argnums=(3, 4))(lhs, rhs, cot, _Hashable(kwargs), F16)
    convs = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "conv_general_dilated"]
    assert len(convs) == 3  # the forward and the two transposes
    for eqn in convs:
        assert [v.aval.dtype for v in eqn.invars] == [F16, F16]
        assert eqn.outvars[0].aval.dtype == F32


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


def _lowered(lhs, rhs, kwargs):
    return conv_patches.lowerable(lhs, rhs, _conv_params(lhs, rhs, **kwargs))


class _Hashable(dict):
    """A dict usable as a static jit argument in these tests."""

    def __hash__(self):
        return hash(repr(sorted(self.items())))


def test_patch_lowering_is_chosen_for_few_channels_only():
    chosen = {case: _lowered(*_inputs(case)[:2], CASES[case][2]) for case in CASES}
    assert chosen == {
        "nhwc_3x3_same": True,
        "nchw_strided_uneven": True,
        "conv1d_valid": True,
        "one_by_one": True,
        "many_channels_native": False,
    }


@pytest.mark.parametrize("case", ["nhwc_3x3_same", "nchw_strided_uneven"])
def test_patch_lowering_runs_every_product_on_compute_dtype_operands(case):
    lhs, rhs, cot, kwargs = _inputs(case)
    params = _conv_params(lhs, rhs, **kwargs)

    def loss(a, b):
        return jnp.sum(mixed_ops.mixed_conv(a, b, params, BF16, F32) * cot)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(lhs, rhs).jaxpr
    prims = [e.primitive.name for e in jaxpr.eqns]
    assert "conv_general_dilated" not in prims
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3  # forward, weight gradient, patch gradient
    for e in dots:
        assert [np.dtype(v.aval.dtype) for v in e.invars] == [BF16, BF16]
        assert np.dtype(e.outvars[0].aval.dtype) == F32


def test_patch_lowering_gradients_come_back_in_operand_dtypes():
    lhs, rhs, cot, kwargs = _inputs("nhwc_3x3_same")
    params = _conv_params(lhs, rhs, **kwargs)
    out, vjp = jax.vjp(
        lambda a, b: mixed_ops.mixed_conv(a, b, params, BF16, BF16),
        lhs.astype(F16),
        rhs,
    )
    d_lhs, d_rhs = vjp(cot.astype(BF16))
    assert (out.dtype, d_lhs.dtype, d_rhs.dtype) == (BF16, F16, F32)


@pytest.mark.parametrize("compute", [BF16, F16])
def test_mixed_dot_general_matches_autodiff_of_rounded_operands(compute):
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    lhs = jax.random.normal(k1, (3, 4, 6, 5))  # batch 3, free 4 and 5 / contract 6
    rhs = jax.random.normal(k2, (6, 3, 7))  # contract 6, batch 3, free 7
    dims = (((2,), (0,)), ((0,), (1,)))
    cot = jax.random.normal(k3, (3, 4, 5, 7))

    def rnd(x):
        return x.astype(compute).astype(F32)

    ref_out, ref_vjp = jax.vjp(
        lambda a, b: lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST),
        rnd(lhs),
        rnd(rhs),
    )
    out, vjp = jax.vjp(lambda a, b: mixed_ops.mixed_dot_general(a, b, dims, compute, F32), lhs, rhs)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, ref in zip(vjp(cot), ref_vjp(rnd(cot))):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce", [F32, BF16])
def test_mixed_dot_general_placed_operand_gradient_leaves_in_the_reduce_dtype(reduce):
    """A placed (sharded) weight: the same values forward, its gradient rounded once to the
    reduce dtype (the dtype it is summed across devices in) and handed back float32."""
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    x, w, cot = (jax.random.normal(k, s) for k, s in zip((k1, k2, k3), ((8, 6), (6, 5), (8, 5))))
    dims = (((1,), (0,)), ((), ()))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    placed = mixed_ops.Placed(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), reduce
    )

    def run(where):
        f = jax.jit(lambda a, b: mixed_ops.mixed_dot_general(a, b, dims, BF16, F32, where))
        out, vjp = jax.vjp(f, x, w)
        return out, *vjp(cot)

    out, d_x, d_w = run((None, placed))
    ref_out, ref_dx, ref_dw = run((None, None))
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(d_x, ref_dx)
    assert d_w.dtype == F32
    np.testing.assert_array_equal(d_w, ref_dw.astype(reduce).astype(F32))


class _Gpu:  # the device jamp.hardware.compiling_for reads: an NVIDIA GPU target
    platform, device_kind, compute_capability = "gpu", "NVIDIA H200", "9.0"


def _dot_results(jaxpr):
    from jax.extend import core as jcore

    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            yield np.dtype(e.params["preferred_element_type"] or e.outvars[0].aval.dtype)
        for sub in jcore.jaxprs_in_params(e.params):
            yield from _dot_results(sub)


@pytest.mark.parametrize("compute", [BF16, F16])
def test_mixed_dot_general_on_a_gpu_asks_the_gemm_for_its_16_bit_result(compute):
    """16-bit activations times a float32 weight, for a GPU target: the forward GEMM and the
    activation gradient's return the 16-bit result they are rounded to anyway (XLA:GPU sums
    16-bit GEMMs in float32); the float32 weight's gradient stays a float32 GEMM result. The
    values are those of the float32 results rounded once."""
    from jamp import hardware

    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k1, (8, 6)).astype(compute)
    w = jax.random.normal(k2, (6, 5))
    cot = jax.random.normal(k3, (8, 5)).astype(compute)
    dims = (((1,), (0,)), ((), ()))

    def run(a, b):
        out, vjp = jax.vjp(
            lambda a, b: mixed_ops.mixed_dot_general(a, b, dims, compute, compute), a, b
        )
        return out, *vjp(cot)

    with hardware.compiling_for(_Gpu()):
        assert list(_dot_results(jax.make_jaxpr(run)(x, w).jaxpr)) == [compute, compute, F32]
        gpu = jax.jit(run)(x, w)
    reference = run(x, w)  # traced for this CPU: float32 GEMM results, converted after
    for got, want in zip(gpu, reference):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got.astype(F32), want.astype(F32), rtol=1e-2, atol=1e-2)
