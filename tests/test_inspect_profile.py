"""jamp.inspect.profile: device time per module path and dtype class, from profiler traces.

Canned traces (XSpace text protos) pin down how events are read and counted on GPUs and on
XLA:CPU; real profiles of a small wrapped MLP on this CPU check the whole path, including the
bound on how far the shares may fall short of the measured step time.
"""

import struct

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp import parallel
from jamp.inspect import profile as profile_lib
from jamp.inspect._profile_hlo import HloOps, Op, module_path
from jamp.inspect._profile_trace import attribute, profile_data

# ----- canned traces


def _xspace(planes: dict) -> str:
    """An XSpace text proto: {plane: {line: [(event, start_ns, duration_ns, {stat: value})]}}."""
    out = []
    for plane_id, (plane, lines) in enumerate(planes.items(), 1):
        stat_ids, event_ids, body = {}, {}, []
        for line_id, (line, events) in enumerate(lines.items(), 1):
            items = []
            for name, start, duration, stats in events:
                event_id = event_ids.setdefault(name, len(event_ids) + 1)
                values = []
                for key, value in stats.items():
                    sid = stat_ids.setdefault(key, len(stat_ids) + 1)
                    v = (
                        f'str_value: "{value}"'
                        if isinstance(value, str)
                        else f"int64_value: {value}"
                    )
                    values.append(f"stats {{ metadata_id: {sid} {v} }}")
                items.append(
                    f"events {{ metadata_id: {event_id} offset_ps: {start * 1000} "
                    f"duration_ps: {duration * 1000} {' '.join(values)} }}"
                )
            body.append(
                f'lines {{ id: {line_id} name: "{line}" timestamp_ns: 0 {" ".join(items)} }}'
            )
        meta = [
            f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}'
            for n, i in event_ids.items()
        ]
        meta += [
            f'stat_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}'
            for n, i in stat_ids.items()
        ]
        out.append(f'planes {{ id: {plane_id} name: "{plane}" {" ".join(body)} {" ".join(meta)} }}')
    return "\n".join(out)


_MODEL = 'op_name="jit(train_step)/jvp(Wrapped.apply)/MLP'
# What XLA:GPU makes of a small step: a Triton GEMM (a fusion holding a bf16 dot), a bf16 loop
# fusion, an fp32 cuBLAS GEMM, a cuDNN convolution, an async all-reduce and an fp32 update.
GPU_HLO = f"""HloModule jit_train_step, entry_computation_layout={{()->()}}

%triton_gemm_computation (p0: bf16[64,128], p1: bf16[128,256]) -> f32[64,256] {{
  %p0 = bf16[64,128]{{1,0}} parameter(0)
  %p1 = bf16[128,256]{{1,0}} parameter(1)
  ROOT %dot.1 = f32[64,256]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{{_MODEL}/Dense_0/dot_general"}}
}}

%fused_gelu (p0.1: bf16[64,256]) -> bf16[64,256] {{
  %p0.1 = bf16[64,256]{{1,0}} parameter(0)
  %tanh.1 = bf16[64,256]{{1,0}} tanh(%p0.1), metadata={{{_MODEL}/tanh"}}
  ROOT %multiply.1 = bf16[64,256]{{1,0}} multiply(%p0.1, %tanh.1), metadata={{{_MODEL}/mul"}}
}}

%fused_update (p0.2: f32[256], p1.2: f32[256]) -> f32[256] {{
  %p0.2 = f32[256]{{0}} parameter(0)
  %p1.2 = f32[256]{{0}} parameter(1)
  ROOT %subtract.2 = f32[256]{{0}} subtract(%p0.2, %p1.2), metadata={{op_name="jit(train_step)/sub"}}
}}

%add_f32 (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.3 = f32[] add(%a, %b)
}}

ENTRY %main.10 (x: bf16[64,128], w: bf16[128,256], h: f32[64,256], w2: f32[256,10], v: f32[256], img: bf16[8,32,32,3], k: bf16[3,3,3,16]) -> f32[256] {{
  %x = bf16[64,128]{{1,0}} parameter(0), metadata={{op_name="x"}}
  %w = bf16[128,256]{{1,0}} parameter(1)
  %h = f32[64,256]{{1,0}} parameter(2)
  %w2 = f32[256,10]{{1,0}} parameter(3)
  %v = f32[256]{{0}} parameter(4)
  %img = bf16[8,32,32,3]{{3,2,1,0}} parameter(5)
  %k = bf16[3,3,3,16]{{3,2,1,0}} parameter(6)
  %gemm_fusion = f32[64,256]{{1,0}} fusion(%x, %w), kind=kCustom, calls=%triton_gemm_computation, metadata={{{_MODEL}/Dense_0/dot_general"}}, backend_config={{"fusion_backend_config":{{"kind":"__triton_gemm"}}}}
  %convert.5 = bf16[64,256]{{1,0}} convert(%gemm_fusion), metadata={{{_MODEL}/Dense_0/convert_element_type"}}
  %loop_fusion = bf16[64,256]{{1,0}} fusion(%convert.5), kind=kLoop, calls=%fused_gelu, metadata={{{_MODEL}/mul"}}
  %custom-call.1 = (f32[64,10]{{1,0}}, s8[4194304]{{0}}) custom-call(%h, %w2), custom_call_target="__cublas$gemm", metadata={{{_MODEL}/Dense_1/dot_general"}}
  %cudnn-conv = (bf16[8,32,32,16]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%img, %k), window={{size=3x3 pad=1_1x1_1}}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convForward", metadata={{{_MODEL}/Conv_0/conv_general_dilated"}}
  %all-reduce-start = f32[256]{{0}} all-reduce-start(%v), replica_groups={{}}, to_apply=%add_f32, metadata={{op_name="jit(train_step)/psum"}}
  %all-reduce-done = f32[256]{{0}} all-reduce-done(%all-reduce-start), metadata={{op_name="jit(train_step)/psum"}}
  ROOT %fusion.7 = f32[256]{{0}} fusion(%v, %all-reduce-done), kind=kLoop, calls=%fused_update, metadata={{op_name="jit(train_step)/sub"}}
}}
"""


def _kernel(op, start, duration, module="jit_train_step"):
    return (f"kernel_{op}", start, duration, {"hlo_op": op, "hlo_module": module, "program_id": 7})


def _gpu_plane(shift):
    compute = [
        _kernel("gemm_fusion", shift + 0, 400),
        _kernel("loop_fusion", shift + 400, 100),
        _kernel("custom-call.1", shift + 500, 100),  # one HLO op, two kernels
        _kernel("custom-call.1", shift + 600, 100),
        _kernel("cudnn-conv", shift + 700, 200),
        _kernel("fusion.7", shift + 1000, 100),
        _kernel("fusion.3", shift + 1100, 50, module="jit_other"),  # another program
        ("MemcpyH2D", shift + 1150, 50, {}),  # no HLO op: not the step's work
    ]
    return {
        "Stream #7(Kernel,MemcpyH2D)": compute,
        # The all-reduce overlaps the convolution for 100 ns: only the rest is exposed.
        "Stream #20(Kernel)": [_kernel("all-reduce-start", shift + 800, 200)],
        "XLA Ops": compute,  # derived from the streams: must not count twice
    }


def test_profile_gpu_trace_counts_kernels_on_stream_lines():
    space = profile_data().from_text_proto(
        _xspace(
            {
                # The host's thunk launches carry hlo_op too: not device time.
                "/host:CPU": {"tf_Thunk/1": [_kernel("gemm_fusion", 0, 5000)]},
                "/device:GPU:0": _gpu_plane(0),
                "/device:GPU:1": _gpu_plane(40),
            }
        )
    )
    prof = profile_lib.analyze_trace(space, GPU_HLO, num_steps=1, step_seconds=1250e-9)
    got = {(r.module, r.op_class): round(r.seconds * 1e9) for r in prof.rows}
    assert got == {
        ("Dense_0", "matmul 16-bit"): 400,
        ("Dense_1", "matmul fp32"): 200,
        ("Conv_0", "convolution"): 200,
        ("(MLP)", "elementwise 16-bit"): 100,
        ("(update)", "collective"): 100,
        ("(update)", "elementwise 32-bit"): 100,
    }
    assert prof.source == "2 device timeline(s)"
    assert prof.attributed_fraction == pytest.approx(1100 / 1250)
    assert prof.other_programs_seconds == pytest.approx(50e-9)
    assert "shares add up to 88.0 % of the measured step time" in prof.table()


CPU_HLO = """HloModule jit_step, entry_computation_layout={()->()}

%fused_computation (param_0: f32[16,16]) -> f32[16,16] {
  %param_0 = f32[16,16]{1,0} parameter(0)
  ROOT %tanh.0 = f32[16,16]{1,0} tanh(%param_0), metadata={op_name="jit(step)/jvp(Wrapped.apply)/Net/Dense_1/tanh"}
}

ENTRY %main (a: f32[16,16], b: f32[16,16]) -> f32[16,16] {
  %a = f32[16,16]{1,0} parameter(0)
  %b = f32[16,16]{1,0} parameter(1)
  %dot.1 = f32[16,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(Wrapped.apply)/Net/Dense_0/dot_general"}
  ROOT %fusion.2 = f32[16,16]{1,0} fusion(%dot.1), kind=kLoop, calls=%fused_computation
}
"""


def test_profile_cpu_trace_async_thunk_lasts_until_its_completion():
    # XLA:CPU: an Eigen matmul's thunk event ends when its work is handed to the thread pool;
    # its "end:" event (same flow id) marks when it finished. The fusion overlaps it.
    thunk = {"hlo_module": "jit_step", "_pt": 0}
    space = profile_data().from_text_proto(
        _xspace(
            {
                "/host:CPU": {
                    "python": [("PjitFunction(step)", 0, 100, {})],
                    "tf_XLAExecute/1": [
                        ("dot.1", 0, 10, {"hlo_op": "dot.1", **thunk, "_p": 5}),
                        ("fusion.2", 20, 20, {"hlo_op": "fusion.2", **thunk, "_p": 6}),
                    ],
                    "tf_XLAEigen/2": [("end: dot.1", 90, 1, {"_ct": 0, "_c": 5})],
                }
            }
        )
    )
    prof = profile_lib.analyze_trace(space, CPU_HLO, num_steps=1, step_seconds=100e-9)
    got = {(r.module, r.op_class): round(r.seconds * 1e9) for r in prof.rows}
    # dot alone 0-20, shared 20-40, alone 40-91; the fusion is named by its body.
    assert got == {("Dense_0", "matmul fp32"): 81, ("Dense_1", "elementwise 32-bit"): 10}
    assert prof.source == "the host's threads (XLA:CPU)"


def test_profile_attribute_splits_overlaps_and_hides_collectives_under_compute():
    events = [(0, 4, 0, "a"), (2, 6, 0, "b"), (0, 8, 1, "ar"), (0, 10, 2, "while")]
    assert attribute(events) == {"a": 3.0, "b": 3.0, "ar": 2.0, "while": 2.0}
    assert attribute([]) == {}


def test_profile_hlo_classes_and_module_paths():
    ops = HloOps(GPU_HLO)
    assert ops.module_name == "jit_train_step"
    assert (ops.op("gemm_fusion").op_class, ops.op("gemm_fusion").module) == (
        "matmul 16-bit",
        "Dense_0",
    )
    assert ops.op("custom-call.1").op_class == "matmul fp32"
    assert ops.op("cudnn-conv").op_class == "convolution"
    assert ops.op("loop_fusion").op_class == "elementwise 16-bit"
    assert ops.op("fusion.7").op_class == "elementwise 32-bit"
    assert ops.op("all-reduce-start").op_class == "collective"
    assert ops.op("all-reduce-start").tier == 1 and ops.op("all-reduce-done").tier == 2
    assert ops.op("nonexistent").module == "(unmatched)"


@pytest.mark.parametrize(
    "op_name, path",
    [
        (
            "jit(s)/transpose(jvp(Wrapped.apply))/LM/Block_0/LayerNorm_0/jamp_policy_1_/mul",
            "Block_0/LayerNorm_0",
        ),
        (
            "jit(s)/jvp(Wrapped.apply)/LM/Block_0/Attn_0/...qhd,...khd->...hqk/dot_general",
            "Block_0/Attn_0",
        ),
        ("jit(s)/jvp(Wrapped.apply)/LM/Embed_0.attend/dot_general", "Embed_0"),
        ("jit(s)/jvp(Wrapped.apply)/SeedCNN/jit(relu)/max", "(SeedCNN)"),
        (  # a jamp.wrapped NNX model's submodule: the scope holds its attribute path
            "jit(s)/transpose(jvp(jamp_nnx_root(LM)))/jamp_nnx(blocks.0)/jamp_nnx(blocks.0.mlp_in)/"
            "dot_general",
            "blocks/0/mlp_in",
        ),
        (  # a whole stack re-entered as one scope (jamp.autocast)
            "jit(s)/jvp(jamp_nnx_root(LM)/jamp_nnx(blocks.1)/jamp_nnx(blocks.1.norm2))/"
            "jamp_policy_1_/mul",
            "blocks/1/norm2",
        ),
        ("jit(s)/jvp(jamp_nnx_root(SeedCNN))/jit(relu)/max", "(SeedCNN)"),  # its own operations
        (
            "jit(_fun)/shard_map/transpose(jvp(Wrapped.apply))/SeedCNN/Dense_0/dot_general",
            "Dense_0",
        ),
        ("jit(_fun)/shard_map/jvp()/log", "(loss)"),
        ("jit(_fun)/shard_map/psum", "(update)"),
        ("jit(s)/while/body/sqrt", "(update)"),
        ("", "(unnamed)"),
    ],
)
def test_profile_module_path_from_op_names(op_name, path):
    assert module_path(op_name) == path


# ----- real profiles on this CPU


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        del train
        return nn.Dense(10)(nn.relu(nn.Dense(512)(x)))


def _setup(policy, batch_size=256):
    model = jamp.wrap(MLP(), policy)
    params = model.init(jax.random.key(0), jnp.zeros((1, 256)))["params"]
    tx = optax.adam(1e-3)
    state = jamp.TrainState.create(params, tx, loss_scale=jamp.loss_scale_for(policy))

    def loss_fn(params, model_state, batch, rng):
        del rng
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (model_state, {})

    rng = np.random.default_rng(0)
    batch = {
        "x": rng.standard_normal((batch_size, 256)).astype(np.float32),
        "y": rng.integers(0, 10, batch_size).astype(np.int32),
    }
    return loss_fn, tx, state, batch


# How far the shares may fall short of the step time. By construction they never exceed it (no
# instant counts twice, and every event lies inside the timed window); what is missing is time
# in which no op of the step ran: Python dispatch between steps and, on a shared machine, the
# scheduler running other work between two thunks. Measured on this 2-core machine at load ~3
# (other engineers' tests): 0.81-0.93 for the jitted MLP, 0.88-0.96 pmapped over 8 virtual
# devices; with two more busy processes single profiles fell to 0.3-0.97. So each test takes the
# best of a few profiles: a reader that loses events (the Eigen pool's matmul work, say: see the
# async test) is low every time, an unlucky time slice only once.
MIN_FRACTION, ATTEMPTS = 0.6, 3


def _best_of(run):
    """Profiles with `run()` until the shares reach MIN_FRACTION (at most ATTEMPTS times)."""
    for _ in range(ATTEMPTS):
        prof = run()
        if prof.attributed_fraction >= MIN_FRACTION:
            break
    return prof


@pytest.mark.parametrize(
    "policy, matmul, other_matmul",
    [
        ("mixed_bfloat16", "matmul 16-bit", "matmul fp32"),
        ("float32", "matmul fp32", "matmul 16-bit"),
    ],
)
def test_profile_steps_dense_matmuls_carry_the_policy_dtype(policy, matmul, other_matmul, tmp_path):
    loss_fn, tx, state, batch = _setup(policy, batch_size=1024)
    step = jax.jit(jamp.make_train_step(loss_fn, tx), donate_argnums=(0,))
    if policy != "float32" and not _runs_16_bit_dots(step, state, batch):
        # XLA:CPU widened the bf16 dots on this CPU: the profile reports what ran.
        matmul, other_matmul = other_matmul, matmul
    drawn = []

    def batches():
        while True:
            drawn.append(1)
            yield batch

    out = {"state": state}

    def run():
        out["state"], prof = profile_lib.profile_steps(
            step, out["state"], batches(), 8, rng=jax.random.key(1), logdir=tmp_path / "trace"
        )
        return prof

    prof = run()
    assert int(out["state"].step) == 9 and len(drawn) == 9  # one warm-up step, one batch a step
    if prof.attributed_fraction < MIN_FRACTION:
        prof = _best_of(run)
    assert all(r.seconds >= 0 and r.op_class in profile_lib.CLASSES for r in prof.rows)
    assert {r.module for r in prof.rows if r.op_class == matmul} == {"Dense_0", "Dense_1"}
    assert not [r for r in prof.rows if r.op_class == other_matmul and "Dense" in r.module]
    assert {r.top_level for r in prof.rows} <= {
        "Dense_0",
        "Dense_1",
        "(MLP)",
        "(loss)",
        "(update)",
        "(unnamed)",
    }
    assert MIN_FRACTION <= prof.attributed_fraction <= 1.02, prof.table()
    assert sum(prof.by_class().values()) == pytest.approx(prof.attributed_seconds)
    assert prof.gap_line() in prof.table()
    paths = prof.save(tmp_path)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", paths["png"].read_bytes()[16:24])[0] > 100  # a real picture
    assert "module path" in paths["txt"].read_text()
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))  # the trace is kept in logdir


def _runs_16_bit_dots(step, *args) -> bool:
    """Whether the compiled program (not the jaxpr) has matmuls with 16-bit operands."""
    ops = HloOps(step.lower(*args, jax.random.key(1)).compile().as_text())
    return any(ops.op(name).op_class == "matmul 16-bit" for name in ops._instrs)


def test_profile_steps_pmapped_step_counts_its_all_reduce():
    loss_fn, tx, state, batch = _setup("mixed_bfloat16", batch_size=8 * 32)
    p_step = parallel.make_p_train_step(
        jamp.make_train_step(loss_fn, tx, axis_name=parallel.AXIS_NAME)
    )
    state = parallel.replicate(state)
    placed = parallel.shard(batch)
    out = {"state": state}

    def run():
        out["state"], prof = profile_lib.profile_steps(
            p_step, out["state"], iter(lambda: placed, None), 4, rng=jax.random.key(1)
        )
        return prof

    ran = "matmul 16-bit" if _runs_16_bit_dots(p_step, state, placed) else "matmul fp32"
    prof = _best_of(run)
    assert ("(update)", "collective") in {(r.module, r.op_class) for r in prof.rows}
    assert {r.module for r in prof.rows if r.op_class == ran} == {"Dense_0", "Dense_1"}
    assert MIN_FRACTION <= prof.attributed_fraction <= 1.02, prof.table()


def test_profile_steps_nnx_jit_step_updates_the_model_in_place():
    """An NNX user's own step (`@nnx.jit def train_step(model, optimizer, batch)`, returning the
    loss) profiled with the objects as the state: the model is trained in place, each step's
    batch drawn once, the matmuls found per NNX attribute path."""
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(256, 512, rngs=rngs)
            self.out = nnx.Linear(512, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(x)))

    model = jamp.wrap(Mlp(nnx.Rngs(0)), "mixed_bfloat16")
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        def loss_fn(m):
            logits = m(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    _, _, _, batch = _setup("float32", batch_size=1024)
    before = np.asarray(model.hidden.kernel[...])
    drawn = []

    def batches():
        while True:
            drawn.append(1)
            yield batch

    def run():
        state, prof = profile_lib.profile_steps(train_step, (model, optimizer), batches(), 4)
        assert state[0] is model and state[1] is optimizer
        return prof

    prof = _best_of(run)
    assert len(drawn) >= 5 and int(optimizer.step[...]) == len(drawn)
    assert not np.array_equal(before, np.asarray(model.hidden.kernel[...]))
    matmuls = {r.module for r in prof.rows if r.op_class.startswith("matmul")}
    assert matmuls == {"hidden", "out"}, prof.table()
    assert MIN_FRACTION <= prof.attributed_fraction <= 1.02, prof.table()


def test_profile_hlo_unnamed_instruction_takes_its_neighbours_module():
    # XLA:CPU rewrites an fp16 convolution in fp32 and drops its name stack; the convert of its
    # result back (jamp's cast in the same module) names it.
    ops = HloOps(
        """HloModule jit_s

ENTRY %main (a: f32[8,8,8,64], b: f32[3,3,64,32]) -> f16[8,8,8,32] {
  %a = f32[8,8,8,64]{3,2,1,0} parameter(0), metadata={op_name="state.params"}
  %b = f32[3,3,64,32]{3,2,1,0} parameter(1)
  %convolution.4 = f32[8,8,8,32]{3,2,1,0} convolution(%a, %b), window={size=3x3}, dim_labels=b01f_01io->b01f
  ROOT %convert.1 = f16[8,8,8,32]{3,2,1,0} convert(%convolution.4), metadata={op_name="jit(s)/transpose(jvp(Wrapped.apply))/CNN/Conv_1/convert_element_type"}
}
"""
    )
    assert ops.op("convolution.4") == Op("convolution", "Conv_1", 0)
    assert ops.op("convert.1").op_class == "elementwise 16-bit"
