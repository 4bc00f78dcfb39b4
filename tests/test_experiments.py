"""experiments/: the benchmark peers build the same networks as jamp.models (no timing here); the
fp8 accuracy script runs in its quickest mode, and its Flax peer threads flax's fp8 variables."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from subproc import cli_env

from jamp.models import get_model

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import _fp8_peer  # noqa: E402
import peers_flax  # noqa: E402
import peers_torch  # noqa: E402

CASES = {
    "seed_cnn": (10, jnp.zeros((2, 32, 32, 3)), {}),
    "resnet20": (10, jnp.zeros((2, 32, 32, 3)), {}),
    "transformer_lm": (256, jnp.zeros((2, 16), jnp.int32), dict(num_layers=2, d_model=32)),
}


def _shapes(module, x):
    tree = jax.eval_shape(lambda: module.init(jax.random.key(0), x))
    return jax.tree.map(lambda a: (a.shape, a.dtype), tree)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hand_written_flax_twin_has_jamp_models_parameters(name):
    classes, x, config = CASES[name]
    ours = get_model(name, classes, **config)
    hand = peers_flax.hand_model(name, jnp.bfloat16, classes, **config)
    assert _shapes(hand, x) == _shapes(ours, x)


def test_hand_written_flax_twin_computes_in_its_dtype():
    classes, x, config = CASES["transformer_lm"]
    hand = peers_flax.hand_model("transformer_lm", jnp.bfloat16, classes, **config)
    jaxpr = jax.make_jaxpr(lambda v: hand.apply(v, x))(hand.init(jax.random.key(0), x))
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def test_torch_peer_reports_whether_it_can_run():
    ok, why = peers_torch.available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if not ok:
        with pytest.raises(peers_torch.PeerUnsupported):
            peers_torch.make_step("seed_cnn", "float32", {})


@pytest.mark.program
def test_accuracy_fp8_quickest_mode_writes_its_table(tmp_path):
    # One recipe, one seed, a few steps: the four policies through the real program (~30 s).
    out = tmp_path / "accuracy_fp8.md"
    cmd = [sys.executable, str(EXPERIMENTS / "accuracy_fp8.py"), "--recipes", "digits",
           "--seeds", "1", "--steps", "12", "--out", str(out),
           "--data_dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=cli_env(1), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    for label in ("float32", "mixed_bfloat16", "mixed_fp8 delayed", "mixed_fp8 current"):
        assert f"\n| {label} | " in text
    assert "(reference)" in text and "the bar of 0.5 points" in text
    assert "jax " in text and "flax " in text and "- date: " in text
    assert "| mixed_fp8 delayed | mixed_bfloat16 | " in text  # its params evaluated in bf16


@pytest.mark.program  # an experiment's own code, run at the newest end
def test_fp8_peer_step_overwrites_flax_fp8_variables_and_optimizes_only_params():
    # The peer's hand-written step: flax's _overwrite_with_gradient variables take their
    # "gradients" (this step's amaxes), the optimizer sees only the params.
    import optax
    from flax.training import train_state

    from jamp.train import tasks

    model = _fp8_peer.PeerLM(256, num_layers=1, d_model=32, num_heads=2, mlp_dim=64,
                             dot_cls=_fp8_peer.fp8_dot_cls(4))  # fmt: skip
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    variables = dict(model.init(jax.random.key(0), tokens[:, :-1]))
    sites = _fp8_peer.fp8_sites(variables)
    assert len(sites) == 6  # q, k, v, out and the MLP's two Dense layers
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables, tx=optax.adamw(1e-3)
    )
    assert _fp8_peer.OWG not in str(jax.tree_util.tree_structure(state.opt_state))
    step = _fp8_peer.make_train_step(tasks.make_loss_fn(model, "lm"), 1.0, sites[0])
    kernel = variables["params"]["DecoderBlock_0"]["Dense_0"]["kernel"]
    kernel_amax = float(jnp.abs(kernel.astype(jnp.bfloat16)).max())
    before = jax.tree.map(jnp.copy, state.params)  # the step donates its state
    new, metrics = step(state, {"tokens": tokens}, jax.random.key(2))
    f8 = new.params[_fp8_peer.OWG]["DecoderBlock_0"]["Dense_0"]["Fp8DirectDotGeneralOp_0"]
    # The kernel's newest amax is the bf16 kernel's (the step read it), its scale still 1 (the
    # history was empty), and the gradient's amax was recorded in the backward pass.
    assert float(f8["kernel_amax_history"][0]) == kernel_amax
    assert float(f8["kernel_scale"][0]) == 1.0 and float(f8["output_grad_amax_history"][0]) > 0
    assert metrics["grads_finite"] == 1.0 and 0 < metrics["grad_norm"] < jnp.inf
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), new.params["params"], before["params"])
    assert all(jax.tree.leaves(moved))


@pytest.mark.program  # an experiment's own code, run at the newest end
def test_bench_fp8_builds_its_variants_and_reads_gemm_operand_types():
    # The GPU benchmark, kept runnable for the next lent GPU: one tiny variant of jamp and of the
    # Flax peer builds and steps here, and the GEMM count reads a GPU fp8 custom call's operands.
    import bench_fp8

    ((label, sizes, batch, seq),) = bench_fp8.widths(on_gpu=False, quick=True)
    for built in (
        bench_fp8.build_jamp(sizes, batch, seq, "mixed_fp8", "delayed"),
        bench_fp8.build_flax(sizes, batch, seq, True),
    ):
        run, (compile_s, temp_mib), gemms = built
        jax.block_until_ready(run())
        assert compile_s > 0 and temp_mib > 0 and gemms
    hlo = "\n".join(
        [
            "ENTRY %main (p0: f8e4m3fn[16,64], p1: f8e4m3fn[64,32]) -> f32[16,32] {",
            "  %p0 = f8e4m3fn[16,64]{1,0} parameter(0)",
            "  %p1 = f8e4m3fn[64,32]{1,0} parameter(1)",
            "  %g = (f32[16,32]{1,0}, s8[1024]{0}) custom-call(%p0, %p1), "
            'custom_call_target="__cublas$lt$matmul$f8"',
            "}",
        ]
    )
    assert bench_fp8.gemm_counts(hlo) == {"gemm f8e4m3fnxf8e4m3fn (__cublas$lt$matmul$f8)": 1}
    assert bench_fp8.widths(on_gpu=True, quick=False)[0][0] == "GPT-2 small 12 x 768"


@pytest.mark.program
def test_gpu_suite_dry_run_writes_each_row_and_the_kernel_table(tmp_path):
    """The GPU suite end to end on this CPU with tiny shapes (two rows; the experiment's own run
    is all of them on a GPU): every row timed in its own process, the table, the JSON lines and
    the profiled row's kernel table written."""

    cmd = [sys.executable, str(EXPERIMENTS / "gpu_suite.py"), "--quick", "--out", str(tmp_path)]
    cmd += ["--rows", "lm_jamp_bf16", "lm_fp32", "--deadline", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cli_env())
    assert done.returncode == 0, (
        done.stdout + done.stderr + (tmp_path / "gpu_suite.log").read_text()
    )
    rows = [
        json.loads(line) for line in (tmp_path / "gpu_suite_rows.jsonl").read_text().splitlines()
    ]
    assert {r["row"] for r in rows} == {"lm_jamp_bf16", "lm_fp32"}
    for r in rows:
        assert r["step_ms"] > 0 and r["kernels"] > 0 and r["predicted_ms"] > 0
        assert r["loss_first_last"][1] < r["loss_first_last"][0]
        assert r["attention"] == "-"  # on a CPU attention is written out: no cuDNN calls
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "jamp.wrap mixed_bfloat16 + make_train_step" in table and "not a measurement" in table
    kernels = (tmp_path / "gpu_suite_kernels.md").read_text()
    assert kernels.count("\n|") >= 10  # header and the costliest kernels


@pytest.mark.gpu_compile
def test_long_attention_quick_mode_runs_causal_and_windowed_masks_as_cudnn_does(tmp_path):
    import long_attention

    out = tmp_path / "long_attention.md"
    long_attention.main(["--quick", "--out", str(out)])
    rows = [
        line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert [row.split(" | ")[1] for row in rows[1:]] == ["causal", "causal, window 1025"]
    assert "not a measurement" in out.read_text() and "not a measured peak" in out.read_text()


@pytest.mark.gpu_compile
def test_fp8_widths_quick_mode_writes_its_table(tmp_path):
    """The bf16 -> fp8 table by width: tiny shapes here, both policies compiled for an H200,
    each with the model's range; a layer's GEMMs priced by gemm_rate."""
    import fp8_widths

    fp8_widths.main(["--quick", "--out", str(tmp_path)])
    table = (tmp_path / "fp8_widths_quick.md").read_text()
    assert "not a measurement" in table and "| tiny |" in table
    (row,) = json.loads((tmp_path / "fp8_widths_quick.json").read_text())["rows"]
    step = row["step"]
    assert step["bf16_range_ms"][0] < step["bf16_ms"] < step["bf16_range_ms"][1]
    assert step["speedup"] == pytest.approx(step["bf16_ms"] / step["fp8_ms"])
    assert step["fp8_scaling_kernels"] > 0
    # 4 forward products of a layer, 2 backward each
    assert len(fp8_widths.layer_gemms(64, 256, 256)) == 12
