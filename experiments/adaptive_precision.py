"""Adaptive precision on a network with an fp16-fragile block, and the window k-of-n it needs.

    python experiments/adaptive_precision.py               # ~3 min on 2 cores
    python experiments/adaptive_precision.py --steps 200 --seeds 1   # quick

The network is the default recipe's seed CNN on digits with `hidden_gain=1e5`: its dense 256
layer is drawn 1e5 times larger and layer-normalized after, a pre-norm projection with
"massive activations" (large LMs grow such activations in their residual streams). The
activations are carried in the compute dtype (`activations=compute`, the GPU default), so under
mixed_float16 that layer's output passes float16's 65504 on every step, in that module only:
seen below in the first skipped step's gradient flags (every module non-finite: the forward pass
overflowed, so only the forward flags can say where). Four runs per seed, all the real
program (`python -m jamp.train`): float32 (on CPU: true fp32 matmuls), mixed_bfloat16,
mixed_float16 and mixed_float16 with `--config.adaptive_precision=true`.

Then fp16 runs without a forward-fragile block, adaptive off and on: the default recipe, the
same with a scale that regrows every 20 steps, the LM recipe, and the seed CNN whose first
convolution has 1e4 times larger gradients (`stem_multiplier`), to count how often the loss
scale's own search skips steps (k must stay above it), to see what the controller does with a
module that forces the whole model's scale down, and what adaptive precision costs per step.

Writes experiments/results/adaptive_precision_cpu.md (the table, the promotion log) and
adaptive_precision_cpu.png (loss, loss scale and promotions over steps).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import runpy
import statistics
import tempfile

from _accuracy import records, train
from _harness import RESULTS, ROOT
from _harness.environment import cpu_description, today, versions
from _harness.plots import pyplot, save
from _harness.tables import write_page

ORDER = ("Conv_0", "Conv_1", "Dense_0", "LayerNorm_0", "Dense_1")  # the model's param groups
FRAGILE = ["--config.model_config={'hidden_gain': 1e5}", "--config.activations=compute"]
RUNS = {
    "float32": ["--config.policy=float32"],
    "mixed_bfloat16": ["--config.policy=mixed_bfloat16"],
    "mixed_float16": ["--config.policy=mixed_float16"],
    "mixed_float16 + adaptive": [
        "--config.policy=mixed_float16",
        "--config.adaptive_precision=true",
    ],
}


def cli(workdir, flags, steps, seed, config=None):
    """A program run of `steps` steps at `seed`, logged every 10: (the process, its records)."""
    steps_seed = [f"--config.num_train_steps={steps}", f"--config.seed={seed}"]
    return train([*steps_seed, "--config.log_every_steps=10", *flags], workdir, config)


def outcome(out, run_records):
    evals = records(run_records, "eval")
    if out.returncode == 3:
        stop = [x for x in out.stderr.splitlines() if "training stopped" in x]
        # "error: training stopped at step 120: the last ..." -> "training stopped at step 120"
        where = stop[0].split(":")[1].strip() if stop else "stopped"
        return None, f"{where} (persistent overflow)"
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return evals[-1]["accuracy"], "finished"


def max_in_window(steps: list[int], n: int) -> int:
    """The most of `steps` (skipped steps of one module) inside any n consecutive steps."""
    steps = sorted(steps)
    best, lo = 0, 0
    for hi, s in enumerate(steps):
        while s - steps[lo] >= n:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


SIDE = (
    ("default recipe (seed CNN, digits)", None, []),
    ("default recipe, scale regrows every 20 steps", None, ["--config.loss_scale_params.growth_interval=20"]),
    ("seed CNN, stem_multiplier=1e4 (backward-fragile first conv)", None, ["--config.model_config={'stem_multiplier': 1e4}"]),
    ("lm_pydoc (Transformer LM), regrows every 20", "configs/lm_pydoc.py", ["--config.loss_scale_params.growth_interval=20"]),
)  # fmt: skip


def side_by_side(tmp, steps):
    """fp16 runs without a forward-fragile block, adaptive off and on (activations in the
    compute dtype): how often the loss scale's own search skips steps, what the controller
    does about it, and the throughput with and without it (alternated: the machine is shared)."""
    rows = []
    for i, (name, config, flags) in enumerate(SIDE):
        base = ["--config.policy=mixed_float16", "--config.activations=compute", *flags]
        speeds, kept = {}, {}
        for j, on in enumerate(("false", "true", "false", "true")):
            out, run_records = cli(tmp / f"side{i}_{j}", [f"--config.adaptive_precision={on}",
                               *base], steps, 0, config)  # fmt: skip
            if out.returncode:
                raise SystemExit(out.stderr[-2000:])
            line = next(x for x in out.stdout.splitlines() if x.startswith("throughput"))
            speeds.setdefault(on, []).append(float(line.split()[-1]))
            kept[on] = run_records
        per_module: dict[str, list[int]] = {}
        for r in records(kept["false"], "overflow"):
            for m in r["grads_nonfinite"]:
                per_module.setdefault(m, []).append(r["step"])
        worst = max((max_in_window(v, 50) for v in per_module.values()), default=0)
        metric = "perplexity" if config else "accuracy"

        def final(on, what, kept=kept, metric=metric):
            if what == "scale":
                return records(kept[on], "train")[-1]["loss_scale"]
            return records(kept[on], "eval")[-1][metric]

        changes = [f"{c['module']} -> {c['to_dtype']} at {c['step']}"
                   for c in records(kept["true"], "precision_change")]  # fmt: skip
        rows.append({
            "run": name,
            "skipped (off)": records(kept["false"], "train")[-1]["skipped_steps"],
            "most skips of one module in 50 steps (off)": worst,
            "promotions (on)": ", ".join(changes) or "none",
            "final loss scale off / on": f"{final('false', 'scale'):g} / {final('true', 'scale'):g}",
            f"eval {metric} off / on": f"{final('false', 'm'):.4f} / {final('true', 'm'):.4f}",
            "throughput on / off": f"{statistics.mean(speeds['true']) / statistics.mean(speeds['false']):.2f}x",
        })  # fmt: skip
    return rows


def flag_cost(reps=5, steps=50):
    """The per-module forward flags' cost: the jitted train step with and without them, same
    state and batch, interleaved; median of `reps` timings of `steps` steps each."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from _harness.timing import interleaved, stepper

    from jamp.step import make_train_step
    from jamp.train import loop, tasks
    from jamp.train.optim import make_optimizer

    rows = []
    for recipe in ("configs/default.py", "configs/lm_pydoc.py"):
        config = runpy.run_path(str(ROOT / recipe))["get_config"]()
        config.policy, config.activations = "mixed_float16", "compute"
        run, data_cfg, optim_cfg, task = loop.parse_config(config)
        dataset, model = loop.build_model(run, data_cfg, task)
        tx, _ = make_optimizer(optim_cfg)
        state = loop.init_state(model, tx, run.loss_scale, dataset.info, 0)
        batch = next(dataset.train_batches(0))
        batch = {k: jnp.asarray(v) for k, v in batch.items() if k != "mask"}
        fns = {
            on: jax.jit(make_train_step(tasks.make_loss_fn(model, task, forward_flags=on), tx))
            for on in (False, True)
        }
        runners = {on: stepper(fn, state, batch, jax.random.key(0)) for on, fn in fns.items()}
        for run_step in runners.values():  # compile both first
            jax.block_until_ready(run_step())
        times = interleaved(runners, reps, steps)
        off, on = np.median(times[False]), np.median(times[True])
        rows.append((recipe, off * 1e3, on * 1e3, on / off))
    return rows


def write_flag_cost():
    rows = flag_cost()
    lines = [
        "# The per-module forward flags' cost (adaptive precision's per-step record)",
        "",
        f"Machine: {cpu_description()}; {versions('jax', 'flax', python_first=True)}. {today()}, "
        "`python experiments/adaptive_precision.py --part flags`: the jitted train step "
        "(mixed_float16, activations in the compute dtype) with and without "
        "`make_loss_fn(..., forward_flags=True)`, same state and batch, alternated, median of 5 "
        "x 50 steps.",
        "",
        "| recipe | step without (ms) | step with (ms) | with / without |",
        "|---|---|---|---|",
        *(f"| {r} | {a:.2f} | {b:.2f} | {c:.3f}x |" for r, a, b, c in rows),
    ]
    write_page(RESULTS / "adaptive_precision_flags_cpu.md", lines)


def plot(curves, changes, path):
    plt = pyplot()
    if plt is None:
        return False
    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run_records in curves.items():
        train = records(run_records, "train")
        steps = [r["step"] for r in train]
        ax_loss.plot(steps, [r["loss"] for r in train], label=name)
        if name.startswith("mixed_float16"):  # the others have no loss scale
            ax_scale.plot(steps, [r["loss_scale"] for r in train], label=name)
            stops = [r["step"] for r in train if name == "mixed_float16"][-1:]
            for at in stops:  # plain fp16's loss is nan throughout: mark where it stopped
                ax_loss.axvline(at, color="tab:green", linestyle="--")
                ax_loss.annotate(f"mixed_float16 stopped at {at}", (at, 0.3), fontsize=8)
    for c in changes:
        for ax in (ax_loss, ax_scale):
            ax.axvline(c["step"], color="grey", linestyle=":")
        ax_loss.annotate(f"{c['module']} -> {c['to_dtype']}", (c["step"], 1.0), fontsize=8)
    ax_loss.set(yscale="log", xlabel="step", ylabel="training loss (10-step mean; nan: gaps)",
                title="seed CNN + fragile pre-norm block, seed 0")  # fmt: skip
    ax_loss.legend(fontsize=8)
    ax_scale.set(yscale="log", xlabel="step", ylabel="loss scale", title="dynamic loss scale")
    ax_scale.legend(fontsize=8)
    return save(fig, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--side_steps", type=int, default=1000)
    parser.add_argument("--part", choices=("all", "flags"), default="all",
                        help="flags: only the forward flags' cost")  # fmt: skip
    args = parser.parse_args()
    write_flag_cost()
    if args.part == "flags":
        return
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="adaptive_"))
    results, curves, log = {}, {}, []
    for seed in range(args.seeds):
        for name, flags in RUNS.items():
            out, run_records = cli(tmp / f"{name}_{seed}".replace(" ", ""), FRAGILE + flags,
                               args.steps, seed)  # fmt: skip
            results.setdefault(name, []).append(outcome(out, run_records))
            if seed == 0:
                curves[name] = run_records
                if "adaptive" in name:
                    log = [x for x in out.stderr.splitlines() if "now computes in" in x]
                    changes = records(run_records, "precision_change")
                    summary = [x for x in out.stdout.splitlines() if x.startswith("precision")]
                if name == "mixed_float16":
                    first = records(run_records, "overflow")[:1]
    side = side_by_side(tmp, args.side_steps)
    worst_key = "most skips of one module in 50 steps (off)"
    ref = [a for a, _ in results["float32"]]
    lines = [
        "# Adaptive precision: a fragile pre-norm block under mixed_float16",
        "",
        f"Machine: {cpu_description()}; {versions('jax', 'flax', python_first=True)}. "
        f"{today()}, `python experiments/adaptive_precision.py --steps {args.steps}"
        f" --seeds {args.seeds}`. float32 here is true fp32 matmuls (CPU: no TF32).",
        "",
        f"Seed CNN on digits, `hidden_gain=1e5`, activations in the compute dtype, {args.steps} "
        "steps, batch 64, Adam 1e-3; eval accuracy on the 360 test digits.",
        "",
        "| run | " + " | ".join(f"seed {s}" for s in range(args.seeds)) + " | vs float32 (mean) |",
        "|---|" + "---|" * args.seeds + "---|",
    ]
    for name, rows in results.items():
        cells = [f"{a:.4f}" if a is not None else how.replace("training ", "") for a, how in rows]
        accs = [a for a, _ in rows]
        diff = (
            f"{statistics.mean(a - r for a, r in zip(accs, ref)) * 100:+.2f} points"
            if None not in accs
            else "—"
        )
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {diff} |")
    lines += [
        "",
        "Why plain fp16 fails, measured: the first skipped step's non-finite gradients were in "
        f"{first[0]['grads_nonfinite'] if first else '—'} "
        f"({'all of them: the forward pass overflowed' if first and len(first[0]['grads_nonfinite']) == len(ORDER) else 'not all of them'}); "
        "the adaptive run's per-module forward flags traced it to the module its log names "
        "below.",
        "",
        "Promotion log of the adaptive run, seed 0 (console):",
        "",
        "```",
        *log,
        *summary,
        "```",
        "",
        f"metrics.jsonl events: {json.dumps(changes)}",
        "",
        "## Without a forward-fragile block: what the loss scale skips, what the controller does",
        "",
        f"{args.side_steps} steps each, mixed_float16, activations in the compute dtype, adaptive "
        "precision off and on (k = 6 of n = 50).",
        "",
        "| " + " | ".join(side[0]) + " |",
        "|" + "---|" * len(side[0]),
        *("| " + " | ".join(str(v) for v in row.values()) + " |" for row in side),
        "",
        "Choosing k: a skip the loss scale resolves (a growth that overflows, the search at the "
        "start for a model whose modules all fit one scale) came at most "
        f"{max(r[worst_key] for r in side if r['promotions (on)'] == 'none')} times per module "
        "in a 50-step window here, so k = 6 leaves a margin; a module that overflows on every step "
        "reaches k on the 6th step. The stem case is the other side of that line: its first "
        "convolution alone overflows while the scale searches downward for it (all its skips "
        "blame Conv_0 only), and without adaptation the whole model then trains at the scale "
        "that one module fits (the final scales above); promoted to bfloat16 at the 6th such "
        "step, it no longer constrains the scale. Throughput: examples/s of the run after its first step, two runs each, "
        "alternated; the per-module forward flags themselves cost nothing measurable (a "
        "jitted step with and without them: 0.90x-1.00x the time, noise); what costs on the "
        "digits step (a few ms) is reading the metrics every k steps, and, when it promotes, one "
        "more compile.",
        "",
    ]
    write_page(RESULTS / "adaptive_precision_cpu.md", lines)
    plot(curves, changes, RESULTS / "adaptive_precision_cpu.png")


if __name__ == "__main__":
    main()
