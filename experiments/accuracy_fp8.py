"""fp8 at equal budget: mixed_fp8 (delayed and current scaling) against float32 and mixed_bfloat16.

    cd /work/main && python experiments/accuracy_fp8.py              # 2 recipes, 2 seeds, ~27 min
    cd /work/main && python experiments/accuracy_fp8.py --recipes lm --seeds 1 --steps 100
    cd /work/main && python experiments/accuracy_fp8.py --recipes digits --seeds 1 --steps 20

Every jamp run is the real training program (`python -m jamp.train`) with only the policy, the fp8
recipe and the seed changed, so each policy gets the same init, data order, steps and optimizer:

* lm: configs/lm_pydoc.py (byte-level Transformer LM on CPython's pydoc text, 600 steps);
  metric: the final test loss in nats per byte;
* digits: configs/default.py (the seed CNN on scikit-learn's 8x8 digits, 1000 steps), as
  accuracy_digits.py runs it; metric: the final eval accuracy (300 test images).

Policies: float32, mixed_bfloat16 (the reference: fp8 replaces its bf16 layer matmuls), and
mixed_fp8 with `--config.fp8_recipe=delayed` and `=current` (E4M3 operands forward, E5M2 gradients
backward, fp32 accumulation; the output head, embeddings and convolutions stay bf16).

On the LM it also trains the Flax peer (experiments/_fp8_peer.py): the same TransformerLM
structure written with `flax.linen.fp8_ops.Fp8DirectDotGeneralOp` as the layers' dot_general
class, bf16 everywhere else, trained by a hand-written step on the program's data, init and
optimizer; and the same peer without fp8 (its bf16 reference, so its fp8 cost can be read off the
same way).

The bar (the issue's): mixed_fp8 within 2 % of mixed_bfloat16's test loss on the LM and within 0.5
accuracy points on digits, as the mean of the per-seed (paired) differences. It writes
experiments/results/accuracy_fp8_cpu.md (tables, verdicts) and .png (training loss per policy for
each recipe, and the amax and scale of one fp8 site of the delayed run over steps). On a CPU the
fp8 matmuls are emulated (XLA converts to float32): the numbers are about accuracy, not speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from _accuracy import RESULTS, ROOT, add_run_arguments, pyplot, records, run, versions
from _xla import cpu_description

REFERENCE = "mixed_bfloat16"
# label -> (policy, extra --config flags) of the program's runs
POLICIES = {
    "float32": ("float32", []),
    "mixed_bfloat16": ("mixed_bfloat16", []),
    "mixed_fp8 delayed": ("mixed_fp8", ["--config.fp8_recipe=delayed"]),
    "mixed_fp8 current": ("mixed_fp8", ["--config.fp8_recipe=current"]),
}
DELAYED = "mixed_fp8 delayed"
FP8 = ("mixed_fp8 delayed", "mixed_fp8 current")
# label -> _fp8_peer.py --dot
PEERS = {"flax fp8_ops (peer)": "fp8", "flax bf16 by hand (peer reference)": "bf16"}
PEER_FP8, PEER_REF = PEERS
RECIPES = {
    "lm": dict(
        config="configs/lm_pydoc.py",
        steps=600,
        metric="loss",
        title="byte-level Transformer LM on pydoc (configs/lm_pydoc.py)",
        bar=2.0,  # % of the reference's test loss
    ),
    "digits": dict(
        config=None,  # the program's default recipe, configs/default.py
        steps=1000,
        metric="accuracy",
        title="seed CNN on digits (configs/default.py)",
        bar=0.5,  # accuracy points
    ),
}


def overrides(recipe: str, steps: int) -> list[str]:
    if recipe == "lm":  # the recipe's 60 warmup steps of 600, also for shorter runs
        return [f"--config.warmup_steps={max(1, steps // 10)}"]
    return []


def run_peer(dot: str, seed: int, steps: int, workdir: pathlib.Path, data_dir: str):
    """One peer run on the LM recipe: (its metrics.jsonl records, None, its fp8 op count) or
    (None, the error's last line, None)."""
    cmd = [
        sys.executable, str(ROOT / "experiments" / "_fp8_peer.py"), f"--workdir={workdir}",
        f"--seed={seed}", f"--steps={steps}", f"--warmup={max(1, steps // 10)}", f"--dot={dot}",
    ]  # fmt: skip
    if data_dir:
        cmd.append(f"--data_dir={data_dir}")
    # The jamp of this checkout, as `python -m jamp.train` in ROOT imports it (not an install's).
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=path)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        return None, (lines[-1] if lines else f"exit status {out.returncode}"), None
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    sites = json.loads((workdir / "peer.json").read_text())["fp8_sites"]
    return [json.loads(line) for line in lines], None, len(sites)


def revision() -> str:
    """The checkout's commit, and whether jamp/ or configs/ differ from it (the code that ran)."""

    def git(*args):
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--", "jamp", "configs")
    return commit + (" with local changes in jamp/ or configs/" if dirty else "")


def final(run_records: list[dict], metric: str) -> float:
    return records(run_records, "eval")[-1][metric]


def mean_sd(values: list[float], scale: float = 1.0, digits: int = 4) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{scale * statistics.mean(values):.{digits}f} ± {scale * sd:.{digits}f}"


def diffs(values: list[float], ref: list[float], recipe: str) -> list[float]:
    """Per-seed differences to the reference: % of its loss (lm) or accuracy points (digits)."""
    if recipe == "lm":
        return [100 * (v - r) / r for v, r in zip(values, ref)]
    return [100 * (v - r) for v, r in zip(values, ref)]


def paired(d: list[float], digits: int = 2) -> str:
    text = f"{statistics.mean(d):+.{digits}f}"
    if len(d) > 1:
        text += f" [{min(d):+.{digits}f}, {max(d):+.{digits}f}]"
    return text


def first_site(run_records: list[dict]) -> str | None:
    """The first fp8 site the run's metrics name (jamp: the program's first fp8 matmul)."""
    for r in records(run_records, "train"):
        for key in r:
            if key.startswith("fp8/") and key.endswith("/x_amax"):
                return key[len("fp8/") : -len("/x_amax")]
    return None


def plot(curves: dict, recipes: list[str], path: pathlib.Path) -> bool:
    """Row 1: training loss per policy (seed 0); row 2: one delayed fp8 site's amax and scale."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, len(recipes), figsize=(6.5 * len(recipes), 8.5), squeeze=False)
    for col, recipe in enumerate(recipes):
        ax = axes[0][col]
        for label, run_records in curves[recipe].items():
            train, evals = records(run_records, "train"), records(run_records, "eval")
            style = ":" if label in PEERS else "-"
            (line,) = ax.plot([r["step"] for r in train], [r["loss"] for r in train], style,
                              label=label, linewidth=1.2)  # fmt: skip
            if recipe == "lm":
                ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o",
                        color=line.get_color(), markersize=4)  # fmt: skip
        ax.set(yscale="log", xlabel="step", ylabel="training loss (10-step window mean)",
               title=f"{recipe}: training loss, seed 0" +
               (" (dots: test loss)" if recipe == "lm" else ""))  # fmt: skip
        ax.legend(fontsize=8)
        ax = axes[1][col]
        delayed = curves[recipe].get(DELAYED)
        site = first_site(delayed) if delayed else None
        if site is None:
            ax.set_axis_off()
            continue
        train = records(delayed, "train")
        steps = [r["step"] for r in train]
        twin = ax.twinx()
        for row, what, color in (("x", "activation", "C0"), ("w", "weight", "C1"),
                                 ("g", "gradient", "C2")):  # fmt: skip
            ax.plot(steps, [r[f"fp8/{site}/{row}_amax"] for r in train], "-", color=color,
                    label=f"{row} ({what}) amax")  # fmt: skip
            twin.plot(steps, [r[f"fp8/{site}/{row}_scale"] for r in train], "--", color=color,
                      label=f"{row} scale")  # fmt: skip
        ax.set(yscale="log", xlabel="step", ylabel="amax (solid)",
               title=f"{recipe}, {DELAYED}, seed 0: {site}")  # fmt: skip
        ax.title.set_fontsize(8)
        twin.set(yscale="log", ylabel="scale = fmax / max(amax history) (dashed)")
        lines = ax.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, ncol=2, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def table(recipe: str, results: dict, seconds: dict, errors: dict) -> list[str]:
    spec = RECIPES[recipe]
    ref = results[REFERENCE]
    if recipe == "lm":
        head = (
            "| policy | test loss per seed (nats/byte) | mean ± sd | vs mixed_bfloat16, same "
            "seed (% of its loss) | s per run |"
        )
        fmt = {"digits": 4, "scale": 1.0}
    else:
        head = (
            "| policy | accuracy per seed | mean ± sd (points) | vs mixed_bfloat16, same seed "
            "(points) | s per run |"
        )
        fmt = {"digits": 2, "scale": 100.0}
    lines = [head, "|---|---|---|---|---|"]
    for label, values in results.items():
        if label in errors:
            lines.append(f"| {label} | failed: `{errors[label]}` | | | |")
            continue
        d = "(reference)" if label == REFERENCE else paired(diffs(values, ref, recipe))
        per_seed = ", ".join(f"{v:.4f}" for v in values)
        lines.append(
            f"| {label} | {per_seed} | {mean_sd(values, fmt['scale'], fmt['digits'])} | {d} "
            f"| {statistics.mean(seconds[label]):.0f} |"
        )
    lines.append("")
    unit = "% of the loss" if recipe == "lm" else "accuracy points"
    for label in FP8:
        d = diffs(results[label], ref, recipe)
        mean = statistics.mean(d)
        verdict = "within" if abs(mean) <= spec["bar"] else "OUTSIDE"
        lines.append(
            f"- {label} vs {REFERENCE}: {mean:+.2f} {unit} (mean over {len(d)} seeds; worst seed "
            f"{max(d, key=abs):+.2f}): {verdict} the bar of {spec['bar']:g} {unit}."
        )
    if recipe == "lm" and PEER_FP8 in results and not errors:
        d = diffs(results[PEER_FP8], results[PEER_REF], recipe)
        lines.append(
            f"- {PEER_FP8} vs {PEER_REF} (the peer's own fp8 cost, same seed): {paired(d)} {unit}."
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="0: each recipe's own (600, 1000)")
    parser.add_argument("--recipes", default="lm,digits", help="comma-separated: lm, digits")
    parser.add_argument("--no_peer", action="store_true", help="skip the Flax fp8_ops peer")
    parser.add_argument("--out", default=str(RESULTS / "accuracy_fp8_cpu.md"))
    add_run_arguments(parser)
    args = parser.parse_args()
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        parser.error(f"--recipes: unknown {unknown}; accepted: {', '.join(RECIPES)}")

    start = time.perf_counter()
    results = {r: {} for r in recipes}  # recipe -> label -> final metric per seed
    seconds = {r: {} for r in recipes}
    errors = {r: {} for r in recipes}  # recipe -> label -> the peer's error
    curves = {r: {} for r in recipes}  # seed 0's records
    skipped = {r: {} for r in recipes}
    peer_sites = {}  # peer label -> its number of flax fp8 ops
    config = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for recipe in recipes:
                spec = RECIPES[recipe]
                steps = args.steps or spec["steps"]
                jobs = [(label, None) for label in POLICIES]
                if recipe == "lm" and not args.no_peer:
                    jobs += [(label, dot) for label, dot in PEERS.items()]
                for label, dot in jobs:
                    workdir = pathlib.Path(tmp) / f"{recipe}-{label.replace(' ', '_')}-{seed}"
                    t0 = time.perf_counter()
                    if dot is None:
                        policy, extra = POLICIES[label]
                        run_records = run(policy, seed, steps, workdir, args.data_dir,
                                          spec["config"], overrides=overrides(recipe, steps) +
                                          extra, activations=args.activations)  # fmt: skip
                        config.setdefault(recipe, json.loads((workdir / "config.json").read_text()))
                    else:
                        run_records, error, n = run_peer(dot, seed, steps, workdir, args.data_dir)
                        peer_sites[label] = n
                        if error is not None:
                            errors[recipe][label] = error
                            results[recipe].setdefault(label, [])
                            print(f"{recipe:6s} {label:34s} seed {seed}: failed: {error}")
                            continue
                    seconds[recipe].setdefault(label, []).append(time.perf_counter() - t0)
                    value = final(run_records, spec["metric"])
                    results[recipe].setdefault(label, []).append(value)
                    train = records(run_records, "train")
                    skipped[recipe].setdefault(label, []).append(train[-1].get("skipped_steps", 0))
                    if seed == 0:
                        curves[recipe][label] = run_records
                    print(f"{recipe:6s} {label:34s} seed {seed}: {spec['metric']} {value:.4f}, "
                          f"{seconds[recipe][label][-1]:.0f} s", flush=True)  # fmt: skip
    minutes = (time.perf_counter() - start) / 60

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plotted = plot(curves, recipes, png)
    command = f"python experiments/accuracy_fp8.py --seeds {args.seeds} --recipes {args.recipes}"
    if args.steps:
        command += f" --steps {args.steps}"
    if args.no_peer:
        command += " --no_peer"
    if args.data_dir:
        command += f" --data_dir {args.data_dir}"
    if args.activations != "auto":
        command += f" --activations {args.activations}"
    runs = sum(len(v) for r in recipes for v in results[r].values())
    lines = [
        "# fp8 at equal budget: mixed_fp8 against float32 and mixed_bfloat16 (CPU, fp8 emulated)",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- command: `{command}` ({minutes:.1f} min for {runs} runs)",
        f"- jamp: commit {revision()}",
        f"- machine: {cpu_description()}, {os.cpu_count()} cores, CPU only (a VM shared with "
        "other jobs): fp8 matmuls are emulated (XLA converts the fp8 operands to float32), so the "
        "seconds say nothing about fp8 speed; " + versions("jax", "jaxlib", "flax", "optax", "jmp"),
        f"- each jamp run: `python -m jamp.train` with only --config.policy, --config.fp8_recipe "
        f"and --config.seed changed; activations={args.activations!r} (auto: float32 between "
        "matmuls on CPUs); mixed_fp8: amax history 16, margin 0 (the defaults); E4M3 operands "
        "forward, E5M2 gradients backward, fp32 accumulation; output head, embeddings and "
        "convolutions bf16",
        '- mean ± sd over seeds; "vs mixed_bfloat16" is the mean of the per-seed differences (a '
        "seed fixes the init and the data order for every policy) [smallest, largest]",
    ]
    for recipe in recipes:
        spec, c = RECIPES[recipe], config[recipe]
        steps = args.steps or spec["steps"]
        lines += ["", f"## {recipe}: {spec['title']}", ""]
        if recipe == "lm":
            m = c["model_config"]
            lines.append(
                f"{m['num_layers']}-layer Transformer, d_model {m['d_model']}, {m['num_heads']} "
                f"heads, MLP {m['mlp_dim']}; {c['optimizer']} {c['learning_rate']:g} "
                f"({c['schedule']}, {c['warmup_steps']} warmup steps), weight decay "
                f"{c['weight_decay']:g}, grad-norm clip {c['max_grad_norm']:g}; batch "
                f"{c['batch_size']} x {c['seq_len']} bytes, {steps} steps; the test loss is over "
                "every byte of the test windows (the pydoc text of the running Python)."
            )
            if not args.no_peer:
                lines += [
                    "",
                    f"The peers (experiments/_fp8_peer.py) train the same TransformerLM structure "
                    "(same parameter names, the program's initial parameters, data batches, "
                    "optimizer, schedule and clipping) with a hand-written step, in bf16 "
                    "everywhere (`dtype=bfloat16, param_dtype=float32`, LayerNorm and residuals "
                    "too, unlike jamp's CPU default); "
                    f"{PEER_FP8}: `flax.linen.fp8_ops.Fp8DirectDotGeneralOp` "
                    "(amax history 16 as jamp's) as the dot_general class of the MLP's Dense "
                    "layers and of the attention's q, k, v and out projections "
                    f"({peer_sites.get(PEER_FP8)} fp8 matmuls); its `_overwrite_with_gradient` variables are replaced "
                    "by their 'gradients' through flax's `TrainState.apply_gradients` and kept "
                    f"out of the clipping and the optimizer; {PEER_REF}: the same without fp8.",
                ]
        else:
            lines.append(
                f"{c['optimizer']} {c['learning_rate']:g}, batch {c['batch_size']}, {steps} "
                "steps; 300 test images (one image is 0.33 points). Under mixed_fp8 only the "
                "hidden Dense layer is fp8 (the convolutions and the output head stay bf16)."
            )
        lines += [""] + table(recipe, results[recipe], seconds[recipe], errors[recipe])
        nonzero = {k: v for k, v in skipped[recipe].items() if any(v)}
        lines.append(
            "- skipped steps (non-finite gradients): "
            + (", ".join(f"{k} {v}" for k, v in nonzero.items()) if nonzero else "none in any run")
            + "."
        )
    if plotted:
        lines += ["", f"![training loss and fp8 scaling]({png.name})"]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
