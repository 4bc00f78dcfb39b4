"""jamp.target and jamp.compile_for: the real H200 program, compiled on this CPU (no GPU).

Every claim about GPU kernels, dtypes, collectives and memory is read from the program XLA:GPU
compiles for the target: GEMMs (cuBLAS / Triton fusions / cuDNN convolutions), fp8 cuBLASLt
calls, FSDP collectives, the buffer assignment. Compiling for a GPU is slow here (10-40 s a
program), so each program serves several checks: one program holds the five models whose
dtypes are checked under a policy. Needs JAX's CUDA plugin (`pip install -e '.[gpu-compile]'`,
CI's newest end); without it these tests skip, saying so.
"""

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jamp
from jamp import hardware, hlo, sharding
from jamp import target as target_lib
from jamp.hlo import buffers
from jamp.hlo import kernels as kernels_lib
from jamp.inspect._paths import op_name_path
from jamp.models import ResNet, SeedCNN, TransformerLM, nnx_models
from jamp.scopes import SUM_SCOPE

H200 = "h200"
COMPUTE = {"mixed_bfloat16": "bf16", "mixed_float16": "f16", "float32": "f32"}


def test_target_names_parse_and_a_bad_one_lists_the_targets():
    t = target_lib.get_target("2x h200x8")
    assert (t.gpu.name, t.gpus_per_host, t.hosts, t.num_devices, t.name) == (
        "h200",
        8,
        2,
        16,
        "2x h200x8",
    )
    assert target_lib.get_target("2xh200x8") == t and target_lib.get_target(t) is t
    assert target_lib.get_target("H100").num_devices == 1
    assert target_lib.get_target("b200x4").gpu.compute_capability == (10, 0)
    for bad in ("a100", "h200x", "h200x0", ""):
        with pytest.raises(ValueError, match=r"^(unknown target|target).*"):
            target_lib.get_target(bad)
    with pytest.raises(ValueError, match=r"^unknown target 'a100'; targets: h100, h200, b200"):
        target_lib.get_target("a100")
    config = target_lib.GPUS["h200"].target_config()
    assert "core_count: 132" in config and "major: 9 minor: 0" in config
    assert 'device_description_str: "NVIDIA H200"' in config


def test_target_without_the_plugin_is_one_line(monkeypatch):
    monkeypatch.setattr(target_lib, "plugin_available", lambda: False)
    target_lib._topology.cache_clear()
    try:
        with pytest.raises(
            target_lib.TargetUnavailable,
            match=r"^compiling for a GPU target "
            r"needs JAX's CUDA plugin: in a checkout of jamp, pip install -e '\.\[gpu-compile\]'",
        ):
            _ = target_lib.get_target("b200").devices
    finally:
        target_lib._topology.cache_clear()


@pytest.mark.gpu_compile
def test_target_without_cudnn_warns_that_attention_will_not_be_fused(monkeypatch):
    """The CUDA plugin alone compiles, but as for a GPU without cuDNN: attention is written out,
    not fused as on the GPUs users train on. jamp says so once per target, and how to fix it."""
    from jamp import jax_compat

    assert jax_compat.cudnn_version() >= 8900  # what the gpu-compile extra installs
    monkeypatch.setattr(jax_compat, "cudnn_version", lambda: None)
    assert not target_lib.cudnn_available()
    target_lib._topology.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"^cuDNN is not installed here: .*gpu-compile"):
            _ = target_lib.get_target("h100").devices
    finally:
        target_lib._topology.cache_clear()


@pytest.mark.gpu_compile
def test_compile_for_with_the_callers_dump_folder_reads_what_it_wrote(tmp_path):
    """XLA options may name a dump folder of the user's: the report reads this compile's files
    there (not another's left from before) and the folder keeps them."""
    (tmp_path / "module_0001.jit_old.sm_9.0a_gpu_after_optimizations.txt").write_text("old")

    def f(x):
        return jnp.tanh(x @ x)

    x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    report = jamp.compile_for(f, x, target=H200, compiler_options={"xla_dump_to": str(tmp_path)})
    assert "tanh" in report.hlo_text and report.memory.peak > 0
    assert any("jit_f" in p.name and "buffer-assignment" in p.name for p in tmp_path.iterdir())


def test_report_lists_what_the_engine_recognised_as_attention_by_decision():
    from types import SimpleNamespace

    from jamp.inspect.compiled import _traced_attention_lines

    traced = [(f"LM/Block_{i}/attn", "cudnn", "") for i in range(12)]
    traced += [("LM/Block_0/attn", "unfused", "dropout on the weights")]
    lines = _traced_attention_lines(SimpleNamespace(attention_traced=tuple(traced)))
    assert lines == [
        "  recognised by jamp while tracing: 13",
        "    12 cuDNN fused: LM/Block_0/attn, LM/Block_1/attn and 10 more",
        "    1 left as traced (dropout on the weights): LM/Block_0/attn",
    ]


@pytest.mark.gpu_compile
def test_target_devices_are_a_topology_of_gpus():
    devices = target_lib.get_target("2x h200x8").devices
    assert len(devices) == 16 and {d.process_index for d in devices} == {0, 1}
    assert {d.device_kind for d in devices} == {"NVIDIA H200"}


@pytest.mark.gpu_compile
def test_activations_auto_is_16_bit_for_a_gpu_target_and_float32_on_the_cpu():
    from jamp import activations

    assert activations.resolve("auto") == "float32"  # this test process: a CPU
    with hardware.compiling_for(target_lib.get_target(H200).devices[0]):
        assert hardware.target_platform() == "gpu"
        assert activations.resolve("auto") == "compute"
        with hardware.pinned_lowering("auto"):
            assert hardware.matmul_lowering(jnp.bfloat16) == "native"
    assert activations.resolve("auto") == "float32"


# ----- one program of five models per policy: every matmul / convolution's operand dtypes


def _five_models(policy):
    """(loss(params), params): the wrapped seed CNN, ResNet-20, TransformerLM and NNX CNN, and a
    `jamp.autocast` function, summed, so that one compile checks them all."""
    key = jax.random.key(0)
    images = jnp.zeros((2, 8, 8, 3))
    tokens = jnp.zeros((2, 16), jnp.int32)
    cnn = jamp.wrap(SeedCNN(num_classes=10), policy)
    resnet = jamp.wrap(ResNet((3, 3, 3), num_classes=10, num_filters=8), policy)
    lm = jamp.wrap(TransformerLM(64, num_layers=1, d_model=32, num_heads=2, mlp_dim=64), policy)
    nnx_model = jamp.wrap(nnx_models.SeedCNN(10, image_shape=(8, 8, 3), rngs=nnx.Rngs(0)), policy)
    graphdef, nnx_state = nnx.split(nnx_model)

    def fn(x, w, k):
        with jax.named_scope("autocast_fn"):
            y = jax.lax.conv_general_dilated(
                x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            return jnp.tanh(y.reshape(y.shape[0], -1) @ w)

    cast_fn = jamp.autocast(fn, policy, params_argnums=(1, 2))
    params = {
        "cnn": jax.eval_shape(cnn.init, key, images)["params"],
        "resnet": jax.eval_shape(lambda: resnet.init(key, images, train=False)),
        "lm": jax.eval_shape(lm.init, key, tokens)["params"],
        "nnx": nnx_state,
        "fn": (
            jax.ShapeDtypeStruct((8 * 8 * 4, 10), jnp.float32),
            jax.ShapeDtypeStruct((3, 3, 3, 4), jnp.float32),
        ),
    }

    def loss(p):
        total = jnp.sum(cnn.apply({"params": p["cnn"]}, images) ** 2)
        out, _ = resnet.apply(p["resnet"], images, train=True, mutable=["batch_stats"])
        total += jnp.sum(out**2)
        total += jnp.sum(lm.apply({"params": p["lm"]}, tokens) ** 2)
        total += jnp.sum(nnx.merge(graphdef, p["nnx"])(images).astype(jnp.float32) ** 2)
        return total + jnp.sum(cast_fn(images, *p["fn"]) ** 2)

    return jax.grad(loss), params


@pytest.fixture(scope="module", params=["mixed_bfloat16", "mixed_float16", "float32"])
def five(request):
    grad, params = _five_models(request.param)
    return request.param, jamp.compile_for(grad, params, target=H200)


def _model_of(op_name):
    if "jamp_nnx_root(SeedCNN)" in op_name:  # a wrapped NNX model's call (jamp.nnx.ROOT_SCOPE)
        return "nnx SeedCNN"
    for name in ("SeedCNN", "ResNet", "TransformerLM", "autocast_fn"):
        if name in op_name:
            return name
    return "?"


@pytest.mark.gpu_compile
def test_compile_for_every_matmul_and_convolution_in_the_compute_dtype(five):
    policy, report = five
    want = COMPUTE[policy]
    gemms = report.gemms
    convs = [g for g in gemms if g.kind == "cuDNN conv"]
    mats = [g for g in gemms if g.kind != "cuDNN conv"]
    # All five models are there, forward and backward, GEMMs and cuDNN convolutions.
    models = {"SeedCNN", "ResNet", "TransformerLM", "autocast_fn", "nnx SeedCNN"}
    assert {_model_of(g.op_name) for g in mats} == models
    assert {_model_of(g.op_name) for g in convs} == models - {"TransformerLM"}
    # The NNX CNN's two forward and three backward convolutions, by its scope.
    assert len([g for g in convs if _model_of(g.op_name) == "nnx SeedCNN"]) == 5
    assert {op_name_path(g.op_name)[1] for g in gemms} == {False, True}
    wrong = [(g.kind, g.operands, g.op_name) for g in gemms if g.operands != (want, want)]
    assert not wrong, wrong
    # f32 accumulation: every GEMM sums in float32 and returns float32, or writes its result in
    # the compute dtype, which XLA:GPU's 16-bit GEMMs (cuBLAS and Triton) also sum in float32,
    # rounding once (jamp asks for that where the result goes to 16-bit activations); cuDNN's
    # 16-bit convolutions accumulate in fp32 themselves.
    assert {g.accumulates for g in mats} <= {"f32", want}
    assert "f32" in {g.accumulates for g in mats}  # weight gradients for float32 params
    assert {g.result for g in convs} <= {"f32", want}
    assert (report.fp32_gemms() == []) == (policy != "float32")
    if policy != "float32":  # "auto" resolved for the GPU target: 16-bit activations
        assert report.activations == ("compute",)
    # Flax's attention in the LM: under a 16-bit policy cuDNN's fused kernel, forward and
    # backward, as jamp recognised it while tracing; under float32 batched GEMMs and a softmax.
    (attention,) = report.attention
    assert attention.path == "DecoderBlock_0/MultiHeadDotProductAttention_0"
    if policy == "float32":
        assert not attention.fused and attention.forward == 2 and attention.backward >= 2
        assert report.attention_traced == ()
    else:
        assert attention.fused and (attention.forward, attention.backward) == (1, 1)
        assert attention.mask == "causal"  # the LM's causal mask, as cuDNN's mask type
        ((path, how, why),) = report.attention_traced
        assert path.endswith(attention.path) and (how, why) == ("cudnn", "")


@pytest.mark.gpu_compile
def test_compile_for_a_long_sequence_runs_causal_attention_without_a_mask_array():
    """At 8192 positions (past what is evaluated while tracing: 4096 x 4096), the LM's causal
    mask is read by its form and runs as cuDNN's causal mask type: no [8192, 8192] mask or bias
    anywhere in the program (before: a bias, every score computed; for this LM at 8192 x 512,
    predicted attention 1.09 -> 0.55 ms, planned peak 0.35 -> 0.22 GiB)."""
    n = 8192
    lm = TransformerLM(64, num_layers=1, d_model=32, num_heads=2, mlp_dim=64, max_len=n)
    model = jamp.wrap(lm, "mixed_bfloat16")
    tokens = jax.ShapeDtypeStruct((1, n), jnp.int32)
    params = jax.eval_shape(lm.init, jax.random.key(0), tokens)["params"]

    def grad(p, t):
        return jax.grad(lambda p: jnp.mean(model.apply({"params": p}, t).astype(jnp.float32)))(p)

    report = jamp.compile_for(grad, params, tokens, target=H200)
    (attention,) = report.attention
    assert attention.fused and attention.mask == "causal"
    assert f"{n},{n}]" not in report.hlo_text


class _LocalAttention(nn.Module):
    """Self-attention with a causal mask and, given a window, a sliding one (Mistral's)."""

    window: Optional[int]

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.DenseGeneral((4, 64))(x) for _ in range(3))
        pos = jnp.arange(x.shape[1])
        mask = pos[:, None] >= pos[None, :]
        if self.window is not None:
            mask &= pos[:, None] - pos[None, :] <= self.window
        return nn.dot_product_attention(q, k, v, mask=mask)


@pytest.mark.gpu_compile
def test_compile_for_a_sliding_window_runs_as_cudnns_window():
    """A causal mask with a sliding window of 1024 over 8192 positions (read by its form) runs
    as cuDNN's causal mask type with its window: each query's 1025 keys, not the whole causal
    half (the attention's matrix FLOPs a quarter of causal's), and no [8192, 8192] mask."""
    n, flops = 8192, {}
    for window in (None, 1024):
        model = jamp.wrap(_LocalAttention(window), "mixed_bfloat16")
        x = jax.ShapeDtypeStruct((1, n, 32), jnp.float32)
        params = jax.eval_shape(model.init, jax.random.key(0), x)

        def grad(p, x, model=model):
            return jax.grad(lambda p: jnp.mean(model.apply(p, x).astype(jnp.float32)))(p)

        report = jamp.compile_for(grad, params, x, target=H200)
        (attention,) = report.attention
        assert attention.fused and attention.mask == (
            "causal" if window is None else "causal, window 1025"
        )
        assert f"{n},{n}]" not in report.hlo_text
        program = kernels_lib.kernels(hlo.parse(report.hlo_text))
        flops[window] = sum(k.flops * k.count for k in program if k.kind == "attention")
    assert 0.2 < flops[1024] / flops[None] < 0.25  # (1025 x 8192 - 1025^2 / 2) / (8192^2 / 2)


class _GivenMaskAttention(nn.Module):
    """Hugging Face GPT-2's attention masking: its causal mask and the attention mask it is
    given (data), combined and made an additive bias of 0 or the most negative float."""

    @nn.compact
    def __call__(self, x, attention_mask):
        q, k, v = (nn.DenseGeneral((2, 64))(x) for _ in range(3))
        b, t = attention_mask.shape
        causal = nn.make_causal_mask(jnp.ones((1, t), bool), dtype=bool)
        given = jnp.broadcast_to(attention_mask[:, None, None, :], (b, 1, t, t))
        mask = nn.combine_masks(given, jnp.broadcast_to(causal, (b, 1, t, t)))
        fill = jnp.full(mask.shape, jnp.finfo(jnp.float32).min)
        bias = jax.lax.select(mask > 0, jnp.zeros(mask.shape), fill)
        return nn.dot_product_attention(q, k, v, bias=bias)


@pytest.mark.gpu_compile
def test_compile_for_a_bias_of_data_that_is_a_mask_computes_no_bias_gradient():
    """A bias that is 0 or very negative whatever the data (Hugging Face's) goes to cuDNN as the
    mask it is: causal, and no bias gradient written by the backward kernel (before: a
    bf16[B, 1, T, S] output of every layer's backward that nothing reads)."""
    import inspect

    from jax._src.cudnn import fused_attention_stablehlo

    if "bias_is_differentiable" not in inspect.getsource(fused_attention_stablehlo):
        pytest.skip("this JAX computes a boolean mask's bias gradient too (JAX 0.10)")
    b, t = 2, 256
    model = jamp.wrap(_GivenMaskAttention(), "mixed_bfloat16")
    x = jax.ShapeDtypeStruct((b, t, 32), jnp.float32)
    given = jax.ShapeDtypeStruct((b, t), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), x, given)

    def grad(p, x, given):
        return jax.grad(lambda p: jnp.mean(model.apply(p, x, given).astype(jnp.float32)))(p)

    report = jamp.compile_for(grad, params, x, given, target=H200)
    (attention,) = report.attention
    assert attention.fused and attention.mask == "causal + bias"  # (the mask, as cuDNN takes it)
    backward = [line for line in report.hlo_text.splitlines() if 'SoftmaxBackward"' in line]
    assert backward and all(
        f"[{b},1,{t},{t}]" not in line.split("custom-call(")[0] for line in backward
    )


@pytest.mark.gpu_compile
def test_compile_for_memory_equals_xla_analysis_and_its_dtype_split_sums(five):
    policy, report = five
    m = report.memory
    assert sum(m.temporaries_by_dtype.values()) == m.temporaries
    assert set(m.temporaries_by_dtype) == set(buffers.CLASSES)
    assert m.peak == m.arguments + m.outputs - m.aliased + m.temporaries
    assert m.hbm == target_lib.GPUS["h200"].hbm_bytes
    assert sum(m.arguments_by_dtype.values()) == m.arguments
    if policy == "mixed_bfloat16":  # 16-bit activations: bf16 values among the temporaries
        assert m.temporaries_by_dtype["bf16"] > 0
    data = report.to_dict()
    assert data["memory"]["temporaries"] == m.temporaries and data["fits"] is True
    assert "attention" in data and data["gemms"]


@pytest.mark.gpu_compile
def test_compile_for_memory_numbers_are_xla_memory_analysis():
    """The report's figures are XLA's own (memory_analysis of the same executable)."""
    w = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)

    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    report = jamp.compile_for(jax.grad(f), w, x, target="h100")
    device = target_lib.get_target("h100").devices[0]
    s = jax.sharding.make_single_device_sharding(device)
    lowered = jax.jit(jax.grad(f)).lower(
        jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=s),
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    )
    stats = lowered.compile().memory_analysis()
    m = report.memory
    assert (m.arguments, m.outputs, m.aliased, m.temporaries) == (
        stats.argument_size_in_bytes,
        stats.output_size_in_bytes,
        stats.alias_size_in_bytes,
        stats.temp_size_in_bytes,
    )
    assert m.arguments == (256 * 512 + 64 * 256) * 4 and report.gemms  # f32 control: f32 GEMMs
    assert report.fp32_gemms() and report.memory.hbm == target_lib.GPUS["h100"].hbm_bytes


# ----- fp8: cuBLASLt fp8 GEMMs at every fp8 site


@pytest.mark.gpu_compile
def test_compile_for_fp8_sites_run_cublaslt_fp8_gemms_forward_and_backward():
    model = jamp.wrap(
        TransformerLM(64, num_layers=1, d_model=32, num_heads=2, mlp_dim=64), "mixed_fp8"
    )
    tokens = jnp.zeros((2, 16), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]

    def loss(p):
        return jnp.sum(model.apply({"params": p}, tokens) ** 2)

    report = jamp.compile_for(
        jax.grad(loss),
        params,
        target=H200,
        compiler_options={"xla_gpu_enable_triton_gemm": False},  # the cuBLASLt path
    )
    by_site = {}
    for g in report.gemms:
        if SUM_SCOPE in g.op_name:  # a bias's gradient: a sum, as a bf16 product with ones
            assert g.operands == ("bf16", "bf16") and g.accumulates == "f32", g
            continue
        path, backward = op_name_path(g.op_name)
        by_site.setdefault(path, []).append((g, backward))
    fp8_sites = {p for p, gs in by_site.items() if any(g.kind == "cuBLASLt fp8" for g, _ in gs)}
    dense = {"DecoderBlock_0/Dense_0", "DecoderBlock_0/Dense_1"}
    attn = "DecoderBlock_0/MultiHeadDotProductAttention_0"
    assert dense <= fp8_sites and any(s.startswith(attn + "/") for s in fp8_sites)
    for site in fp8_sites:  # all fp8, nothing else at an fp8 site
        gemms = by_site[site]
        assert all(g.kind == "cuBLASLt fp8" for g, _ in gemms), site
        assert all(set(g.operands) <= {"f8e4m3fn", "f8e5m2"} for g, _ in gemms)
        assert True in {b for _, b in gemms}, site  # its backward GEMMs
    # Forward GEMMs too; XLA may merge the q/k/v projections' forward GEMMs into one, so those
    # count together.
    forward = {p for p in fp8_sites if False in {b for _, b in by_site[p]}}
    assert dense | {attn + "/out"} <= forward
    assert any(p.startswith(attn + "/") and p != attn + "/out" for p in forward)
    # What the policy keeps bf16: the (tied) output head's GEMMs, and attention's two matmuls
    # of activations, which run as cuDNN's fused kernel in bf16 (no batched GEMMs left).
    others = [(p, g) for p, gs in by_site.items() if p not in fp8_sites for g, _ in gs]
    assert others and all(g.operands == ("bf16", "bf16") for _, g in others)
    assert {p for p, g in others} == {"Embed_0"} and not any(g.batched for _, g in others)
    ((path, how, _),) = report.attention_traced
    assert path.endswith(attn) and how == "cudnn"
    assert [(a.path, a.fused) for a in report.attention] == [(attn, True)]
    assert "bf16[" in next(
        line
        for line in report.hlo_text.splitlines()
        if "__cudnn$fmha" in line and "custom-call(" in line
    )


def _source(program, insts, name):
    """The instruction (and tuple element) an operand's values come from, through bitcasts and
    transposes (cuBLASLt's fp8 GEMMs read one operand transposed)."""
    layout = {"parameter", "transpose", "bitcast", "copy"}
    inst = insts[name]
    while inst.op in ("bitcast", "copy", "transpose", "get-tuple-element") or (
        inst.op == "fusion"
        and len(inst.operands) == 1
        and {i.op for i in program.body(inst)} <= layout
    ):
        if inst.op == "get-tuple-element":
            return inst.operands[0], inst.attribute("index")
        inst = insts[inst.operands[0]]
    return inst.name, None


@pytest.mark.gpu_compile
def test_compile_for_fp8_keeps_one_copy_of_an_input_for_the_backward_pass():
    # q, k and v read one normalised input, gate and up another. Under a delayed fp8 state each
    # site quantised its own copy (and kept it for the backward pass: on Llama 1.5B over 8
    # H200s, 1.3 GiB more than bf16's one copy); sharing the first reader's scale makes them one
    # fp8 value, whose GEMMs XLA may merge (it does here: 4 forward fp8 GEMMs, not 7).
    from jamp import fp8
    from jamp.hlo import text as hlo_text
    from jamp.models.llama import LlamaLM

    lm = LlamaLM(
        256, num_layers=1, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=128, max_len=32
    )
    model = jamp.wrap(lm, "mixed_fp8")
    tokens = jnp.zeros((4, 32), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]

    def loss_fn(p):
        return jnp.mean(model.apply({"params": p}, tokens).astype(jnp.float32) ** 2)

    state = fp8.init_state(loss_fn, params)
    assert len(state.sites) == 7

    def observed(p, st):
        with fp8.scaling(st):
            return loss_fn(p)

    report = jamp.compile_for(
        jax.grad(observed, argnums=(0, 1)),
        params,
        state,
        target=H200,
        compiler_options={"xla_gpu_enable_triton_gemm": False},  # the cuBLASLt path
    )
    program = hlo_text.parse(report.hlo_text)
    insts = {i.name: i for i in program.instructions}
    readers = {"q": "attn", "k": "attn", "v": "attn", "gate": "mlp", "up": "mlp"}
    inputs = {}  # the fp8 activations [batch x length, d_model] their forward GEMMs read
    read = {}  # per site and pass, the fp8 E4M3 activations its GEMMs read (not the weights)
    for g in report.gemms:
        path, backward = op_name_path(g.op_name)
        site = path.rsplit("/", 1)[-1]
        if g.kind != "cuBLASLt fp8":
            continue
        for operand in insts[g.name].operands[:2]:
            arrays = insts[operand].arrays
            if arrays and arrays[0][0] == "f8e4m3fn" and np.prod(arrays[0][1]) == 4 * 32 * 64:
                read.setdefault((site, backward), set()).add(_source(program, insts, operand))
            if insts[operand].arrays == (("f8e4m3fn", (128, 64)),) and site in readers:
                if not backward:
                    inputs.setdefault(readers[site], set()).add(_source(program, insts, operand))
    assert {k: len(v) for k, v in inputs.items()} == {"attn": 1, "mlp": 1}, inputs
    # That one quantisation is what their backward GEMMs read (the weight gradients' x^T g; XLA
    # may merge q's, k's and v's into one GEMM named by any of them, as JAX 0.10's does, and may
    # write the fp8 values in both layouts from the one fusion: the forward reads one, x^T g the
    # other)...
    backward = set().union(*(read.get((site, True), set()) for site in ("q", "k", "v")))
    assert {name for name, _ in inputs["attn"]} & {name for name, _ in backward}, (inputs, read)
    # ...but o's input is cuDNN's output, which its backward keeps in bf16 anyway: o keeps that,
    # not an fp8 copy beside it, and quantises it again in the backward pass (on Llama 1.5B over
    # 8 H200s the copy was 0.44 GiB of the step's temporaries)
    assert [how for _, how, _ in report.attention_traced] == ["cudnn"]
    assert read[("o", False)] and read[("o", True)]
    assert not read[("o", False)] & read[("o", True)]


# ----- FSDP on 8 H200s: what crosses the wire


def _lm_state(policy, mesh):
    model = jamp.wrap(
        TransformerLM(256, num_layers=2, d_model=64, num_heads=4, mlp_dim=128, max_len=32), policy
    )
    tokens = jnp.zeros((16, 33), jnp.int32)
    tx = optax.adamw(1e-3)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])["params"]
    state = jax.eval_shape(lambda: jamp.TrainState.create(params, tx))

    def loss_fn(p, model_state, batch, rng):
        logits = model.apply({"params": p}, batch[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return loss, (model_state, {})

    reduce = jamp.precision.reduce_dtype(jamp.get_policy(policy))
    step = jamp.make_train_step(loss_fn, tx, reduce_dtype=None if reduce == np.float32 else reduce)
    shardings = sharding.state_shardings(state, mesh)
    p_step = sharding.make_sharded_train_step(step, mesh, shardings)
    key = jax.eval_shape(lambda: jax.random.key(0))
    return state, p_step, tokens, key


@pytest.mark.gpu_compile
@pytest.mark.parametrize(
    "mesh_spec,policy,gathered,reduced",
    [
        ("fsdp=8", "mixed_bfloat16", {"bf16"}, "f32"),
        ("data=2,fsdp=4", "mixed_bfloat16,reduce=bf16", {"bf16"}, "bf16"),
        ("fsdp=8", "mixed_fp8", {"f8e4m3fn"}, "f32"),
    ],
)
def test_compile_for_fsdp_gathers_weights_in_the_compute_dtype(
    mesh_spec, policy, gathered, reduced
):
    target = target_lib.get_target("h200x8")
    mesh = target.mesh(mesh_spec)
    state, step, tokens, key = _lm_state(policy, mesh)
    report = jamp.compile_for(step, state, tokens, key, target=target)
    from jamp import hlo

    found = hlo.collectives(report.hlo_text)
    # The matmul weights (kernels) as each device receives them: gathered over fsdp in the
    # compute dtype (fp8 for fp8 matmuls), whole. The tied embedding, read by the head's bf16
    # matmul and by the row lookup, is gathered in bf16 or float32.
    fsdp = dict(mesh.shape)["fsdp"]

    def dims(shape):  # XLA may gather a kernel in another layout (transposed)
        return tuple(sorted(shape))

    kernels = {
        dims(x.shape)
        for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]
        if "kernel" in str(path[-1])
    }
    gathers = [c for c in found if c.kind == "all-gather" and c.into_matmul]
    weights = [c for c in gathers if dims(c.shape) in kernels]
    assert {dims(c.shape) for c in weights} == kernels
    assert {c.dtype for c in weights} == gathered
    assert all(c.dtype in ("bf16", "f32") for c in gathers if dims(c.shape) not in kernels)
    # Their gradients leave the matmuls reduce-scattered in the reduce dtype.
    grads = [c for c in found if c.kind in ("reduce-scatter", "all-reduce") and c.from_matmul]
    shards = {dims(s[:i] + (s[i] // fsdp,) + s[i + 1 :]) for s in kernels for i in range(len(s))}
    assert {dims(c.shape) for c in grads} & shards
    assert {c.dtype for c in grads if dims(c.shape) in shards} == {reduced}
    assert {a for c in report.collectives for a in c.axes} <= {"data", "fsdp"}
    assert any(c.axes == ("fsdp",) and c.kind == "all-gather" for c in report.collectives)
    # Per device: an fsdp-th of the state, plus the leaves describe names as replicated; the
    # report's arguments are that, this device's rows of the batch and the key.
    leaves = jax.tree.leaves(state)
    specs = jax.tree.leaves(sharding.state_shardings(state, mesh))
    nbytes = [int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves]
    replicated = sum(n for n, s in zip(nbytes, specs) if s.is_fully_replicated)
    data = dict(mesh.shape).get("data", 1)
    per_device = (sum(nbytes) - replicated) / fsdp + replicated
    assert "replicated" in sharding.describe(state, mesh)
    batch = tokens.size * 4 // (fsdp * data)
    assert report.memory.arguments == pytest.approx(per_device + batch + 8, abs=64)
