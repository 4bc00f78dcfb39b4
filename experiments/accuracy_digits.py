"""Accuracy at equal budget per precision policy: the default recipe (seed CNN, digits) per policy.

    python experiments/accuracy_digits.py            # 4 policies x 3 seeds, ~4 min
    python experiments/accuracy_digits.py --seeds 1 --steps 200   # quick look

Every run is the real training program (`python -m jamp.train`, configs/default.py) with only
`--config.policy` and `--config.seed` changed, so each policy gets the same data, steps and
optimizer. It reads each run's metrics.jsonl and writes experiments/results/accuracy_digits_cpu.md
(final test accuracy per policy and seed, difference to float32) plus two plots: the training loss
per policy and the loss scale over steps (fp16 with its dynamic scale).

Policies: float32; mixed_bfloat16 and mixed_float16 (fp32 params, 16-bit compute; fp16 with
jamp's default dynamic loss scale); and all-bf16 ("bfloat16": params, compute and output bf16).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile

from _accuracy import POLICIES, add_run_arguments, final, records, run, run_options
from _harness import RESULTS
from _harness.environment import cpu_cores, environment
from _harness.plots import pyplot, save
from _harness.tables import write_page


def plot(curves: dict, path: pathlib.Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, run_records in curves.items():
        train = records(run_records, "train")
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label=policy)
        if policy == "mixed_float16":
            ax_scale.plot([r["step"] for r in train], [r["loss_scale"] for r in train])
    ax_loss.set(yscale="log", xlabel="step", ylabel="training loss (window mean)",
                title="seed CNN on digits, seed 0")  # fmt: skip
    ax_loss.legend()
    ax_scale.set(yscale="log", xlabel="step", ylabel="loss scale",
                 title="mixed_float16: dynamic loss scale")  # fmt: skip
    return save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000, help="the default recipe's 1000")
    parser.add_argument("--out", default=str(RESULTS / "accuracy_digits_cpu.md"))
    add_run_arguments(parser)
    args = parser.parse_args()

    accuracy: dict[str, list[float]] = {p: [] for p in POLICIES}
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for policy in POLICIES:
                run_records = run(policy, seed, args.steps, pathlib.Path(tmp) / f"{policy}-{seed}",
                                  args.data_dir, activations=args.activations)  # fmt: skip
                accuracy[policy].append(final(run_records)["accuracy"])
                if seed == 0:
                    curves[policy] = run_records
                print(f"{policy:15s} seed {seed}: accuracy {accuracy[policy][-1]:.4f}", flush=True)

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plotted = plot(curves, out.with_suffix(".png"))
    ref = statistics.mean(accuracy["float32"])
    fp16 = records(curves["mixed_float16"], "train")
    command = f"python experiments/accuracy_digits.py --seeds {args.seeds} --steps {args.steps}"
    command += run_options(args)
    lines = [
        "# Test accuracy per policy at equal budget: seed CNN on digits (CPU)",
        "",
        *environment(command, f"{cpu_cores()}, CPU only"),
        f"- recipe: configs/default.py (Adam 1e-3, batch 64, {args.steps} steps), 300 test images;"
        f" one image is 0.33 points; activations={args.activations!r} (jamp.wrap; auto: float32 "
        "on CPUs)",
        "",
        "| policy | accuracy per seed | mean | vs float32 (points) |",
        "|---|---|---|---|",
    ]
    for policy, values in accuracy.items():
        mean = statistics.mean(values)
        lines.append(
            f"| {policy} | {', '.join(f'{v:.4f}' for v in values)} | {mean:.4f} "
            f"| {100 * (mean - ref):+.2f} |"
        )
    lines += [
        "",
        f"mixed_float16, seed 0: loss scale {fp16[0]['loss_scale']:g} at step {fp16[0]['step']}, "
        f"{fp16[-1]['loss_scale']:g} at step {fp16[-1]['step']}; "
        f"{fp16[-1]['skipped_steps']} skipped steps.",
    ]
    write_page(out, lines, "loss and loss scale" if plotted else "")


if __name__ == "__main__":
    main()
