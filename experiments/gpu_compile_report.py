"""The table and plot of experiments/gpu_compile.py, from its JSON (rerun alone to redraw)."""

from __future__ import annotations

import json
import pathlib
import sys

from _harness.plots import pyplot, save
from _harness.tables import GIB, gib, gib_parts

_CLASSES = ("f32", "bf16", "f16", "fp8", "int", "workspace", "other", "free")


def largest_text(row) -> str:
    found = row.get("largest")
    if not found:
        return ""
    if found.get("batch") is None:
        if not found.get("complete"):
            return f"not searched ({found.get('above')}: no)"
        return f"none ({found.get('above')}, the smallest, does not)"
    text = str(found["batch"])
    if found.get("above") is not None:
        text += f" ({found['above']}: no)"
    if not found.get("complete"):
        text += ", searched no further"
    return text


def _gpt2_table(rows) -> list[str]:
    lines = [
        "| step | batch | temporaries GiB | peak GiB | temporaries at their peak, by dtype (GiB) "
        "| attention fused / unfused | f32 GEMMs | compile s | largest batch that fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['batch']} | {gib(r['temp'])} | {gib(r['peak'])} | "
            f"{gib_parts(r['by_dtype'], 0.005 * GIB)} | "
            f"{r['fused_attention']} / {r['unfused_attention']} | "
            f"{r['fp32_gemms']} | {r['compile_s']} | {largest_text(r)} |"
        )
    return lines


def _wire(row) -> str:
    by = {}
    for c in row.get("wire", []):
        key = f"{c['kind']} {c['dtype']}"
        by[key] = by.get(key, 0) + c["bytes"]
    return ", ".join(f"{k} {gib(v)}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])) or "-"


def _decoder_table(rows) -> list[str]:
    lines = [
        "| model, policy, layout | global batch | arguments (state) GiB | temporaries GiB | "
        "peak GiB | fits | collectives per step, GiB per device (result bytes) | "
        "compile s | largest global batch that fits | state room (B params) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fits = "yes" if r["peak"] <= r["usable"] else "**no**"
        lines.append(
            f"| {r['label']} | {r['batch']} | {gib(r['arguments'])} | {gib(r['temp'])} | "
            f"{gib(r['peak'])} | {fits} | {_wire(r)} | {r['compile_s']} | {largest_text(r)} | "
            f"{_room(r)} |"
        )
    return lines


def _room(row) -> str:
    """Parameters whose state (at this row's bytes per parameter per device) would fit in the
    pool beside this row's temporaries: an upper bound on the largest model at this batch,
    since a larger model's activations grow too."""
    if not row.get("params") or not row.get("arguments"):
        return ""
    per_param = row["arguments"] / row["params"]
    room = (row["usable"] - (row["peak"] - row["arguments"])) / per_param
    return f"{max(room, 0) / 1e9:.1f}"


def _plot(results, path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    gpt2 = [r for r in results.get("gpt2", []) if r["batch"] == 8]
    decoders = results.get("decoders", [])
    panels = [p for p in (gpt2, decoders) if p]
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4.2 * len(panels)), squeeze=False)
    colors = dict(
        zip(
            _CLASSES,
            (
                "#d62728",
                "#1f77b4",
                "#17becf",
                "#9467bd",
                "#8c564b",
                "#7f7f7f",
                "#bcbd22",
                "#dddddd",
            ),
        )
    )
    for ax, rows in zip(axes[:, 0], panels):
        labels = [r["label"].replace("hand-written ", "hand ").replace("jamp ", "") for r in rows]
        bottom = [0.0] * len(rows)
        if rows is decoders:
            values = [r["arguments"] / GIB for r in rows]
            ax.barh(labels, values, color="#2ca02c", label="arguments (state)")
            bottom = values
        for cls in _CLASSES:
            values = [r["by_dtype"].get(cls, 0) / GIB for r in rows]
            if any(values):
                ax.barh(labels, values, left=bottom, color=colors[cls], label=f"temp {cls}")
                bottom = [b + v for b, v in zip(bottom, values)]
        usable = rows[0]["usable"] / GIB
        if rows is decoders:
            ax.axvline(usable, color="k", ls="--", lw=1, label="JAX's pool (75 % of HBM)")
            ax.set_title("Llama-style decoders on 8 x H200: per device, XLA's plan")
        else:
            ax.set_title("GPT-2-small shape, batch 8, one H200: step temporaries by dtype")
        ax.set_xlabel("GiB")
        ax.invert_yaxis()
        ax.legend(fontsize=7, loc="lower right")
    save(fig, path, dpi=110)


_TITLES = {
    "step_cost": "the train step's own cost",
    "gpt2": "GPT-2 small",
    "decoders": "decoders",
    "models": "NNX models",
    "master_weights": "master weights",
}


def _master_table(rows) -> list[str]:
    lines = [
        "| params and optimizer state | state bytes per param (params + optimizer) | deepest "
        "that fits (layers) | parameters | vs the first row | arguments (state) GiB | "
        "temporaries GiB | peak GiB | compiles (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    first = rows[0]["params"] if rows else 1
    for r in rows:
        b = r["bytes_per_param"]
        deepest = str(r["layers"]) if r["fits"] else f"none ({r['layers']} does not)"
        if r["fits"] and r.get("above") is not None:
            deepest += f" ({r['above']}: no)"
        if not r["complete"]:
            deepest += ", searched no further"
        lines.append(
            f"| {r['label']} | {b['total']:.2f} ({b['params']:.2f} + {b['opt_state']:.2f}) | "
            f"{deepest} | {r['params'] / 1e9:.2f} B | {r['params'] / first:.2f}x | "
            f"{gib(r['arguments'])} | {gib(r['temp'])} | {gib(r['peak'])} | "
            f"{r['compiles']} ({r['seconds']:.0f}) |"
        )
    return lines


def _runs(results) -> list[str]:
    lines = []
    for part, run in results.get("runs", {}).items():
        if results.get(part) and "date" in run:
            lines.append(
                f"- {_TITLES.get(part, part)}: {run['date']}, compiled on {run['machine']}; "
                f"{run['versions']}. Command: `{run['command']}` ({run['minutes']} min"
                + (f"; {run['note']}" if run.get("note") else "")
                + ")."
            )
        for again in run.get("reruns", []) if results.get(part) else ():
            lines.append(
                f"  - its {again['rows']} rows rerun {again['date']} on {again['machine']}; "
                f"{again['versions']}. Command: `{again['command']}` ({again['minutes']} min"
                + (f"; {again['note']}" if again.get("note") else "")
                + ")."
            )
    return lines + [""] if lines else []


def _step_cost_tables(rows) -> list[str]:
    def key(r):  # the plain step of the same model at the same commit
        return r["variant"].split("_")[0], bool(r.get("before"))

    plain = {key(r): r for r in rows if "plain" in r["variant"]}
    lines = [
        "| step | kernels | vs plain step | gradients written for the check | of them reducing "
        "| besides them | norm + finite kernels | predicted ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = plain.get(key(r))
        ratio = f"{r['kernels'] / base['kernels']:.3f}x" if base else "-"
        rest = f"{(r['kernels'] - r['shared']) / base['kernels']:.3f}x" if base else "-"
        if r.get("before"):  # its checks had no name scope to find them by
            shared = reducing = rest = stats = "-"
        else:
            shared, stats = r["shared"], r["stats_kernels"]
            reducing = r.get("shared_reducing", "-")
        lines.append(
            f"| {r['label']} | {r['kernels']} | {ratio} | {shared} | {reducing} | {rest} "
            f"| {stats} | {r['predicted_ms']:.2f} |"
        )
    jamp = next((r for r in rows if r["variant"] == "lm_jamp_bf16" and not r.get("before")), None)
    if jamp:
        lines += [
            "",
            f"Where the predicted {jamp['predicted_ms']:.2f} ms of jamp's bf16 GPT-2-small step "
            "go (the loss written with optax):",
            "",
            "| work | kernels | predicted ms | share |",
            "|---|---|---|---|",
        ]
        for name, c in sorted(jamp["categories"].items(), key=lambda kv: -kv[1]["ms"]):
            lines.append(
                f"| {name} | {c['kernels']} | {c['ms']:.2f} | {c['ms'] / jamp['predicted_ms']:.0%} |"
            )
    return lines


def write(results, out: pathlib.Path, *, fraction: float, target):
    lines = [
        "# jamp's steps compiled for the H200 on a CPU (experiments/gpu_compile.py)",
        "",
        *_runs(results),
        "Every figure is XLA's buffer assignment for the target (per device), not a measured "
        "peak: it says what is live and in which dtype, not how fast. Every step is compiled "
        "without XLA's rematerialization pass (which, near the memory's size, recomputes "
        "activations to make a step fit, trading time). Peak = arguments + "
        "unaliased outputs + temporaries. 'Fits' and 'largest batch' use the memory JAX's "
        f"allocator takes by default, {fraction:.0%} of the {target.gpu.hbm_bytes / GIB:.1f} GiB "
        "the driver reports for an H200 (XLA_PYTHON_CLIENT_MEM_FRACTION); the largest batch is "
        "searched by compiling (plan.search_batch), to within 1/32. fp32 matmuls on the GPU are "
        "TF32 at JAX's default precision.",
        "",
    ]
    if results.get("gpt2"):
        lines += ["## GPT-2-small shape on one H200 (12 x 768, seq 1024, vocab 50304, AdamW)", ""]
        lines += _gpt2_table(results["gpt2"]) + [""]
    if results.get("decoders"):
        lines += [
            "## Llama-style decoders (configs/llama.py) on 8 x H200",
            "",
            "State room: how many parameters' state (at the row's bytes per parameter per "
            "device) would fit in the pool beside the row's temporaries — an upper bound on the "
            "largest model at that batch, since a larger model's activations grow too.",
            "",
        ]
        lines += _decoder_table(results["decoders"]) + [""]
    if results.get("models"):
        lines += [
            "## NNX models on one H200, batch 8: wrapped by jamp against their own bf16 build",
            "",
            'The fp32 model, the fp32 model under `jamp.wrap(model, "mixed_bfloat16")`, and '
            "the model's own bf16 build (experiments/gpu_compile_models.py says which), AdamW, "
            "jamp's train step. Attention fused: cuDNN's forward calls (one per layer); unfused: "
            "sites of matmuls + softmax (NNX modules set no name scopes, so one site may hold "
            "every layer).",
            "",
        ]
        lines += _gpt2_table(results["models"]) + [""]
    if results.get("step_cost"):
        lines += [
            "## The train step's own cost: kernels and predicted time on one H200, batch 8",
            "",
            "GPT-2-small widths (Llama: 12 x 768, MLP 2048, 4 kv heads, vocab 32000), "
            "`mixed_bfloat16`, AdamW, the loss written with optax (jamp.losses where the row "
            "says so). Kernels: launches per step of the H200 program. Plain step: "
            "`jax.value_and_grad` + `optax.adamw` on the same wrapped model, which casts each "
            "weight matrix to bf16 every step; jamp's step keeps those bf16 copies in the state "
            "(`TrainState.create(..., compute_dtype=...)`), written by the update, so 'besides "
            "them' may fall below 1. Gradients written "
            "for the check: loop fusions XLA writes out because both the finite check and the "
            "update read them (a plain step's update fuses them in); of them reducing: those "
            "whose kernel ends in a reduction (a split-K GEMM's sum of its partial products, a "
            "two-row bias sum), which XLA:GPU fuses into the update but not into the check's "
            "own reduction. Predicted: "
            "jamp.inspect.timing's model of the program, calibrated on three measured H200 "
            "steps (a model, not a measurement). '(before)': the same program at the earlier "
            "commit named in the run record.",
            "",
        ]
        lines += _step_cost_tables(results["step_cost"]) + [""]
    if results.get("master_weights"):
        lines += [
            "## Past float32 master weights: the deepest model that fits on 8 x H200 (fsdp=8)",
            "",
            "Llama-2-70B's widths (d_model 8192, 64 heads, 8 kv heads, MLP 28672, vocab 32000), "
            "AdamW, sequence 512, one sequence per device, `mixed_bfloat16` compute, each layer "
            'rematerialized keeping its matmuls\' outputs (`remat="dots"`: without it XLA keeps '
            "every weight gathered for the forward until the backward, a whole model in bf16 on "
            "each device); the layer count searched by compiling (two shallow compiles, a chosen "
            "depth, then plan.search_batch to within 1/32 of the depth or its compile budget). "
            "Arguments = the train state per device (params, optimizer state); gradients are "
            "temporaries. Compiled without same-shape multi-output fusion (compile time only).",
            "",
        ]
        lines += _master_table(results["master_weights"]) + [""]
    out.with_suffix(".md").write_text("\n".join(lines))
    _plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    stem = pathlib.Path(
        sys.argv[1] if len(sys.argv) > 1 else "experiments/results/gpu_compile_h200"
    )
    from jamp.target import get_target, memory_fraction

    write(
        json.loads(stem.with_suffix(".json").read_text()),
        stem,
        fraction=memory_fraction(),
        target=get_target("h200"),
    )
