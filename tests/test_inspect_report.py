"""The precision report (jamp.inspect.report): per-module dtypes, FLOPs, rules and hazards."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jamp
from jamp import hlo
from jamp.inspect import _paths
from jamp.inspect._walk import OUTSIDE
from jamp.inspect.report import compiled_hazards, precision_report
from jamp.models import TransformerLM

BF16 = jnp.bfloat16


def _lm_step(policy):
    """A tiny wrapped Transformer LM's real train step, its state and a batch."""
    model = jamp.wrap(
        TransformerLM(vocab_size=32, num_layers=1, d_model=16, num_heads=2, mlp_dim=32, max_len=8),
        policy,
    )
    tokens = jnp.zeros((2, 9), jnp.int32)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]

    def loss_fn(params, model_state, batch, rng):
        logits = model.apply({"params": params}, batch[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return loss, ({}, {})

    tx = optax.adam(1e-3)
    state = jamp.TrainState.create(params, tx, loss_scale=jamp.loss_scale_for(policy))
    return jamp.make_train_step(loss_fn, tx), state, tokens, params


def _module_paths(params) -> set[str]:
    """Every module path of a params tree (each leaf's path without its name, and its parents)."""
    out = {""}
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [jax.tree_util.keystr((k,), simple=True) for k in path][:-1]
        out |= {"/".join(keys[: i + 1]) for i in range(len(keys))}
    return out


def test_report_transformer_all_matmul_flops_16bit_under_mixed_bfloat16():
    step, state, tokens, _ = _lm_step("mixed_bfloat16")
    report = precision_report(step, state, tokens, jax.random.key(0))
    assert report.compute_dtype == "bfloat16"
    assert report.totals.share_16bit() == 1.0
    assert report.totals.share_16bit("forward") == report.totals.share_16bit("backward") == 1.0
    assert not [h for h in report.hazards if h.kind != "emulated compute dtype"]
    # Shapes are enough: nothing is run.
    specs = jax.eval_shape(lambda: (state, tokens, jax.random.key(0)))
    assert precision_report(step, *specs) == report


def test_report_transformer_no_16bit_matmul_flops_under_float32():
    step, state, tokens, _ = _lm_step("float32")
    report = precision_report(step, state, tokens, jax.random.key(0))
    assert report.compute_dtype == "float32"
    assert report.totals.share_16bit() == 0.0
    assert sum(report.totals.matmul_flops.values()) > 0
    assert not [h for h in report.hazards if h.kind == "fp32 matmul"]  # float32 was asked for


def test_report_paths_are_the_flax_module_paths():
    step, state, tokens, params = _lm_step("mixed_bfloat16")
    report = precision_report(step, state, tokens, jax.random.key(0))
    modules = _module_paths(params)
    assert {r.path for r in report.rows} <= modules | {OUTSIDE}
    with_flops = {r.path for r in report.rows if r.flops and r.phase == "forward"}
    attention = "DecoderBlock_0/MultiHeadDotProductAttention_0"
    assert {f"{attention}/{n}" for n in ("query", "key", "value", "out")} <= with_flops
    assert {attention, "DecoderBlock_0/Dense_0", "DecoderBlock_0/Dense_1", "Embed_0"} <= with_flops
    assert {r.path for r in report.rows if r.phase == "backward" and r.flops} == with_flops


class _Proj(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(5, name="proj")(nn.LayerNorm()(x))


def test_report_dense_flops_are_2mkn_and_layernorm_is_fp32_by_the_normalization_rule():
    m, k, n = 3, 4, 5
    model = jamp.wrap(_Proj(), "mixed_bfloat16")
    x = jnp.ones((m, k))
    params = model.init(jax.random.key(0), x)["params"]
    loss = jax.value_and_grad(lambda p: model.apply({"params": p}, x).sum())
    report = precision_report(loss, params)
    forward = report.row("proj", "forward")
    assert forward.matmul_flops == {("dot", "bf16", "bf16", "f32", False): 2 * m * k * n}
    assert report.row("proj", "backward").flops == 2 * 2 * m * k * n  # d input and d kernel
    for phase in ("forward", "backward"):
        norm = report.row("LayerNorm_0", phase)
        assert set(norm.kept_fp32) == {"normalization"} and set(norm.elementwise) == {"f32"}
        assert norm.flops == 0


def test_report_forced_16bit_softmax_and_16bit_accumulation_are_hazards():
    a, b = jnp.ones((4, 64), BF16), jnp.ones((64, 8), BF16)
    report = precision_report(lambda a, b: jax.nn.softmax(jnp.dot(a, b)), a, b)
    kinds = {h.kind: h for h in report.hazards}
    assert "16-bit accumulation" in kinds and kinds["16-bit accumulation"].amount == 2 * 4 * 64 * 8
    assert "16-bit softmax" in kinds
    # The same product accumulated in float32 and softmaxed in float32 is clean.
    clean = precision_report(
        lambda a, b: jax.nn.softmax(jnp.dot(a, b, preferred_element_type=jnp.float32)), a, b
    )
    assert not [h for h in clean.hazards if h.kind.startswith("16-bit")]


def test_report_16bit_long_sum_and_normalization_statistics_are_hazards():
    x = jnp.ones((2, 4096), BF16)
    sums = precision_report(lambda x: jax.lax.reduce_sum(x, (1,)), x)
    assert [h.kind for h in sums.hazards if h.kind.startswith("16")] == ["16-bit reduction"]
    short = precision_report(lambda x: jax.lax.reduce_sum(x, (1,)), x[:, :64])
    assert not [h for h in short.hazards if h.kind.startswith("16")]  # 64 terms: fine in bf16
    norm = precision_report(lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True)), x)
    assert "16-bit normalization" in {h.kind for h in norm.hazards}


@jax.custom_vjp
def _tanh_matmul(x, w):
    return jnp.tanh(x @ w)


def _tanh_matmul_fwd(x, w):
    return _tanh_matmul(x, w), (x, w)


def _tanh_matmul_bwd(res, g):
    x, w = res
    gy = g * (1 - jnp.tanh(x @ w) ** 2)
    return gy @ w.T, x.T @ gy


_tanh_matmul.defvjp(_tanh_matmul_fwd, _tanh_matmul_bwd)


class _Custom(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(), (4, 4))
        x = _tanh_matmul(nn.Dense(4, name="pre")(x), w)
        return nn.Dense(4, name="head")(x)


def test_report_overrides_and_custom_derivative_rules():
    model = jamp.wrap(_Custom(), "mixed_bfloat16", {"head": "float32"})
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)["params"]
    report = precision_report(jax.grad(lambda p: model.apply({"params": p}, x).sum()), params)
    for phase in ("forward", "backward"):
        assert set(report.row("head", phase).kept_fp32_flops) == {"override head"}
        assert report.row("pre", phase).flops_16bit == report.row("pre", phase).flops
    # The custom-VJP function's matmuls run as written under differentiation: float32, flagged.
    fp32 = {(h.path, h.phase) for h in report.hazards if h.kind == "fp32 matmul"}
    assert fp32 == {("", "forward"), ("", "backward")}
    assert all("custom-derivative" in h.detail for h in report.hazards if h.kind == "fp32 matmul")
    assert "override head" in report.table() and "fp32 matmul" in report.table()


class _Block(nn.Module):
    @nn.compact
    def __call__(self, c, x):
        return nn.Dense(4)(c), None


class _Lifted(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = scan(name="blocks")(x, None)
        return nn.remat(nn.Dense)(4, name="tail")(x)


def test_report_paths_inside_scan_and_remat_and_scan_flops_count_every_step():
    model = jamp.wrap(_Lifted(), "mixed_bfloat16")
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)["params"]
    report = precision_report(jax.grad(lambda p: model.apply({"params": p}, x).sum()), params)
    paths = {r.path for r in report.rows if r.flops}
    assert paths == {"blocks/Dense_0", "tail"} <= _module_paths(params)
    assert report.row("blocks/Dense_0").flops == 3 * 2 * 2 * 4 * 4


def test_report_16bit_psum_in_a_shard_map_is_a_hazard():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
    f = jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P())
    report = precision_report(f, jnp.ones((8, 4), BF16))
    assert [h.kind for h in report.hazards if "collective" in h.kind] == ["16-bit collective"]
    assert report.totals.collective_bytes == {"psum bf16": 8}
    fp32 = precision_report(f, jnp.ones((8, 4), jnp.float32))
    assert not [h for h in fp32.hazards if "collective" in h.kind]


def _sharded_lm_step(policy):
    step, state, _, params = _lm_step(policy)
    mesh = jamp.sharding.make_mesh("fsdp=8")
    state = jamp.sharding.shard_state(state, mesh)
    sharded = jamp.sharding.make_sharded_train_step(
        step, mesh, jamp.sharding.state_shardings(state)
    )
    return sharded, state, jnp.zeros((8, 9), jnp.int32), params


def test_report_of_a_jitted_step_keeps_its_paths_when_jax_serves_a_cached_trace():
    sharded, state, batch, params = _sharded_lm_step("mixed_bfloat16")
    first = precision_report(sharded, state, batch, jax.random.key(0))
    assert precision_report(sharded, state, batch, jax.random.key(0)) == first
    # A new function around the same jitted step: nothing recorded, the names read as they are.
    again = precision_report(lambda *a: sharded(*a), state, batch, jax.random.key(0))
    assert {r.path for r in again.rows} == {r.path for r in first.rows}
    assert {r.path for r in first.rows} <= _module_paths(params) | {OUTSIDE}


def test_report_compiled_reads_the_partitioned_program_collectives():
    sharded, state, batch, _ = _sharded_lm_step("mixed_bfloat16,reduce=bf16")
    report = precision_report(sharded, state, batch, jax.random.key(0), compiled=True)
    summed = [h for h in report.hazards if h.kind == "16-bit collective"]
    assert summed and all("all-reduce" in h.detail or "reduce-scatter" in h.detail for h in summed)
    assert any(
        k.endswith(" bf16") and k.startswith("all-gather") for k in report.totals.collective_bytes
    )
    assert report.gemms and "compiled GEMMs" in report.table()


def test_report_hardware_line_and_emulated_compute_dtype(monkeypatch):
    from jamp import hardware

    step, state, tokens, _ = _lm_step("mixed_bfloat16")
    fake = hardware.Support(np.dtype(BF16), False, "cpu", "a CPU without avx512_bf16", "slow")
    monkeypatch.setattr(hardware, "support", lambda dtype, device=None: fake)
    report = precision_report(step, state, tokens, jax.random.key(0))
    assert "emulated" in report.hardware and "a CPU without avx512_bf16" in report.hardware
    assert [h.kind for h in report.hazards] == ["emulated compute dtype"]


# A GPU program as XLA:GPU compiles a jamp-wrapped Dense layer's train step (abridged): the
# forward GEMM a cuBLASLt call, the backward's weight gradient a Triton GEMM fusion. Newer XLA
# prints operands by name only; older XLA prints their types too (both are read).
_GPU_HLO = r"""
HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(f32[8,16]{1,0}, f32[4,8]{1,0})->f32[8,16]{1,0}}, frontend_attributes={fingerprint_before_lhs="9f1c0e"}

%fused_convert (param_0.1: f32[8,16]) -> bf16[8,16] {
  %param_0.1 = f32[8,16]{1,0} parameter(0)
  ROOT %convert.5.1 = bf16[8,16]{1,0} convert(%param_0.1), metadata={op_name="jit(train_step)/jit(main)/jvp(Wrapped.apply)/_Proj/proj/convert_element_type" source_file="/home/user/jamp/jamp/mixed_ops.py" source_line=53}
}

%gemm_fusion_dot_general.3_computation (parameter_0: bf16[4,8], parameter_1: bf16[4,16]) -> f32[8,16] {
  %parameter_0 = bf16[4,8]{1,0} parameter(0)
  %parameter_1 = bf16[4,16]{1,0} parameter(1)
  ROOT %dot_general.3 = f32[8,16]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/jit(main)/transpose(jvp(Wrapped.apply))/_Proj/proj/dot_general" source_file="/home/user/jamp/jamp/mixed_ops.py" source_line=131}
}

ENTRY %main.52 (Arg_0.1: f32[8,16], Arg_1.2: f32[4,8]) -> f32[8,16] {
  %Arg_0.1 = f32[8,16]{1,0} parameter(0), metadata={op_name="params[\'proj\'][\'kernel\']"}
  %Arg_1.2 = f32[4,8]{1,0} parameter(1), metadata={op_name="x"}
  %convert_fusion = bf16[8,16]{1,0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_convert
  %convert.2 = bf16[4,8]{1,0} convert(%Arg_1.2), metadata={op_name="jit(train_step)/jit(main)/jvp(Wrapped.apply)/_Proj/proj/convert_element_type"}
  %cublas-gemm.1 = (f32[4,16]{1,0}, s8[4194304]{0}) custom-call(%convert.2, %convert_fusion), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jit(main)/jvp(Wrapped.apply)/_Proj/proj/dot_general" source_file="/home/user/jamp/jamp/mixed_ops.py" source_line=131}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{"alpha_real":1,"alpha_imag":0,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"precision_config":{"operand_precision":["DEFAULT","DEFAULT"],"algorithm":"ALG_UNSET"},"epilogue":"DEFAULT","lhs_stride":"32","rhs_stride":"128","grad_x":false,"grad_y":false,"damax_output":false},"force_earliest_schedule":false}
  %get-tuple-element.1 = f32[4,16]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  %bitcast.5 = bf16[4,16]{1,0} bitcast(%get-tuple-element.1)
  ROOT %gemm_fusion_dot_general.3 = f32[8,16]{1,0} fusion(%convert.2, %bitcast.5), kind=kCustom, calls=%gemm_fusion_dot_general.3_computation, metadata={op_name="jit(train_step)/jit(main)/transpose(jvp(Wrapped.apply))/_Proj/proj/dot_general"}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16","block_n":"16","block_k":"32","split_k":"1","num_stages":"1","num_warps":"2","num_ctas":"1"}},"force_earliest_schedule":false}
}
"""
# The forward GEMM as a GPU without bf16 tensor cores gets it: XLA widened the operands (older
# XLA's typed-operand spelling).
_FP32_GEMM = (
    "%cublas-gemm.1 = (f32[4,16]{1,0}, s8[4194304]{0}) custom-call(f32[4,8]{1,0} %Arg_1.2, "
    'f32[8,16]{1,0} %Arg_0.1), custom_call_target="__cublas$gemm", metadata={op_name="jit('
    'train_step)/jit(main)/jvp(Wrapped.apply)/_Proj/proj/dot_general"}'
)


def test_compiled_gemms_reads_cublas_calls_and_triton_fusions():
    gemms = hlo.gemms(hlo.parse(_GPU_HLO))
    assert [(g.kind, g.operands, g.result, g.flops) for g in gemms] == [
        ("cuBLASLt", ("bf16", "bf16"), "f32", 2 * 4 * 16 * 8),
        ("Triton", ("bf16", "bf16"), "f32", 2 * 8 * 16 * 4),
    ]
    assert _paths.op_name_path(gemms[0].op_name) == ("proj", False)
    assert _paths.op_name_path(gemms[1].op_name) == ("proj", True)


def test_compiled_hazards_flag_an_fp32_gemm_where_the_jaxpr_asked_for_bf16():
    model = jamp.wrap(_Proj(), "mixed_bfloat16")
    x = jnp.ones((4, 8))
    params = model.init(jax.random.key(0), x)["params"]
    report = precision_report(jax.grad(lambda p: model.apply({"params": p}, x).sum()), params)
    assert compiled_hazards(report, _GPU_HLO) == []
    lines = [_FP32_GEMM if "%cublas-gemm.1 =" in ln else ln for ln in _GPU_HLO.splitlines()]
    (hazard,) = compiled_hazards(report, "\n".join(lines))
    assert (hazard.kind, hazard.path, hazard.phase) == (
        "fp32 GEMM in compiled HLO",
        "proj",
        "forward",
    )
    assert "f32*f32" in hazard.detail and "bfloat16" in hazard.detail


@pytest.mark.parametrize(
    "stack, path, backward",
    [
        (
            "jvp(Wrapped.apply)/TransformerLM/DecoderBlock_0/Dense_0",
            "DecoderBlock_0/Dense_0",
            False,
        ),
        ("transpose(jvp(Wrapped.apply))/TransformerLM/Embed_0.attend", "Embed_0", True),
        (
            "Wrapped.apply/M/DecoderBlock_0/LayerNorm_0/jamp_policy_3_",
            "DecoderBlock_0/LayerNorm_0",
            False,
        ),
        ("Wrapped.apply/M/MHA_0/...qhd,...khd->...hqk", "MHA_0", False),
        ("transpose(jvp(Wrapped.apply))/M/M.extra/head", "head", True),
        ("jvp(Wrapped.apply)/M/vmap(vd)", "vd", False),
        ("jvp(outer/inner)/leaf", "outer/inner/leaf", False),
        (  # a 16-bit bias's gradient, summed by jamp's engine (jamp.scopes.SUM_SCOPE)
            "transpose(jvp(Wrapped.apply))/M/Block_0/MHA_0/value/jamp_broadcast_sum",
            "Block_0/MHA_0/value",
            True,
        ),
    ],
)
def test_paths_module_path_strips_transforms_roots_and_tags(stack, path, backward):
    assert _paths.module_path(stack) == path
    assert _paths.is_backward(stack) == backward


def test_paths_policy_tag():
    assert _paths.policy_tag("Wrapped.apply/M/LayerNorm_0/jamp_policy_3_") == 3
    assert _paths.policy_tag("Wrapped.apply/M/Dense_0") is None


def _nnx_lm_step(policy):
    """A tiny wrapped NNX Transformer LM's train step (through `jamp.nnx.split`), state, batch."""
    from flax import nnx

    from jamp.models.nnx_models import TransformerLM as NnxLM

    model = jamp.wrap(
        NnxLM(32, num_layers=2, d_model=16, num_heads=2, mlp_dim=32, max_len=8, rngs=nnx.Rngs(0)),
        policy,
    )
    functional, params, model_state = jamp.nnx.split(model)

    def loss(model, batch):
        logits = model(batch[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return loss, {}

    tx = optax.adam(1e-3)
    state = jamp.TrainState.create(
        params, tx, model_state=model_state, loss_scale=jamp.loss_scale_for(policy)
    )
    tokens = jnp.zeros((2, 9), jnp.int32)
    return jamp.make_train_step(functional.loss_fn(loss), tx), state, tokens, params


def test_report_splits_a_wrapped_nnx_model_by_its_attribute_paths():
    step, state, tokens, params = _nnx_lm_step("mixed_bfloat16")
    report = precision_report(step, state, tokens, jax.random.key(0))
    # NNX's own spelling of the paths: list items by index ("blocks/0/attention").
    assert {r.path for r in report.rows} <= _module_paths(params) | {OUTSIDE}
    with_flops = {r.path for r in report.rows if r.flops and r.phase == "forward"}
    for block in ("blocks/0", "blocks/1"):
        attention = f"{block}/attention"
        assert {f"{attention}/{n}" for n in ("query", "key", "value", "out")} <= with_flops
        assert {attention, f"{block}/mlp_in", f"{block}/mlp_out"} <= with_flops
    assert "embed" in with_flops  # the tied output projection, `embed.attend`
    assert report.row("", "forward") is not None  # the model's own operations (embedding sum)
    assert {r.path for r in report.rows if r.phase == "backward" and r.flops} == with_flops
    # The wrapped model's settings reach the report: its norms are named by their rule.
    norm = report.row("blocks/1/norm2")
    assert norm is not None and set(norm.kept_fp32) == {"normalization"}
    assert report.compute_dtype == "bfloat16"
    # The compiled program's GEMMs carry the same paths in their HLO op names.
    text = jax.jit(step).lower(state, tokens, jax.random.key(0)).compile().as_text()
    compiled = {_paths.op_name_path(g.op_name)[0] for g in hlo.gemms(hlo.parse(text))}
    assert {"blocks/0/mlp_in", "blocks/1/attention/query", "embed"} <= compiled


def test_report_paths_of_a_stack_reentered_as_one_scope():
    # jamp.autocast re-enters an equation's whole name stack as one scope: under a transform,
    # several NNX scopes in one name; the innermost is the path.
    stack = "jvp(jamp_nnx(blocks.0)/jamp_nnx(blocks.0.attention)/jamp_nnx(blocks.0.attention.key))"
    assert _paths.module_path(stack) == "blocks/0/attention/key"
    assert _paths.module_path(f"transpose({stack})/jamp_policy_1_") == "blocks/0/attention/key"
    assert [n.text for n in _paths.names("jvp(a(x)/b(y))")] == ["x", "y"]  # no endless split


def test_report_names_logits_formed_whole_and_not_the_chunked_loss():
    """A loss over an 8192-word vocabulary of 2048 positions forms its logits whole: the report
    says so and names the chunked loss, which forms none (its chunks run in a loop)."""
    from jamp import losses

    model = jamp.wrap(
        TransformerLM(8192, num_layers=1, d_model=32, num_heads=2, mlp_dim=64, max_len=256),
        "mixed_bfloat16",
    )
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    tokens = jax.ShapeDtypeStruct((8, 257), jnp.int32)

    def optax_loss(p, t):
        logits = model.apply(p, t[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

    def chunked(p, t):
        hidden = model.apply(p, t[:, :-1], return_hidden=True)
        kernel = TransformerLM.output_kernel(p["params"])
        return losses.fused_linear_cross_entropy(hidden, kernel, t[:, 1:], chunk_size=512)

    found = [h for h in precision_report(jax.grad(optax_loss), params, tokens).hazards]
    (hazard,) = [h for h in found if h.kind == "logits formed"]
    assert "[8, 256, 8192]" in hazard.detail and "fused_linear_cross_entropy" in hazard.detail
    assert "logits formed" in precision_report(jax.grad(optax_loss), params, tokens).table()
    report = precision_report(jax.grad(chunked), params, tokens)
    assert not [h for h in report.hazards if h.kind == "logits formed"]


def test_report_names_float32_logits_kept_for_the_backward_and_what_they_cost():
    """A train step whose loss keeps float32 logits for the backward is named, with the bytes:
    a loss jamp's recomputed tail does not take (one computed in a loop over the batch, after
    the 16-bit logits are widened), and any loss where the logits are float32 to begin with. HF's
    shifted logits on 16-bit logits (activations in the compute dtype) keep none: no hazard."""
    import optax

    from jamp.models.transformer import TransformerLM

    vocab, batch, length = 8192, 16, 256  # 16 x 255 x 8192 logits: 0.12 GiB in float32
    tx = optax.adamw(1e-3)
    tokens = {"tokens": jax.ShapeDtypeStruct((batch, length + 1), jnp.int32)}
    key = jax.eval_shape(lambda: jax.random.key(0))

    def hf_form(logits, t):
        target = jax.nn.one_hot(t[:, 1:], vocab)
        return optax.softmax_cross_entropy(logits[:, :-1], target).mean()

    def in_a_loop(logits, t):  # per sequence, in lax.map: a loop jamp does not recompute
        per = jax.lax.map(lambda a: hf_form(a[0][None], a[1][None]), (logits, t))
        return per.mean()

    def kept(activations, loss):
        lm = TransformerLM(vocab, num_layers=1, d_model=64, num_heads=2, mlp_dim=128)
        model = jamp.wrap(lm, "mixed_bfloat16", activations=activations)
        params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        state = jax.eval_shape(lambda: jamp.TrainState.create(params["params"], tx))

        def loss_fn(p, model_state, b, rng):
            t = b["tokens"][:, :-1]
            return loss(model.apply({"params": p}, t), t), (model_state, {})

        report = precision_report(jamp.make_train_step(loss_fn, tx), state, tokens, key)
        return [h for h in report.hazards if h.kind == "float32 logits kept"]

    assert kept("compute", hf_form) == []
    (hazard,) = kept("compute", in_a_loop)
    assert hazard.amount == batch * (length - 1) * vocab * 4 and "0.12 GiB" in hazard.detail
    assert "not recomputed in this form" in hazard.detail
    (hazard,) = kept("float32", hf_form)  # (CPU's activations: a float32 head)
    assert "the logits are float32 here" in hazard.detail


def test_report_takes_an_nnx_model_as_users_hold_it():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(8, 16, rngs=rngs)
            self.head = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.hidden(x)))

    model = jamp.wrap(Net(nnx.Rngs(0)), "mixed_bfloat16")
    x = jnp.ones((2, 8))
    report = precision_report(model, x)
    assert report.compute_dtype == "bfloat16"
    assert {r.path for r in report.rows if r.flops_16bit} == {"hidden", "head"}
    assert report.row("hidden").matmul_flops and report.totals.share_16bit() == 1.0


def test_name_stack_with_a_slash_inside_a_scope_name_is_one_name():
    """A scope name holding a slash inside parentheses that do not wrap it whole (seen in a
    sharded Llama step's op names) is read as one name; it recursed without end before."""
    assert _paths.names("jit(f)/jvp(a(b/c)d)/e") == [
        _paths.Name("f", ("jit",)),
        _paths.Name("a(b/c)d", ("jvp",)),
        _paths.Name("e", ()),
    ]
    assert _paths.names("x(a/b") == [_paths.Name("x(a/b", ())]
    assert _paths.names("transpose(jvp(A))/B") == [
        _paths.Name("A", ("jvp", "transpose")),
        _paths.Name("B", ()),
    ]
