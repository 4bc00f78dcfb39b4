"""The step-time model of `jamp.compile_for` (jamp.inspect.timing), calibrated and checked.

The H200 measurement of docs/results.md ("On an H200") timed three JAX steps of Hugging Face's Flax GPT-2
small (batch 8 x 1024, AdamW): TF32 52.63 ms, HF's own bf16 build 27.21 ms, jamp.wrap
mixed_bfloat16 + make_train_step 24.55 ms (jamp at 63141af). This script compiles those three
programs for an H200 on this machine (no GPU), and fits the model's launch cost and GEMM
efficiency to them (bandwidth and attention shares fixed: see FIXED), then states each row's
error, and each variant's predicted MFU (PaLM's model FLOPs over the predicted time, against
the dense bf16 peak: a prediction, like the time). The jamp row must be the program that was measured, so its HLO comes from a checkout of
63141af:

    git worktree add /tmp/jamp-63141af 63141af
    cp experiments/gpu_estimate.py /tmp/jamp-63141af/experiments/
    git show 4168935:experiments/gpt2_variants.py > /tmp/jamp-63141af/experiments/gpt2_variants.py
    (cd /tmp/jamp-63141af && python experiments/gpu_estimate.py --dump /tmp/hlo-63141af \\
        --variants hf_jamp_bf16)
    python experiments/gpu_estimate.py --dump /tmp/hlo-now        # every variant, this tree
    python experiments/gpu_estimate.py --dump /tmp/hlo-now --batch 32 \
        --variants hf_jamp_bf16 lm_jamp_bf16 lm_jamp_bf16_losses   # the MFU target's batch
    python experiments/gpu_estimate.py --calibrate /tmp/hlo-63141af /tmp/hlo-now

(The 63141af worktree takes gpt2_variants as it was before the state kept the params' 16-bit
copies, which 63141af's `TrainState.create` does not know.)

writes experiments/results/gpu_estimate_h200.md (and .json): the fitted constants, each
calibration row's predicted and measured time, and every dumped variant's predicted time,
kernel launches by kind and top kernels. Needs JAX's CUDA plugin (the gpu-compile extra) and,
for the hf_* variants, transformers < 5.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from _harness import RESULTS  # noqa: E402
from _harness.environment import run_record  # noqa: E402

#: What was measured on one H200 (docs/results.md, "On an H200"), ms per step: variant -> (ms, source).
MEASURED = {
    "hf_fp32": 52.63,
    "hf_bf16": 27.21,
    "hf_jamp_bf16": 24.55,
}
#: Held fixed while fitting (three rows cannot pin four constants): a streaming kernel's share of
#: HBM bandwidth, and cuDNN flash attention's share of the dense peak (forward and backward).
FIXED = {"memory": 0.80, "attention": 0.45}


def dump(out: pathlib.Path, variants, quick: bool, batch: int = 8) -> None:
    """Compiles each variant for one H200 and writes <variant>.hlo and <variant>.json
    (<variant>_b<batch>.* for a batch other than 8)."""
    import gpt2_variants

    from jamp.target import compile_for

    out.mkdir(parents=True, exist_ok=True)
    for name in variants:
        built = gpt2_variants.build(name, batch=batch, quick=quick)
        report = compile_for(built.step, *built.abstract_args, target="h200")
        stem = name if batch == 8 else f"{name}_b{batch}"
        (out / f"{stem}.hlo").write_text(report.hlo_text)
        m = report.memory
        info = {
            "variant": name,
            "batch": batch,
            "flops": built.model_flops,
            "temp": m.temporaries,
            "peak": m.peak,
            "params": built.params,
        }
        (out / f"{stem}.json").write_text(json.dumps(info))
        print(f"{name}: peak {m.peak / 2**30:.2f} GiB, temporaries {m.temporaries / 2**30:.2f}")


def _kernels(path: pathlib.Path):
    from jamp import hlo
    from jamp.hlo.kernels import kernels

    return kernels(hlo.parse(path.read_text()))


def _total(kernels, gpu, rates) -> float:
    from jamp.inspect.timing import kernel_seconds

    return sum(kernel_seconds(k, gpu, rates)[0] * k.count for k in kernels)


#: The grid the launch cost is fitted on, and the GEMM correction's: held at 1, the public
#: matmul fits of `jamp.inspect.gemm_rate` as they are (freed, three rows fit 1.31 and 8 us:
#: GEMMs above their dense peak at large shapes, which no GPU does).
LAUNCHES = np.arange(0.5e-6, 10.01e-6, 0.1e-6)
CORRECTIONS = np.array([1.0])


def _parts(kernels, gpu):
    """Per kernel: runs, seconds of its bytes, seconds of its matrix units at a GEMM correction of
    1, whether that is a GEMM's (which the correction divides); launches apart."""
    from jamp.inspect.timing import Rates, kernel_parts

    unit = Rates(launch=0.0, matmul=1.0, **FIXED)
    parts = [(k.count, *kernel_parts(k, gpu, unit), k.kind == "gemm") for k in kernels]
    return [np.array(column, dtype=float) for column in zip(*parts)]


def _grid_totals(parts) -> np.ndarray:
    """The predicted seconds of one program at every (launch, correction) of the grid."""
    count, memory, compute, gemm = parts
    scaled = np.where(gemm[None, :] > 0, compute[None, :] / CORRECTIONS[:, None], compute)
    busy = (count * np.maximum(memory[None, :], scaled)).sum(axis=1)  # per correction
    return LAUNCHES[:, None] * count.sum() + busy[None, :]


def fit(found: dict, gpu):
    """The launch cost and GEMM correction minimising the largest relative error over `found`
    (variant -> kernels), on a grid; returns (rates, {variant: predicted seconds})."""
    from jamp.inspect.timing import Rates

    totals = {v: _grid_totals(_parts(k, gpu)) for v, k in found.items()}
    worst = np.max([np.abs(t * 1e3 / MEASURED[v] - 1) for v, t in totals.items()], axis=0)
    i, j = np.unravel_index(np.argmin(worst), worst.shape)
    rates = Rates(launch=float(LAUNCHES[i]), matmul=float(CORRECTIONS[j]), **FIXED)
    return rates, {v: float(t[i, j]) for v, t in totals.items()}


def leave_one_out(found: dict, gpu) -> dict:
    """Each measured row predicted by the model fitted to the others: {variant: error}."""
    errors = {}
    for out in found:
        rates, _ = fit({v: k for v, k in found.items() if v != out}, gpu)
        errors[out] = _total(found[out], gpu, rates) * 1e3 / MEASURED[out] - 1
    return errors


def calibrate(measured_dir: pathlib.Path, now_dir: pathlib.Path) -> None:
    from jamp.target import GPUS

    gpu = GPUS["h200"]
    sources = {
        v: (measured_dir if (measured_dir / f"{v}.hlo").exists() else now_dir) / f"{v}.hlo"
        for v in MEASURED
    }
    found = {v: _kernels(p) for v, p in sources.items()}
    rates, predicted = fit(found, gpu)
    held_out = leave_one_out(found, gpu)
    rows = []
    for v in MEASURED:
        p = predicted[v] * 1e3
        rows.append(
            {
                "variant": v,
                "measured_ms": MEASURED[v],
                "predicted_ms": round(p, 2),
                "error": round(p / MEASURED[v] - 1, 4),
                "leave_one_out_error": round(held_out[v], 4),
                "hlo": str(sources[v]),
            }
        )
    variants = variant_rows(now_dir, gpu, rates)
    error = max(abs(e) for e in held_out.values())
    result = {
        "rates": rates.__dict__,
        "fixed": FIXED,
        "calibration": rows,
        "error": error,
        "variants": variants,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_estimate_h200.json").write_text(json.dumps(result, indent=1, default=str))
    (RESULTS / "gpu_estimate_h200.md").write_text(_markdown(result))
    print(json.dumps({"rates": rates.__dict__, "calibration": rows}, indent=1))


def variant_rows(now_dir: pathlib.Path, gpu, rates) -> list[dict]:
    """Each dumped program's estimate, with its batch and predicted MFU where its dump has them."""
    from jamp.hlo.text import parse
    from jamp.inspect.timing import estimate

    rows = []
    for path in sorted(now_dir.glob("*.hlo")):
        est = estimate(parse(path.read_text()), gpu, rates)
        info_path = path.with_suffix(".json")
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        row = {"variant": path.stem, "batch": info.get("batch", 8), **est.to_dict()}
        if "flops" in info:  # dumps before the MFU column have no FLOPs
            row["predicted_mfu"] = info["flops"] / est.seconds / (gpu.bf16_tflops * 1e12)
        rows.append(row)
    return rows


def _markdown(result) -> str:
    run = run_record(" ".join(["python experiments/gpu_estimate.py", *sys.argv[1:]]), 0)
    r = result["rates"]
    lines = [
        "# The step-time model of jamp.compile_for, calibrated on one H200",
        "",
        f"Compiled for an H200 on {run['machine']}, {run['date']}; {run['versions']}. "
        "The model (jamp.inspect.timing) is a model, not a measurement: per kernel of the "
        "optimized program, launch + max(bytes / (4.8 TB/s x memory), FLOPs / (peak x share)), "
        "a GEMM's share its shape's and dtype's (jamp.inspect.gemm_rate: waves of 128 x 128 "
        "tiles on 132 SMs, split-K, a tile's fixed cost, fitted to public matmul measurements; "
        "fp8 at its own share of its own peak), float32 GEMMs at the TF32 rate.",
        "",
        f"Fitted: launch {r['launch'] * 1e6:.1f} us; GEMM correction {r['matmul']:.2f} (held: the "
        f"public fits as they are); held: memory share {r['memory']:.2f}, attention share "
        f"{r['attention']:.2f}. Leave-one-out: each row predicted by the model fitted to the "
        f"other two; the largest such error, {result['error']:.1%}, is the range every "
        "prediction is given with.",
        "",
        "## Calibration: the three JAX rows measured on one H200 (docs/results.md, On an H200)",
        "",
        "Hugging Face Flax GPT-2 small, batch 8 x 1024, AdamW; measured with jax 0.11.2 (the "
        "jamp row at 63141af, its program dumped from a worktree of that commit).",
        "",
        "| step | measured ms | predicted ms | error | leave-one-out error |",
        "|---|---|---|---|---|",
    ]
    for c in result["calibration"]:
        lines.append(
            f"| {c['variant']} | {c['measured_ms']:.2f} | {c['predicted_ms']:.2f} "
            f"| {c['error']:+.1%} | {c['leave_one_out_error']:+.1%} |"
        )
    lines += [
        "",
        "## This tree's GPT-2-small variants (experiments/gpt2_variants.py), predicted",
        "",
        "Predicted MFU: PaLM's model FLOPs (6 N + 12 L T E per token) over the predicted time, "
        "against the dense bf16 peak (989 TFLOP/s); a prediction, as the time is.",
        "",
        "| variant | batch | predicted ms | range (leave-one-out) | predicted MFU | kernels "
        "| of it launches ms | GEMM ms | attention ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in result["variants"]:
        kinds = v["by_kind"]
        gemm = kinds.get("gemm", {}).get("seconds", 0) * 1e3
        attention = kinds.get("attention", {}).get("seconds", 0) * 1e3
        mfu = f"{v['predicted_mfu']:.1%}" if "predicted_mfu" in v else "-"
        low, high = (v["seconds"] * 1e3 * (1 + e) for e in (-result["error"], result["error"]))
        lines.append(
            f"| {v['variant']} | {v['batch']} | {v['seconds'] * 1e3:.2f} | {low:.1f}-{high:.1f} "
            f"| {mfu} | {v['kernels']} | {v['launch_seconds'] * 1e3:.2f} | {gemm:.2f} "
            f"| {attention:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", type=pathlib.Path, help="compile the variants, write HLO here")
    parser.add_argument("--variants", nargs="*", default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (dump)")
    parser.add_argument("--calibrate", nargs=2, type=pathlib.Path, metavar=("MEASURED", "NOW"))
    args = parser.parse_args(argv)
    if args.dump:
        import gpt2_variants

        dump(args.dump, args.variants or gpt2_variants.VARIANTS, args.quick, args.batch)
    if args.calibrate:
        calibrate(*args.calibrate)


if __name__ == "__main__":
    main()
