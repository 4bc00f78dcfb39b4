"""jamp.hlo.kernels and jamp.inspect.timing: a compiled program's kernels and its predicted time.

The reading rules on small HLO texts (no compile); the kernels of real H200 programs where JAX's
CUDA plugin is installed; and the train step's own kernels against a plain step's.
"""

import pytest

from jamp import hlo
from jamp import target as target_lib
from jamp.hlo.kernels import kernels
from jamp.inspect import gemm_rate, timing

H200 = target_lib.GPUS["h200"]

_PROGRAM = """HloModule jit_step

%fused_dot (p0: bf16[64,32], p1: bf16[32,128]) -> bf16[64,128] {
  %p0_fused_dot = bf16[64,32]{1,0} parameter(0)
  %p1_fused_dot = bf16[32,128]{1,0} parameter(1)
  ROOT %dot.3 = bf16[64,128]{1,0} dot(%p0_fused_dot, %p1_fused_dot), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_slice (p0: f32[4,1024]) -> f32[1024] {
  %p0_fused_slice = f32[4,1024]{1,0} parameter(0)
  %s_fused_slice = f32[1,1024]{1,0} slice(%p0_fused_slice), slice={[2:3], [0:1024]}
  ROOT %b_fused_slice = f32[1024]{0} bitcast(%s_fused_slice)
}

%fused_update (p0: f32[1000,256], p1: f32[1,256], p2: s32[]) -> f32[1000,256] {
  %p0_fused_update = f32[1000,256]{1,0} parameter(0)
  %p1_fused_update = f32[1,256]{1,0} parameter(1)
  %p2_fused_update = s32[] parameter(2)
  %z_fused_update = s32[] constant(0)
  ROOT %d_fused_update = f32[1000,256]{1,0} dynamic-update-slice(%p0_fused_update, %p1_fused_update, %p2_fused_update, %z_fused_update)
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a_add = f32[] parameter(0)
  %b_add = f32[] parameter(1)
  ROOT %c_add = f32[] add(%a_add, %b_add)
}

%fused_sum (p0: f32[4,1024]) -> f32[4] {
  %p0_fused_sum = f32[4,1024]{1,0} parameter(0)
  %z_fused_sum = f32[] constant(0)
  ROOT %r_fused_sum = f32[4]{0} reduce(%p0_fused_sum, %z_fused_sum), dimensions={1}, to_apply=%add
}

%body (c: (s32[], f32[4,1024])) -> (s32[], f32[4,1024]) {
  %c_body = (s32[], f32[4,1024]) parameter(0)
  %x_body = f32[4,1024]{1,0} get-tuple-element(%c_body), index=1
  %n_body = s32[] get-tuple-element(%c_body), index=0
  %e_body = f32[4,1024]{1,0} fusion(%x_body), kind=kLoop, calls=%fused_exp
  ROOT %t_body = (s32[], f32[4,1024]) tuple(%n_body, %e_body)
}

%fused_exp (p0: f32[4,1024]) -> f32[4,1024] {
  %p0_fused_exp = f32[4,1024]{1,0} parameter(0)
  ROOT %e_fused_exp = f32[4,1024]{1,0} exponential(%p0_fused_exp)
}

%dynamic-slice-fusion (p0: bf16[4,64,32], p1: bf16[32,128]) -> (f32[64,128], s8[1024]) {
  %p0_dsf = bf16[4,64,32]{2,1,0} parameter(0)
  %slice_dsf = bf16[1,64,32]{2,1,0} slice(%p0_dsf), slice={[1:2], [0:64], [0:32]}
  %bitcast_dsf = bf16[64,32]{1,0} bitcast(%slice_dsf)
  %p1_dsf = bf16[32,128]{1,0} parameter(1)
  ROOT %cublas_dsf = (f32[64,128]{1,0}, s8[1024]{0}) custom-call(%bitcast_dsf, %p1_dsf), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/jvp(loss)/dot_general"}, backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
}

%fused_lt (p0: s32[]) -> pred[] {
  %p0_fused_lt = s32[] parameter(0)
  %k_fused_lt = s32[] constant(3)
  ROOT %lt_fused_lt = pred[] compare(%p0_fused_lt, %k_fused_lt), direction=LT
}

%cond (c: (s32[], f32[4,1024])) -> pred[] {
  %c_cond = (s32[], f32[4,1024]) parameter(0)
  %n_cond = s32[] get-tuple-element(%c_cond), index=0
  ROOT %lt_cond = pred[] fusion(%n_cond), kind=kLoop, calls=%fused_lt
}

%cond2 (c: (s32[], f32[4,1024])) -> pred[] {
  %c_cond2 = (s32[], f32[4,1024]) parameter(0)
  %n_cond2 = s32[] get-tuple-element(%c_cond2), index=0
  ROOT %lt_cond2 = pred[] fusion(%n_cond2), kind=kLoop, calls=%fused_lt
}

%body2 (c: (s32[], f32[4,1024])) -> (s32[], f32[4,1024]) {
  ROOT %c_body2 = (s32[], f32[4,1024]) parameter(0)
}

ENTRY %main (a: bf16[64,32], b: bf16[32,128], x: f32[4,1024], big: f32[1000,256], u: f32[1,256], i: s32[], a4: bf16[4,64,32]) -> f32[4] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,128]{1,0} parameter(1)
  %x = f32[4,1024]{1,0} parameter(2)
  %big = f32[1000,256]{1,0} parameter(3)
  %u = f32[1,256]{1,0} parameter(4)
  %i = s32[] parameter(5)
  %a4 = bf16[4,64,32]{2,1,0} parameter(6)
  %sliced_gemm = (f32[64,128]{1,0}, s8[1024]{0}) fusion(%a4, %b), kind=kCustom, calls=%dynamic-slice-fusion
  %gemm = bf16[64,128]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(step)/jvp(Wrapped.apply)/M/Dense_0/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %row = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused_slice
  %upd = f32[1000,256]{1,0} fusion(%big, %u, %i), kind=kLoop, calls=%fused_update, metadata={op_name="jit(step)/add"}
  %sum = f32[4]{0} fusion(%x), kind=kInput, calls=%fused_sum, metadata={op_name="jit(step)/transpose(jvp())/reduce_sum"}
  %c0 = s32[] constant(0)
  %init = (s32[], f32[4,1024]) tuple(%c0, %x)
  %loop = (s32[], f32[4,1024]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %loop2 = (s32[], f32[4,1024]) while(%init), condition=%cond2, body=%body2
  %copy = f32[4]{0} copy(%sum)
  ROOT %r = f32[4]{0} bitcast(%copy)
}"""


def test_kernels_kinds_bytes_flops_and_loop_counts():
    found = {k.name: k for k in kernels(hlo.parse(_PROGRAM))}
    # A loop of known trip count runs its body that many times and never its condition (XLA's
    # GPU runtime); one of unknown trip count launches its condition's kernels.
    assert set(found) == {"gemm", "row", "upd", "sum", "e_body", "copy", "sliced_gemm", "lt_cond2"}
    gemm = found["gemm"]
    assert (gemm.kind, gemm.dtype, gemm.flops) == ("gemm", "bf16", 2 * 64 * 128 * 32)
    assert gemm.bytes == (64 * 32 + 32 * 128 + 64 * 128) * 2
    assert found["row"].bytes == 1024 * 4 * 2  # reads one row of four, writes it
    # an in-place update reads and writes the update, not the 1 MB buffer it lands in
    assert found["upd"].bytes == 256 * 4 * 2 + 4
    assert (found["sum"].kind, found["sum"].bytes) == ("reduction", 4 * 1024 * 4 + 4 * 4)
    assert (found["e_body"].kind, found["e_body"].count) == (
        "elementwise",
        3,
    )  # a loop body: 3 trips
    assert found["copy"].kind == "copy" and found["copy"].flops == 0
    # cuBLAS inside XLA's dynamic slice fusion (reading one [64, 32] slice in place): a GEMM
    sliced = found["sliced_gemm"]
    assert (sliced.kind, sliced.dtype, sliced.flops) == ("gemm", "bf16", 2 * 64 * 128 * 32)
    assert sliced.op_name == "jit(step)/jvp(loss)/dot_general"


_GATHER = """HloModule jit_pick

%fused_pick (p0: bf16[8192,50304], p1: s32[8192,1]) -> f32[8192] {
  %p0_pick = bf16[8192,50304]{1,0} parameter(0)
  %w_pick = f32[8192,50304]{1,0} convert(%p0_pick)
  %p1_pick = s32[8192,1]{1,0} parameter(1)
  %g_pick = f32[8192,1]{1,0} gather(%w_pick, %p1_pick), offset_dims={1}, collapsed_slice_dims={}, start_index_map={1}, index_vector_dim=1, slice_sizes={1,1}
  ROOT %b_pick = f32[8192]{0} bitcast(%g_pick)
}

%fused_rows (p0: f32[50304,768], p1: s32[4096,1]) -> f32[4096,768] {
  %p0_rows = f32[50304,768]{1,0} parameter(0)
  %p1_rows = s32[4096,1]{1,0} parameter(1)
  ROOT %g_rows = f32[4096,768]{1,0} gather(%p0_rows, %p1_rows), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,768}
}

%fused_both (p0: bf16[64,1024]) -> (f32[64,1024], f32[64,1]) {
  %p0_both = bf16[64,1024]{1,0} parameter(0)
  %w_both = f32[64,1024]{1,0} convert(%p0_both)
  %s_both = f32[64,1]{1,0} slice(%w_both), slice={[0:64], [0:1]}
  ROOT %t_both = (f32[64,1024]{1,0}, f32[64,1]{1,0}) tuple(%w_both, %s_both)
}

%add_s (a: f32[], b: f32[]) -> f32[] {
  %a_s = f32[] parameter(0)
  %b_s = f32[] parameter(1)
  ROOT %c_s = f32[] add(%a_s, %b_s)
}

%fused_grad (p0: f32[50304,768], p1: s32[4096,1], p2: bf16[4096,768]) -> f32[50304,768] {
  %p0_grad = f32[50304,768]{1,0} parameter(0)
  %p1_grad = s32[4096,1]{1,0} parameter(1)
  %p2_grad = bf16[4096,768]{1,0} parameter(2)
  %u_grad = f32[4096,768]{1,0} convert(%p2_grad)
  ROOT %s_grad = f32[50304,768]{1,0} scatter(%p0_grad, %p1_grad, %u_grad), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add_s
}

ENTRY %main (a: bf16[8192,50304], i: s32[8192,1], e: f32[50304,768], j: s32[4096,1], x: bf16[64,1024]) -> f32[8192] {
  %a = bf16[8192,50304]{1,0} parameter(0)
  %i = s32[8192,1]{1,0} parameter(1)
  %e = f32[50304,768]{1,0} parameter(2)
  %j = s32[4096,1]{1,0} parameter(3)
  %x = bf16[64,1024]{1,0} parameter(4)
  %rows = f32[4096,768]{1,0} fusion(%e, %j), kind=kLoop, calls=%fused_rows
  %both = (f32[64,1024]{1,0}, f32[64,1]{1,0}) fusion(%x), kind=kLoop, calls=%fused_both
  %dx = bf16[4096,768]{1,0} parameter(5)
  %grad = f32[50304,768]{1,0} fusion(%e, %j, %dx), kind=kInput, calls=%fused_grad
  ROOT %pick = f32[8192]{0} fusion(%a, %i), kind=kLoop, calls=%fused_pick
}"""


def test_gathers_and_scatters_move_the_elements_they_index_not_their_whole_operand():
    found = {k.name: k for k in kernels(hlo.parse(_GATHER))}
    # one label's logit per row, of 16-bit logits widened first: a 32-byte sector each, not the
    # 786 MiB of logits; then the indices read and the picks written
    assert found["pick"].bytes == 8192 * 32 + 8192 * 4 + 8192 * 4
    # an embedding's rows: each row whole (768 float32s are 96 sectors)
    assert found["rows"].bytes == 4096 * 768 * 4 + 4096 * 4 + 4096 * 768 * 4
    # a converted value also used whole: the whole operand is read
    assert found["both"].bytes == 64 * 1024 * 2 + 64 * 1024 * 4 + 64 * 4
    # an embedding's gradient, scattered into the head's in place: the updated rows read and
    # written, the updates and indices read (not the 154 MB buffer twice)
    rows = 4096 * 768
    assert found["grad"].bytes == rows * 4 + 4096 * 4 + rows * 2 + rows * 4


def test_estimate_is_a_roofline_per_kernel_plus_its_launch():
    rates = timing.Rates(launch=5e-6, memory=0.5, matmul=0.5, attention=0.5)
    est = timing.estimate(hlo.parse(_PROGRAM), H200, rates)
    assert est.kernels == 10  # 6 in the entry, a loop body's fusion 3 times, a condition's once
    per = {k.name: k for k in kernels(hlo.parse(_PROGRAM))}

    def share(k):  # a GEMM's: its shape's share of the peak (gemm_rate), times the correction
        return 0.5 * gemm_rate.efficiency(k.gemm_shape, k.dtype, H200.sm_count)

    want = sum(
        (5e-6 + max(k.bytes / (H200.memory_bandwidth * 0.5), k.flops / (989.4e12 * share(k))))
        * k.count
        for k in per.values()
    )
    assert est.seconds == pytest.approx(want)
    assert est.launch_seconds == pytest.approx(10 * 5e-6)
    assert sum(n for n, _ in est.by_kind.values()) == 10
    assert sum(s for _, s in est.by_kind.values()) == pytest.approx(est.seconds)
    top = {k.name: k for k in est.top}
    assert top["gemm"].path == "Dense_0" and not top["gemm"].backward
    assert top["sum"].path == "(loss)" and top["upd"].path == "(update)"
    assert top["row"].path == "(unnamed)"
    assert est.top[0].seconds >= est.top[-1].seconds
    text = "\n".join(est.lines())
    assert "a model, not a measurement" in text and "10 kernel launches" in text
    assert est.to_dict()["by_kind"]["elementwise"]["kernels"] == 6


def test_estimate_rates_float32_gemms_at_the_tf32_rate():
    heavy = timing.kernel_seconds  # one GEMM of no known shape, compute-bound at both rates
    from jamp.hlo.kernels import Kernel

    rates = timing.Rates(launch=0.0, memory=1.0, matmul=1.0, attention=1.0)
    bf16 = Kernel("g", "gemm", "Triton", "", 1, 10**12, "bf16")
    f32 = Kernel("g", "gemm", "Triton", "", 1, 10**12, "f32")
    # TF32: half the bf16 peak, at its own measured ceiling
    bf16_fit, f32_fit = gemm_rate.FITS["bf16"], gemm_rate.FITS["f32"]
    ratio = 2 * bf16_fit.ceiling / f32_fit.ceiling
    assert heavy(f32, H200, rates)[0] == pytest.approx(ratio * heavy(bf16, H200, rates)[0])
    assert heavy(bf16, H200, rates) == (pytest.approx(1 / 989.4 / bf16_fit.ceiling), "compute")


def test_every_prediction_is_given_with_the_models_leave_one_out_range():
    est = timing.estimate(hlo.parse(_PROGRAM), H200)
    low, high = est.range_seconds()
    assert timing.ERROR == max(abs(c.held_out_error) for c in timing.CALIBRATION) > 0
    assert low == pytest.approx(est.seconds * (1 - timing.ERROR))
    assert high == pytest.approx(est.seconds * (1 + timing.ERROR))
    assert f"({low * 1e3:.1f}-{high * 1e3:.1f} ms)" in est.lines()[0]
    assert "leave-one-out" in timing.NOTE and "not a measurement" in timing.NOTE
    assert all(abs(c.error) < 0.10 for c in timing.CALIBRATION)  # every row within 10 %


# ----- real H200 programs


def _experiments():
    import pathlib
    import sys

    path = str(pathlib.Path(__file__).resolve().parents[1] / "experiments")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gpt2_variants

    return gpt2_variants


@pytest.mark.gpu_compile
def test_compile_report_estimate_counts_gemm_and_attention_flops():
    variants = _experiments()
    built = variants.build("lm_jamp_bf16", quick=True)
    report = target_lib.compile_for(built.step, *built.abstract_args, target="h200")
    found = kernels(hlo.parse(report.hlo_text))
    est = report.estimate
    assert est is not None and est.kernels == sum(k.count for k in found)
    gemm_flops = sum(k.flops * k.count for k in found if k.kind == "gemm")
    assert gemm_flops == sum(g.flops * g.count for g in report.gemms)
    # cuDNN's causal attention, 2 layers: 2 GEMMs forward, 5 backward, half of each masked away.
    shape, batch = variants.QUICK, 8
    one = 2 * batch * shape["heads"] * shape["seq"] ** 2 * (shape["d"] // shape["heads"])
    attention = [k for k in found if k.kind == "attention"]
    assert len(attention) == 2 * shape["layers"]
    assert sum(k.flops for k in attention) == shape["layers"] * (2 + 5) * one // 2
    assert {k.dtype for k in attention} == {"bf16"}
    import gpu_suite  # (on the path _experiments set)

    # the suite's attention column: cuDNN's mask type, causal (half the scores computed)
    assert gpu_suite._attention_masks(hlo.parse(report.hlo_text)) == f"{shape['layers']} causal"
    table = report.table()
    assert "predicted step time on one NVIDIA H200" in table and "not a measurement" in table
    assert report.to_dict()["estimate"]["kernels"] == est.kernels


STEP_SHAPE = dict(layers=8, d=256, heads=4, mlp=1024, seq=128, vocab=1024)


@pytest.mark.gpu_compile
@pytest.mark.parametrize("family", ["lm", "llama"])
def test_train_step_adds_at_most_5_percent_kernels_to_a_plain_step(family):
    """jamp.make_train_step (finite check, per-module flags, grad norm, the skip, the loss scale
    and counters, and the state's bfloat16 copies of the params) against value_and_grad + optax
    on the same wrapped model, H200 program: at most 5 % more kernels. Besides the gradients XLA
    writes out because the finite check reads them before the update does (`shared_results`: a
    plain step's update fuses them in; all but one end in a reduction, split-K GEMMs and bias
    sums, that XLA does not fuse into the check's reduction), the step runs fewer kernels than
    the plain one: the update writes the copies the matmuls read, where the plain step casts
    each matrix in a kernel of its own."""
    from jamp.grad_stats import SCOPE
    from jamp.hlo.kernels import ends_in_reduction, shared_results

    variants = _experiments()
    counts = {}
    for kind in ("plain_bf16", "jamp_bf16"):
        built = variants.build(f"{family}_{kind}", batch=4, shape=STEP_SHAPE)
        report = target_lib.compile_for(built.step, *built.abstract_args, target="h200")
        program = hlo.parse(report.hlo_text)
        stats = [k for k in kernels(program) if f"/{SCOPE}/" in k.op_name]
        shared = shared_results(program, SCOPE)
        elementwise = [name for name in shared if not ends_in_reduction(program, name)]
        counts[kind] = (report.estimate.kernels, len(shared), len(stats), elementwise)
    plain, _, none, _ = counts["plain_bf16"]
    step, shared, stats, elementwise = counts["jamp_bf16"]
    assert none == 0
    assert len(elementwise) <= 1, elementwise
    # one or two reductions per leaf shape (a dozen shapes), not one or two per leaf (~100)
    assert 0 < stats <= 24
    assert step - shared < plain, counts
    assert step <= 1.05 * plain, counts


@pytest.mark.gpu_compile
@pytest.mark.parametrize("seq", [1024, 256])
def test_position_embedding_gradient_keeps_activations_batch_major_at_batch_32(seq):
    """A position embedding's gradient sums the batch's sequences. As a reduction over the batch
    axis, at 32 sequences of GPT-2 small's widths, XLA:GPU laid the whole step's activations out
    batch-minor ([T, D, B]) with a transpose at every matmul (+7.5 % predicted at 12 layers);
    jamp sums it as a product with ones (16-bit operands, float32 accumulation). With one row of
    ones XLA rewrites the product back into that reduction below 10M elements (sequences of 256:
    +10.7 % predicted at 12 layers), so the ones are a matrix of two rows."""
    import re

    variants = _experiments()
    shape = dict(variants.GPT2, layers=1, vocab=1024, seq=seq)
    built = variants.build("lm_jamp_bf16", batch=32, shape=shape)
    report = target_lib.compile_for(built.step, *built.abstract_args, target="h200")
    d = shape["d"]
    assert not re.findall(rf"\[{seq},{d},32\]", report.hlo_text)
    assert not re.findall(r"(?:bf16|f16)\[[0-9,]*\]\{[0-9,]*\} reduce\(", report.hlo_text)


def _toy_lm_step(policy: str, layers: int = 2, history: int = 16, donate: bool = True):
    """(the H200 program's report, the fp8 state or None) of a small TransformerLM's step."""
    import jax
    import jax.numpy as jnp
    import optax

    import jamp
    from jamp.models import TransformerLM

    lm = TransformerLM(256, num_layers=layers, d_model=64, num_heads=4, mlp_dim=128, max_len=32)
    model = jamp.wrap(lm, policy)
    tokens = jax.ShapeDtypeStruct((4, 33), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((4, 32), jnp.int32)))

    def loss_fn(p, model_state, batch, rng):
        logits = model.apply({"params": p}, batch[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return loss, (model_state, {})

    fp8_state = None
    if policy == "mixed_fp8":
        fp8_state = jamp.fp8.init_state(
            loss_fn, params["params"], {}, tokens, None, history=history
        )
    tx = optax.adamw(1e-3)
    state = jax.eval_shape(
        lambda p: jamp.TrainState.create(p, tx, fp8_state=fp8_state), params["params"]
    )
    step = jamp.make_train_step(loss_fn, tx)
    if donate:
        step = jax.jit(step, donate_argnums=(0,))
    rng = jax.eval_shape(lambda: jax.random.key(0))
    return target_lib.compile_for(step, state, tokens, rng, target="h200"), fp8_state


def _kernel_count(report) -> int:
    return sum(k.count for k in kernels(hlo.parse(report.hlo_text)))


@pytest.mark.gpu_compile
def test_fp8_scaling_state_is_read_without_reduction_kernels():
    """Delayed scaling reads each site's amax history (its maximum; for an eval, whether it has
    one) and its three rows (the saturation metric). As reductions these were kernels of their own, a few per
    site: ~500 of GPT-2 small's fp8 step on the H200 program (2311 -> 1795 kernels); as
    elementwise maxima XLA fuses them into the kernels that use them."""
    history = 7  # a length no other array of this program has
    report, fp8_state = _toy_lm_step("mixed_fp8", layers=1, history=history, donate=False)
    program = hlo.parse(report.hlo_text)
    reduced = [program.operand_arrays(i)[0][1] for i in program.instructions if i.op == "reduce"]
    small = [shape for shape in reduced if shape[-1:] in ((history,), (3,))]
    assert reduced and len(fp8_state.sites) == 6 and not small, small


@pytest.mark.gpu_compile
def test_delayed_fp8_quantises_in_the_kernels_that_record_the_amax():
    """With delayed scaling nothing of this step's amax reaches the quantisation, so XLA records
    each operand's amax in the kernel that quantises it, and every site's history and scale
    update shares a few kernels. Falling back to the tensor's own amax while a site had no
    history put a full reduction and a select before every quantisation, and stacking a site's
    three amaxes and rolling its history by concatenation made kernels per site: 140 kernels
    over bfloat16's step for 12 sites here (GPT-2 small: 1795 against 875), 47 now (GPT-2
    small: 1291)."""
    bf16_report = _toy_lm_step("mixed_bfloat16")[0]
    bf16 = _kernel_count(bf16_report)
    report, fp8_state = _toy_lm_step("mixed_fp8")
    fp8_kernels, sites = _kernel_count(report), len(fp8_state.sites)
    assert sites == 12 and fp8_kernels - bf16 <= 4.5 * sites, (fp8_kernels, bf16)
    # The report says what fp8 buys here: at these tiny shapes its scaling costs more than its
    # GEMMs save, and the report says fp8 is predicted slower than bf16.
    assert bf16_report.fp8 is None
    cost = report.fp8
    assert cost is not None and cost.gemms >= 2 * sites and cost.scaling > 2 * sites
    assert cost.slower and cost.scaling_seconds > cost.saved_seconds
    assert "fp8 is predicted SLOWER than bf16" in report.table()
    assert report.to_dict()["fp8"]["slower"] is True


@pytest.mark.gpu_compile
def test_sharded_step_checks_gradients_with_one_all_reduce_and_no_resharding():
    """Under fsdp=8 on 8 H200s, the gradient norm and finite check sum each shard where it lies:
    their partial sums cross devices in one combined all-reduce, and no gradient is moved
    between devices to be stacked (an all-to-all, which flattening a column-sharded weight
    costs)."""
    from toy import h200x8_llama_report

    import jamp
    from jamp.grad_stats import SCOPE

    def loss_of(model, p, tokens):
        logits = model.apply({"params": p}, tokens[:, :-1])
        return jamp.losses.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    report = h200x8_llama_report(loss_of)
    found = hlo.collectives(hlo.parse(report.hlo_text))
    assert not [c for c in found if c.kind == "all-to-all"]
    checks = [c for c in found if f"{SCOPE}/" in c.op_name]  # combined: names joined by ":"
    assert checks and {c.kind for c in checks} == {"all-reduce"} and len(checks) <= 2
