"""experiments/gpu_compile.py: its hand-written cuDNN-attention peer is reported fused, and its
table and plot are written from its JSON (the compiles themselves are the experiment's)."""

import json
import pathlib
import sys

import pytest

from jamp import target as target_lib

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import gpu_compile_report  # noqa: E402
from _harness.environment import run_record  # noqa: E402

GIB = 1 << 30


def _row(label, batch, temp, **extra):
    row = {
        "label": label,
        "batch": batch,
        "temp": temp,
        "peak": temp + GIB,
        "by_dtype": {"f32": temp // 2, "bf16": temp - temp // 2},
        "fused_attention": 0,
        "unfused_attention": 12,
        "gemms": {},
        "fp32_gemms": 0,
        "activations": ["compute"],
        "compile_s": 30.0,
        "usable": 105 * GIB,
    }
    row.update(extra)
    return row


def test_gpu_compile_report_writes_its_tables_each_parts_run_and_the_plot(tmp_path):
    results = {
        "gpt2": [
            _row(
                "jamp mixed_bfloat16",
                8,
                13 * GIB,
                largest={"batch": 72, "above": 74, "complete": True, "peaks": {}},
            )
        ],
        "decoders": [
            _row(
                "llama 7b mixed_bfloat16 fsdp=8",
                16,
                60 * GIB,
                arguments=10 * GIB,
                wire=[
                    {
                        "kind": "all-gather",
                        "dtype": "bf16",
                        "axes": ["fsdp"],
                        "count": 3,
                        "bytes": 2 * GIB,
                    }
                ],
                largest={"batch": 24, "above": 32, "complete": False, "peaks": {}},
            )
        ],
        "models": [_row("Tunix Llama 3: jamp mixed_bfloat16", 8, 2 * GIB, fused_attention=4)],
        "runs": {
            "gpt2": {
                **run_record("python experiments/gpu_compile.py --part gpt2", 120),
                "reruns": [
                    {
                        **run_record("python g.py --policy mixed_fp8", 180),
                        "rows": "mixed_fp8",
                    }
                ],
            },
            "models": {
                **run_record("python x.py --part models", 60),
                "date": "2026-01-02",
                "note": "beside another run",
            },
        },
    }
    stem = tmp_path / "gpu_compile"
    gpu_compile_report.write(results, stem, fraction=0.75, target=target_lib.get_target("h200"))
    text = stem.with_suffix(".md").read_text()
    # each part with its own run: parts run apart, at different times
    assert (
        "- GPT-2 small: " in text
        and "`python experiments/gpu_compile.py --part gpt2` (2 min)" in text
    )
    assert "`python x.py --part models` (1 min; beside another run)." in text
    # a policy's rows rerun later (`--policy`) say so under their part's run
    assert (
        "\n  - its mixed_fp8 rows rerun " in text
        and "`python g.py --policy mixed_fp8` (3 min)" in text
    )
    assert "- NNX models: 2026-01-02, compiled on " in text and "- decoders:" not in text
    assert (
        "| Tunix Llama 3: jamp mixed_bfloat16 | 8 | 2.00 | 3.00 | f32 1.00, bf16 1.00 | 4 / 12 |"
        in text
    )
    assert "| jamp mixed_bfloat16 | 8 | 13.00 | 14.00 | f32 6.50, bf16 6.50 | 0 / 12 | 0 |" in text
    assert "72 (74: no)" in text
    assert "| llama 7b mixed_bfloat16 fsdp=8 | 16 | 10.00 | 60.00 | 61.00 | yes | " in text
    assert "all-gather bf16 2.00" in text and "24 (32: no), searched no further" in text
    assert "not a measured peak" in text
    assert stem.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.gpu_compile
def test_gpu_compile_wrapped_lm_fuses_attention_and_keeps_what_hand_written_bf16_keeps():
    # The experiment's GPT-2-shaped LM at its quick size, batch 8, on the H200 program: the
    # hand-written bf16 network with cuDNN attention, and jamp's wrapped fp32 model under the
    # 16-bit policies, which must run the same fused kernels and keep no more (measured: 0.98x;
    # at GPT-2 small's size both are 5.38 GiB, experiments/results/gpu_compile_h200.md).
    import gpu_compile

    from jamp.train import plan

    hand = gpu_compile.hand_report("cudnn", 8, quick=True, options=plan.NO_REMAT)
    assert [(a.fused, a.forward, a.backward) for a in hand.attention] == [(True, 1, 1)] * 2
    assert hand.fp32_gemms() == []
    for policy in ("mixed_bfloat16", "mixed_float16"):
        recipe = gpu_compile.gpt2_recipe(policy, "auto", quick=True)
        report = plan.compile_at(recipe, 8, plan.NO_REMAT)
        assert [(a.fused, a.forward, a.backward) for a in report.attention] == [(True, 1, 1)] * 2
        assert [how for _, how, _ in report.attention_traced] == ["cudnn"] * 2, policy
        assert report.fp32_gemms() == [], policy
        ratio = report.memory.temporaries / hand.memory.temporaries
        assert ratio <= 1.05, (policy, ratio)


def test_gpu_compile_policy_rerun_replaces_its_rows_in_place():
    import gpu_compile

    old = [_row(label, b, GIB) for label in ("bf16", "fp8", "hand") for b in (8, 16)]
    new = [_row("fp8", 8, 2 * GIB), _row("fp8", 16, 3 * GIB), _row("fp8", 32, 4 * GIB)]
    got = gpu_compile._replaced(old, new)
    assert [(r["label"], r["batch"]) for r in got] == [(r["label"], r["batch"]) for r in old] + [
        ("fp8", 32)
    ]
    assert [r["temp"] // GIB for r in got if r["label"] == "fp8"] == [2, 3, 4]
    assert [r for r in got if r["label"] != "fp8"] == [r for r in old if r["label"] != "fp8"]


@pytest.mark.gpu_compile
def test_gpu_estimate_dumps_a_batch_and_predicts_its_mfu(tmp_path):
    import gpt2_variants
    import gpu_estimate

    from jamp.inspect.timing import ERROR, RATES

    gpu_estimate.dump(tmp_path, ["lm_jamp_bf16"], quick=True, batch=2)
    info = json.loads((tmp_path / "lm_jamp_bf16_b2.json").read_text())
    built = gpt2_variants.build("lm_jamp_bf16", batch=2, quick=True)
    assert (info["batch"], info["flops"]) == (2, built.model_flops)
    (row,) = gpu_estimate.variant_rows(tmp_path, target_lib.GPUS["h200"], RATES)
    assert row["variant"] == "lm_jamp_bf16_b2" and row["batch"] == 2
    peak = target_lib.GPUS["h200"].bf16_tflops * 1e12
    assert row["predicted_mfu"] == pytest.approx(built.model_flops / row["seconds"] / peak)
    result = {"rates": RATES.__dict__, "calibration": [], "error": ERROR, "variants": [row]}
    table = gpu_estimate._markdown(result)
    low, high = (row["seconds"] * 1e3 * (1 + e) for e in (-ERROR, ERROR))
    assert (
        f"| lm_jamp_bf16_b2 | 2 | {row['seconds'] * 1e3:.2f} | {low:.1f}-{high:.1f} "
        f"| {row['predicted_mfu']:.1%} |" in table
    )
