"""Past float32 master weights at equal budget: bfloat16 params and low-bit optimizer state.

    python experiments/accuracy_master_weights.py        # lm + digits, 3 seeds
    python experiments/accuracy_master_weights.py --recipes digits --seeds 1

Every run is the real training program (`python -m jamp.train`) with only the policy, the
optimizer state, the params' rounding and the seed changed on the command line: the same init,
data order, steps and optimizer (Adam / AdamW) for every variant of a seed. The variants:

  fp32 master     mixed_bfloat16: float32 params and Adam moments (12 bytes per param), the
                  reference;
  bf16 nearest    params stored in bfloat16 and rounded to nearest after each float32 update
                  (10 bytes): the failure stochastic rounding fixes;
  bf16 SR         the same, rounded stochastically (10 bytes);
  bf16 SR + bf16  and Adam's moments in bfloat16, stochastically rounded (6 bytes);
  bf16 Kahan      bf16 params rounded to nearest with a Kahan compensation buffer, and bf16
                  moments (8 bytes): the deterministic alternative;
  bf16 SR + int8  and Adam's moments in 8 bits, 256 values per scale (about 4 bytes).

Writes experiments/results/accuracy_master_weights_cpu.md (final test metric per variant and
seed, paired differences to fp32 master, bytes per param as the program reports them) and a plot
of the training loss per variant (seed 0) and of the paired differences per seed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

from _accuracy import add_run_arguments, final, records, run, run_options
from _harness import RESULTS
from _harness.environment import cpu_cores, environment, versions
from _harness.plots import pyplot, save
from _harness.tables import paired, write_page

BF16 = "mixed_bfloat16,params=bf16"
# name: (policy, optimizer_state, param_rounding)
VARIANTS = {
    "fp32 master": ("mixed_bfloat16", "float32", "stochastic"),
    "bf16 nearest": (BF16, "float32", "nearest"),
    "bf16 SR": (BF16, "float32", "stochastic"),
    "bf16 SR + bf16 state": (BF16, "bfloat16", "stochastic"),
    "bf16 Kahan + bf16 state": (BF16, "bfloat16", "kahan"),
    "bf16 SR + int8 state": (BF16, "int8", "stochastic"),
}
REFERENCE = "fp32 master"
# recipe: (config, steps, metric, higher is better, extra flags)
RECIPES = {
    "lm": ("configs/lm_pydoc.py", 600, "loss", False, ("--config.warmup_steps=60",)),
    "digits": (None, 1000, "accuracy", True, ()),
}


def _bytes(workdir: pathlib.Path) -> str:
    """The program's "state bytes per param" summary row, from its log."""
    for line in (workdir / "stdout.txt").read_text().splitlines():
        if line.startswith("state bytes per param"):
            return line.split(None, 4)[-1].split(";")[0]
    return "?"


def run_recipe(recipe: str, seeds: int, args, tmp: pathlib.Path) -> dict:
    config, steps, metric, _, extra = RECIPES[recipe]
    steps = args.steps or steps
    out: dict = {"finals": {v: [] for v in VARIANTS}, "curves": {}, "bytes": {}, "seconds": {}}
    for seed in range(seeds):
        for name, (policy, state, rounding) in VARIANTS.items():
            workdir = tmp / f"{recipe}-{name.replace(' ', '_')}-{seed}"
            flags = [*extra, f"--config.optimizer_state={state}"]
            flags.append(f"--config.param_rounding={rounding}")
            t0 = time.perf_counter()
            got = run(policy, seed, steps, workdir, args.data_dir, config, overrides=flags,
                      activations=args.activations)  # fmt: skip
            out["seconds"].setdefault(name, []).append(time.perf_counter() - t0)
            value = final(got)[metric]
            out["finals"][name].append(value)
            out["bytes"][name] = _bytes(workdir)
            if seed == 0:
                out["curves"][name] = [(r["step"], r["loss"]) for r in records(got, "train")]
            print(f"{recipe} {name:22s} seed {seed}: {metric} {value:.4f} "
                  f"({out['seconds'][name][-1]:.0f} s)", flush=True)  # fmt: skip
    out["config"] = json.loads((workdir / "config.json").read_text())
    out["steps"] = steps
    return out


def metric_table(recipe: str, res: dict) -> list[str]:
    _, _, metric, higher, _ = RECIPES[recipe]
    ref = res["finals"][REFERENCE]
    scale = 100.0 if metric == "accuracy" else 1.0
    unit = "points" if metric == "accuracy" else "nats/byte"
    lines = [
        f"| variant | {metric} per seed | mean | vs {REFERENCE} ({unit}), mean [min, max] "
        "| relative | state bytes per param (params, optimizer) | s per run |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, values in res["finals"].items():
        diffs = [scale * (v - r) for v, r in zip(values, ref)]
        if name == REFERENCE:
            vs, rel = "(reference)", ""
        else:
            vs = paired(diffs, 4)
            rel = f"{100 * statistics.mean(v / r - 1 for v, r in zip(values, ref)):+.2f} %"
        lines.append(
            f"| {name} | {', '.join(f'{v:.4f}' for v in values)} | "
            f"{statistics.mean(values):.4f} | {vs} | {rel} | {res['bytes'][name]} | "
            f"{statistics.mean(res['seconds'][name]):.0f} |"
        )
    better = "higher" if higher else "lower"
    return [f"Final test {metric} ({better} is better), {res['steps']} steps:", "", *lines]


def plot(results: dict, path: pathlib.Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (recipe, res) in zip(axes[0], results.items()):
        for name, curve in res["curves"].items():
            ax.plot([s for s, _ in curve], [v for _, v in curve], label=name, linewidth=1)
        ax.set(xlabel="step", ylabel="training loss", title=f"{recipe}: seed 0", yscale="log")
        ax.legend(fontsize=8)
    return save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="lm,digits")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="0: each recipe's own")
    parser.add_argument("--out", default=str(RESULTS / "accuracy_master_weights_cpu.md"))
    add_run_arguments(parser)
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"unknown recipe {unknown[0]!r}; accepted: {', '.join(RECIPES)}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = {r: run_recipe(r, args.seeds, args, pathlib.Path(tmp)) for r in recipes}
    minutes = (time.perf_counter() - start) / 60
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = f"python experiments/accuracy_master_weights.py --recipes {args.recipes} "
    command += f"--seeds {args.seeds}" + (f" --steps {args.steps}" if args.steps else "")
    command += run_options(args)
    lines = [
        "# Past float32 master weights: bfloat16 params and low-bit Adam state (CPU)",
        "",
        *environment(
            command,
            f"{cpu_cores()}, CPU only, no GPU; "
            + versions("jax", "jaxlib", "flax", "optax", python_first=True),
            took=f"{minutes:.1f} min",
        ),
        "- every variant computes in bfloat16 (`mixed_bfloat16`, activations "
        f"{args.activations!r}); they differ in what the params and Adam's moments are stored "
        "in and how params are rounded. A seed fixes the init and the data order for every "
        "variant: the differences are paired.",
        "- bytes per param: params + optimizer state as the program's summary reports them, "
        "gradients not included.",
    ]
    for recipe, res in results.items():
        c = res["config"]
        lines += ["", f"## {recipe} ({c.get('model')}, {c['optimizer']} {c['learning_rate']:g}, "
                  f"batch {c['batch_size']})", "", *metric_table(recipe, res)]  # fmt: skip
    plotted = plot(results, out.with_suffix(".png"))
    write_page(out, lines, "training loss per variant" if plotted else "")


if __name__ == "__main__":
    main()
