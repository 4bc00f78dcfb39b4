"""jamp.hardware: native 16-bit support per device, "auto", the emulation warning and the lowering.

CPUs are faked through `parse_cpuinfo` texts and GPUs / TPUs through small stand-in devices, so
every branch runs on any machine. The numerics of both matmul lowerings are checked on this one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from jax import lax

from jamp import hardware, mixed_ops
from jamp.hardware import CpuInfo, parse_cpuinfo, support

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
FP8 = np.dtype(jnp.float8_e4m3fn)
CPU = jax.devices("cpu")[0]


def _cpuinfo(name, flags, key="flags"):
    # Two processors; only the first one's block is read.
    block = f"processor\t: {{}}\nvendor_id\t: X\nmodel name\t: {name}\n{key}\t\t: {flags}\n"
    return block.format(0) + "\n" + block.format(1).replace(flags, "fpu")


ZEN5 = parse_cpuinfo(_cpuinfo("AMD EPYC 9B45", "fpu sse2 avx2 avx512f avx512_bf16"))
ZEN3 = parse_cpuinfo(_cpuinfo("AMD EPYC 7B13", "fpu sse2 avx2 fma"))
SAPPHIRE = parse_cpuinfo(
    _cpuinfo("Intel Xeon 8480", "avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile")
)
GRAVITON3 = parse_cpuinfo(_cpuinfo("Neoverse-V1", "fp asimd asimdhp bf16", key="Features"))
NO_CPUINFO = CpuInfo("arm", None)


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str
    compute_capability: object = None


H200 = FakeDevice("gpu", "NVIDIA H200", "9.0")
A100 = FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", "8.0")
L4 = FakeDevice("gpu", "NVIDIA L4", (8, 9))
V100 = FakeDevice("gpu", "Tesla V100-SXM2-16GB", "7.0")
P100 = FakeDevice("gpu", "Tesla P100-PCIE-16GB", "6.0")
MI300 = FakeDevice("rocm", "AMD Instinct MI300X")
TPU = FakeDevice("tpu", "TPU v5 lite")


def test_parse_cpuinfo_reads_the_first_processor_flags_x86_and_arm():
    assert ZEN5.name == "AMD EPYC 9B45" and "avx512_bf16" in ZEN5.flags
    assert "avx512_bf16" not in ZEN3.flags and "fma" in ZEN3.flags
    assert GRAVITON3.flags == frozenset({"fp", "asimd", "asimdhp", "bf16"})
    assert parse_cpuinfo("processor : 0\n").flags is None  # no flags line: unknown, not "none"


def test_read_cpuinfo_reads_once_and_reports_a_missing_file(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo"
    path.write_text(_cpuinfo("Fake CPU", "avx2"))
    monkeypatch.setattr(hardware, "_CPUINFO", str(path))
    hardware.read_cpuinfo.cache_clear()
    try:
        first = hardware.read_cpuinfo()
        path.write_text(_cpuinfo("Other CPU", "avx512_bf16"))
        assert hardware.read_cpuinfo() is first and first.name == "Fake CPU"  # cached
        hardware.read_cpuinfo.cache_clear()
        monkeypatch.setattr(hardware, "_CPUINFO", str(tmp_path / "missing"))
        assert hardware.read_cpuinfo().flags is None
    finally:
        hardware.read_cpuinfo.cache_clear()


@pytest.mark.parametrize(
    "cpu, bf16, f16",
    # float16 never: XLA:CPU converts float16 matmuls to float32 whatever instructions exist.
    [(ZEN5, True, False), (ZEN3, False, False), (SAPPHIRE, True, False), (GRAVITON3, True, False)],
)
def test_support_cpu_follows_the_16_bit_flags(cpu, bf16, f16):
    assert support(BF16, CPU, cpu=cpu).native is bf16
    assert support(F16, CPU, cpu=cpu).native is f16
    assert support(F32, CPU, cpu=cpu).native is True
    assert support(FP8, CPU, cpu=cpu).native is False
    s = support("bfloat16", CPU, cpu=cpu)
    assert (s.dtype, s.platform) == (BF16, "cpu") and s.device.startswith(cpu.name)
    assert s.detail.endswith(".") and "\n" not in s.detail


def test_support_cpu_names_the_flags_it_found_or_their_absence():
    assert support(BF16, CPU, cpu=ZEN5).device == "AMD EPYC 9B45 (avx512_bf16)"
    assert support(BF16, CPU, cpu=ZEN3).device == "AMD EPYC 7B13 (no 16-bit matmul instructions)"
    assert "converted to float32" in support(BF16, CPU, cpu=ZEN3).detail


def test_support_cpu_without_cpuinfo_is_unknown_and_says_so():
    s = support(BF16, CPU, cpu=NO_CPUINFO)
    assert s.native is None
    assert "/proc/cpuinfo" in s.device and "unknown" in s.detail
    assert "unknown" in str(s)


@pytest.mark.parametrize(
    "device, bf16, f16, fp8",
    [
        (H200, True, True, True),
        (L4, True, True, True),
        (A100, True, True, False),
        (V100, False, True, False),
        (P100, False, False, False),
        (MI300, True, True, True),
        (TPU, True, False, None),
    ],
)
def test_support_accelerators_by_compute_capability_or_kind(device, bf16, f16, fp8):
    assert support(BF16, device).native is bf16
    assert support(F16, device).native is f16
    assert support(FP8, device).native is fp8
    assert support(F32, device).native is True


def test_support_gpu_names_the_compute_capability_and_tf32():
    s = support(BF16, H200)
    assert (s.platform, s.device) == ("gpu", "NVIDIA H200, compute capability 9.0")
    assert "TF32" in support(F32, A100).detail and "TF32" not in support(F32, V100).detail
    assert "8.9" in support(FP8, A100).detail  # says what it would need


def test_support_gpu_without_a_compute_capability_is_unknown():
    assert support(BF16, FakeDevice("gpu", "Some GPU")).native is None
    assert support(BF16, FakeDevice("metal", "Apple M2")).native is None


def test_support_refuses_non_float_dtypes():
    with pytest.raises(ValueError, match="int8"):
        support(np.int8, CPU, cpu=ZEN5)


def test_support_of_this_machine_follows_its_own_cpuinfo():
    s = support(BF16)  # the real default device and /proc/cpuinfo, whatever they are
    assert s.platform == jax.default_backend() == "cpu"
    flags = hardware.read_cpuinfo().flags
    expected = None if flags is None else bool(flags & set(hardware.CPU_FLAGS["bfloat16"]))
    assert s.native is expected
    assert support(F16).native is (None if flags is None else False)


def _dtypes(policy):
    return tuple(
        np.dtype(d) for d in (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    )


@pytest.mark.parametrize(
    "device, cpu, expected, words",
    [
        (CPU, ZEN5, (F32, BF16, F32), ["mixed_bfloat16", "AMD EPYC 9B45", "natively"]),
        (CPU, ZEN3, (F32, F32, F32), ["float32", "AMD EPYC 7B13", "emulated"]),
        (CPU, NO_CPUINFO, (F32, F32, F32), ["float32", "unknown"]),
        (H200, None, (F32, BF16, F32), ["mixed_bfloat16", "compute capability 9.0"]),
        (V100, None, (F32, F32, F32), ["float32", "mixed_float16"]),
    ],
)
def test_auto_policy_picks_bf16_only_where_native_and_says_why(device, cpu, expected, words):
    policy, why = hardware.auto_policy(device, cpu=cpu)
    assert isinstance(policy, jmp.Policy) and _dtypes(policy) == expected
    assert why.startswith("auto picked ") and "\n" not in why
    for word in words:
        assert word in why


MIXED_BF16 = jmp.get_policy("p=f32,c=bf16,o=f32")
MIXED_F16 = jmp.get_policy("p=f32,c=f16,o=f32")


def test_emulation_warning_names_the_faster_choice_where_emulated():
    line = hardware.emulation_warning(MIXED_BF16, CPU, cpu=ZEN3)
    assert line.startswith("warning: mixed_bfloat16 computes in bfloat16")
    assert "AMD EPYC 7B13" in line and "float32 is the faster choice" in line
    assert "\n" not in line
    # float16 on a CPU with native bfloat16: the faster choice is bfloat16, not float32.
    assert "mixed_bfloat16 is the faster choice" in hardware.emulation_warning(
        MIXED_F16, CPU, cpu=ZEN5
    )
    assert "mixed_float16" in hardware.emulation_warning(MIXED_BF16, V100)
    # a CPU with float16 instructions: the line says why they do not help
    sapphire = hardware.emulation_warning(MIXED_F16, CPU, cpu=SAPPHIRE)
    assert "XLA:CPU has no float16 matmul kernels" in sapphire
    assert "emulated in float32" not in sapphire
    pure_bf16 = jmp.get_policy("bf16")
    assert hardware.emulation_warning(pure_bf16, CPU, cpu=ZEN3).startswith("warning: bfloat16 ")


@pytest.mark.parametrize(
    "policy, device, cpu",
    [
        (MIXED_BF16, CPU, ZEN5),  # native
        (MIXED_BF16, H200, None),
        (jmp.get_policy("f32"), CPU, ZEN3),  # nothing 16-bit to emulate
        (MIXED_BF16, CPU, NO_CPUINFO),  # unknown: no alarm on a guess
    ],
)
def test_emulation_warning_is_none_where_nothing_is_emulated(policy, device, cpu):
    assert hardware.emulation_warning(policy, device, cpu=cpu) is None


# ----- the matmul lowering


@pytest.mark.parametrize(
    "device, cpu, dtype, expected",
    [
        (CPU, ZEN3, BF16, "upcast"),
        (CPU, ZEN5, BF16, "native"),
        (CPU, ZEN5, F16, "upcast"),  # no avx512_fp16 there
        (CPU, SAPPHIRE, F16, "upcast"),  # float16 instructions, but no XLA:CPU kernels
        (CPU, NO_CPUINFO, BF16, "upcast"),  # unknown: the form that is never much slower
        (CPU, ZEN3, F32, "native"),
        (H200, None, BF16, "native"),
        (V100, None, BF16, "native"),  # XLA:GPU chooses its own emulation
    ],
)
def test_matmul_lowering_follows_the_hardware_unless_pinned(device, cpu, dtype, expected):
    with hardware.pinned_lowering("auto"):
        assert hardware.matmul_lowering(dtype, device, cpu=cpu) == expected
    with hardware.pinned_lowering("native"):
        assert hardware.matmul_lowering(dtype, device, cpu=cpu) == "native"


def test_matmul_lowering_env_var_is_read_and_checked(monkeypatch):
    monkeypatch.setenv(hardware.LOWERING_ENV, "upcast")
    assert hardware.matmul_lowering(BF16, CPU, cpu=ZEN5) == "upcast"
    with hardware.pinned_lowering("native"):  # a pin in code wins over the environment
        assert hardware.matmul_lowering(BF16, CPU, cpu=ZEN3) == "native"
    monkeypatch.setenv(hardware.LOWERING_ENV, "fast")
    with pytest.raises(ValueError, match="'fast' is not one of auto, native, upcast"):
        hardware.matmul_lowering(BF16, CPU, cpu=ZEN3)
    with pytest.raises(ValueError):
        with hardware.pinned_lowering("canonical"):
            pass


# A batched product in a non-canonical layout (XLA:CPU's generic dot refuses it in bf16) with a
# reduce-dtype-free gradient, under each lowering.
DIMS = (((2,), (0,)), ((0,), (1,)))
_KEYS = jax.random.split(jax.random.key(3), 3)
LHS = jax.random.normal(_KEYS[0], (3, 4, 6, 5))
RHS = jax.random.normal(_KEYS[1], (6, 3, 7))
COT = jax.random.normal(_KEYS[2], (3, 4, 5, 7))


def _mixed(lowering, compute):
    with hardware.pinned_lowering(lowering):
        f = jax.jit(lambda a, b: mixed_ops.mixed_dot_general(a, b, DIMS, compute, F32))
        out, vjp = jax.vjp(f, LHS, RHS)
        return (out, *vjp(COT))


def _rounded_reference(compute):
    def rnd(x):
        return x.astype(compute).astype(F32)

    def dot(a, b):
        return lax.dot_general(a, b, DIMS, precision=lax.Precision.HIGHEST)

    out, vjp = jax.vjp(dot, rnd(LHS), rnd(RHS))
    return (out, *vjp(rnd(COT)))


# Both lowerings multiply the same 16-bit values exactly and sum in float32, so they agree with
# float32 autodiff of the rounded operands, and with each other, up to summation order:
BOUND = 1e-5  # relative to the largest magnitude of each result


@pytest.mark.parametrize("compute", [BF16, F16])
def test_both_lowerings_give_the_policy_numerics(compute):
    ref = _rounded_reference(compute)
    native, upcast = _mixed("native", compute), _mixed("upcast", compute)
    for got_n, got_u, want in zip(native, upcast, ref):
        scale = float(jnp.max(jnp.abs(want)))
        assert got_n.dtype == got_u.dtype == F32
        assert float(jnp.max(jnp.abs(got_n - want))) <= BOUND * scale
        assert float(jnp.max(jnp.abs(got_u - want))) <= BOUND * scale
        assert float(jnp.max(jnp.abs(got_u - got_n))) <= BOUND * scale


def test_upcast_lowering_keeps_the_rounding_to_16_bits():
    # XLA must not fold the widening into the float32 original: the result is the bf16 product's,
    # far from the float32 one.
    out = _mixed("upcast", BF16)[0]
    exact = lax.dot_general(LHS, RHS, DIMS, precision=lax.Precision.HIGHEST)
    assert float(jnp.max(jnp.abs(out - exact))) > 100 * BOUND * float(jnp.max(jnp.abs(exact)))


def _dots(lowering):
    def loss(a, b):
        return jnp.sum(mixed_ops.mixed_dot_general(a, b, DIMS, BF16, F32) * COT)

    with hardware.pinned_lowering(lowering):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(LHS, RHS).jaxpr
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    return [e for e in jaxpr.eqns if e.primitive.name == "dot_general"], producers


def test_native_lowering_feeds_16_bit_operands_to_every_dot():
    dots, _ = _dots("native")
    assert len(dots) == 3  # forward, d lhs, d rhs
    for e in dots:
        assert [np.dtype(v.aval.dtype) for v in e.invars] == [BF16, BF16]


def test_upcast_lowering_widens_16_bit_values_into_float32_dots():
    dots, producers = _dots("upcast")
    assert len(dots) == 3
    for e in dots:
        for v in e.invars:
            assert np.dtype(v.aval.dtype) == F32
            convert = producers[v]
            assert convert.primitive.name == "convert_element_type"
            assert np.dtype(convert.invars[0].aval.dtype) == BF16


@pytest.mark.parametrize("reduce", [F32, BF16])
def test_upcast_lowering_rounds_a_reduce_dtype_gradient_once(reduce):
    x, w, cot = LHS[0, 0], RHS[:, 0], COT[0, 0]  # [6, 5] x [6, 7] -> [5, 7]: a 2-D product
    dims = (((0,), (0,)), ((), ()))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    placed = mixed_ops.Placed(spec, reduce)

    def grads(lowering, where):
        with hardware.pinned_lowering(lowering):
            f = jax.jit(lambda a, b: mixed_ops.mixed_dot_general(a, b, dims, BF16, F32, where))
            return jax.vjp(f, x, w)[1](cot)[1]

    got, full = grads("upcast", (None, placed)), grads("upcast", (None, None))
    assert got.dtype == F32
    np.testing.assert_array_equal(got, full.astype(reduce).astype(F32))
    scale = float(jnp.max(jnp.abs(full)))
    native = grads("native", (None, placed))
    assert (
        float(jnp.max(jnp.abs(got - native)))
        <= BOUND * scale + float(jnp.finfo(reduce).eps) * scale
    )


def test_patch_convolution_under_both_lowerings_agrees():
    # The few-channel convolution runs as a patch matmul on CPUs; it follows the lowering too.
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    x, w = jax.random.normal(k1, (2, 9, 9, 3)), 0.3 * jax.random.normal(k2, (3, 3, 3, 5))
    kwargs = dict(
        window_strides=(1, 1), padding=((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    jaxpr = jax.make_jaxpr(lambda a, b: lax.conv_general_dilated(a, b, **kwargs))(x, w)
    params = dict(jaxpr.eqns[0].params)
    cot = jax.random.normal(k3, (2, 9, 9, 5))

    def run(lowering):
        with hardware.pinned_lowering(lowering):
            f = jax.jit(lambda a, b: mixed_ops.mixed_conv(a, b, params, BF16, F32))
            out, vjp = jax.vjp(f, x, w)
            return (out, *vjp(cot))

    for got_n, got_u in zip(run("native"), run("upcast")):
        scale = float(jnp.max(jnp.abs(got_n)))
        assert float(jnp.max(jnp.abs(got_u - got_n))) <= BOUND * scale


def test_wrapped_transformer_gets_the_same_loss_and_gradients_under_both_lowerings():
    # The whole wrap path (batched attention products included) runs under "upcast" and agrees
    # with "native": only summation order differs, and an occasional 16-bit rounding it flips.
    from jamp.models import TransformerLM
    from jamp.wrap import wrap

    model = TransformerLM(vocab_size=64, num_layers=2, d_model=32, num_heads=4, mlp_dim=64)
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 64)
    params = model.init(jax.random.key(6), tokens)
    wrapped = wrap(model, "mixed_bfloat16")

    def loss(p):
        return jnp.mean(wrapped.apply(p, tokens).astype(F32) ** 2)

    def run(lowering):
        with hardware.pinned_lowering(lowering):
            return jax.jit(jax.value_and_grad(loss))(params)

    (loss_n, g_n), (loss_u, g_u) = run("native"), run("upcast")
    assert abs(float(loss_u - loss_n)) <= 1e-4 * abs(float(loss_n))
    diff = _norm(jax.tree.map(lambda a, b: a - b, g_n, g_u))
    assert diff <= 1e-3 * _norm(g_n)
    # ... a bound well below what the policy itself changes: float32 gradients differ more.
    g_32 = jax.jit(jax.grad(lambda p: jnp.mean(model.apply(p, tokens) ** 2)))(params)
    assert _norm(jax.tree.map(lambda a, b: a - b, g_n, g_32)) > 3e-3 * _norm(g_32)


def _norm(tree):
    return float(jnp.sqrt(sum(jnp.sum(x.astype(F32) ** 2) for x in jax.tree.leaves(tree))))


def test_compiling_for_a_gpu_gives_the_gpu_forms_on_this_cpu():
    """Traced for a GPU (a fake device; `jamp.compile_for` passes a topology's), every choice jamp
    makes while tracing is the GPU's, whatever this host is; nested records share what they
    note; outside, the host's forms come back."""
    from jamp import activations

    with hardware.pinned_lowering("auto"):
        assert hardware.target_platform() == "cpu"
        with hardware.compiling_for(H200) as outer:
            assert hardware.target_device() is H200 and hardware.target_platform() == "gpu"
            assert hardware.matmul_lowering(jnp.bfloat16) == "native"
            assert activations.resolve("auto") == "compute"
            with hardware.compiling_for(MI300) as inner:
                assert hardware.target_platform() == "gpu"  # rocm reads gpu
                activations.note("compute", jnp.bfloat16)
            activations.note("compute", jnp.float32)  # a float32 policy records nothing
            x, w = jnp.ones((2, 4, 4, 4), jnp.float32), jnp.ones((5, 4, 3, 3), jnp.float32)
            on_gpu = _conv_result_dtypes(x, w)
        assert outer.activations == inner.activations == {"compute"}
        assert hardware.tracing() is None and hardware.target_platform() == "cpu"
        assert activations.resolve("auto") == "float32"
    # On an NVIDIA target a convolution and its two transposes return their 16-bit results
    # (cuDNN accumulates in fp32); on the CPU, float32 results.
    assert on_gpu == [BF16] * 3
    assert _conv_result_dtypes(x, w) == [F32] * 3


def _conv_result_dtypes(x, w):
    def loss(x, w):
        return mixed_ops.mixed_conv(x, w, _CONV, jnp.bfloat16, jnp.float32).sum()

    from jax.extend import core as jcore

    def convs(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "conv_general_dilated":
                yield np.dtype(e.outvars[0].aval.dtype)
            for sub in jcore.jaxprs_in_params(e.params):
                yield from convs(sub)

    return list(convs(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr))


_CONV = dict(
    window_strides=(1, 1),
    padding=((1, 1), (1, 1)),
    lhs_dilation=(1, 1),
    rhs_dilation=(1, 1),
    dimension_numbers=lax.ConvDimensionNumbers((0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)),
    feature_group_count=1,
    batch_group_count=1,
    precision=None,
)
