"""Test loss per precision policy at equal budget: a byte-level Transformer LM on pydoc's help text.

    python experiments/accuracy_lm.py            # 4 policies x 2 seeds, ~10 min
    python experiments/accuracy_lm.py --seeds 1 --steps 100   # quick look
    python experiments/accuracy_lm.py --activations compute \
        --out experiments/results/accuracy_lm_cpu_act16.md     # with 16-bit activations

Every run is the real training program (`python -m jamp.train --config=configs/lm_pydoc.py`,
offline: CPython's pydoc topics, prepared once as a tfds dataset) with only `--config.policy` and
`--config.seed` changed, so each policy gets the same init, data order, steps and optimizer. It
reads each run's metrics.jsonl and writes experiments/results/accuracy_lm_cpu.md (final test loss in
nats and bits per byte and next-byte accuracy, per policy and seed, and the difference to float32)
and a plot of the training loss per policy and of the dynamic loss scale of the fp16 runs.

Policies (as in accuracy_digits.py): float32; mixed_bfloat16 and mixed_float16 (fp32 params,
16-bit compute; fp16 with jamp's default dynamic loss scale); and all-bf16 ("bfloat16").
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import tempfile
import time

from _accuracy import POLICIES, add_run_arguments, final, records, run, run_options
from _harness import RESULTS
from _harness.environment import cpu_cores, environment, versions
from _harness.plots import pyplot, save
from _harness.tables import mean_sd, paired, write_page

CONFIG = "configs/lm_pydoc.py"
FP16 = "mixed_float16"


def vs_float32(values: list[float], ref: list[float], scale: float) -> str:
    """Mean of the per-seed differences to float32 (same seed: same init and data), and range."""
    if values is ref:
        return "(reference)"
    return paired([scale * (v - r) for v, r in zip(values, ref)], 4)


def dataset_facts(data_dir: str, seq_len: int) -> str:
    """Topics, bytes and windows per split of the prepared dataset the runs read."""
    import tensorflow_datasets as tfds

    from jamp.train.data import pydoc_topics, resolve_data_dir

    builder = tfds.builder(
        pydoc_topics.NAME, data_dir=resolve_data_dir(data_dir), file_format="array_record"
    )
    parts = []
    for split in ("train", "test"):
        source = builder.as_data_source(split=split)
        size = sum(len(source[i]["text"]) for i in range(len(source)))
        parts.append(
            f"{split} {len(source)} topics, {size:,} bytes ({(size - 1) // seq_len} windows)"
        )
    python = builder.info.metadata.get("python_version", "?")
    return f"the pydoc topics of Python {python}: " + "; ".join(parts)


def skip_windows(train: list[dict]) -> list[dict]:
    """The train records whose window holds a skipped step (the counter went up in it)."""
    return [r for prev, r in zip([{"skipped_steps": 0}] + train, train)
            if r["skipped_steps"] > prev["skipped_steps"]]  # fmt: skip


def plot(curves: dict, fp16_runs: list[list[dict]], path: pathlib.Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(12, 4.5))
    for policy, run_records in curves.items():
        train, evals = records(run_records, "train"), records(run_records, "eval")
        (line,) = ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label=policy)
        ax_loss.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o",
                     color=line.get_color(), markersize=4)  # fmt: skip
    ax_loss.set(xlabel="step", ylabel="loss (nats/byte)",
                title="training loss (lines) and test loss (dots), seed 0")  # fmt: skip
    ax_loss.legend()
    for seed, run_records in enumerate(fp16_runs):
        train = records(run_records, "train")
        steps = [r["step"] for r in train]
        (line,) = ax_scale.step(steps, [r["loss_scale"] for r in train], where="post",
                                label=f"seed {seed}")  # fmt: skip
        skips = skip_windows(train)
        ax_scale.plot([r["step"] for r in skips], [r["loss_scale"] for r in skips], "x",
                      color=line.get_color())  # fmt: skip
    ax_scale.set(yscale="log", xlabel="step", ylabel="loss scale (last value per 10 steps)",
                 title=f"{FP16}: loss scale (x: a step was skipped)")  # fmt: skip
    ax_scale.legend()
    return save(fig, path)


def loss_scale_lines(fp16_runs: list[list[dict]]) -> list[str]:
    lines = []
    for seed, run_records in enumerate(fp16_runs):
        train = records(run_records, "train")
        scales = [r["loss_scale"] for r in train]
        skipped_at = [r["step"] for r in skip_windows(train)]
        lines.append(
            f"- {FP16}, seed {seed}: loss scale {scales[0]:g} at step {train[0]['step']}, "
            f"{scales[-1]:g} at step {train[-1]['step']} (min {min(scales):g}, max "
            f"{max(scales):g}); {train[-1]['skipped_steps']} skipped steps"
            + (f", in the windows ending at steps {skipped_at}" if skipped_at else "")
            + "."
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600, help="the recipe's 600")
    parser.add_argument("--out", default=str(RESULTS / "accuracy_lm_cpu.md"))
    add_run_arguments(parser)
    args = parser.parse_args()

    warmup = max(1, args.steps // 10)  # the recipe's 60 of 600, also for shorter runs
    start = time.perf_counter()
    finals: dict[str, list[dict]] = {p: [] for p in POLICIES}
    seconds: dict[str, list[float]] = {p: [] for p in POLICIES}
    curves, fp16_runs, config = {}, [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for policy in POLICIES:
                workdir = pathlib.Path(tmp) / f"{policy}-{seed}"
                t0 = time.perf_counter()
                run_records = run(policy, seed, args.steps, workdir, args.data_dir, CONFIG,
                                  overrides=[f"--config.warmup_steps={warmup}"],
                                  activations=args.activations)  # fmt: skip
                seconds[policy].append(time.perf_counter() - t0)
                config = config or json.loads((workdir / "config.json").read_text())
                finals[policy].append(final(run_records))
                if seed == 0:
                    curves[policy] = run_records
                if policy == FP16:
                    fp16_runs.append(run_records)
                ev = finals[policy][-1]
                print(f"{policy:15s} seed {seed}: test loss {ev['loss']:.4f} "
                      f"({ev['loss'] / math.log(2):.4f} bits/byte), accuracy {ev['accuracy']:.4f}, "
                      f"{seconds[policy][-1]:.0f} s", flush=True)  # fmt: skip
    minutes = (time.perf_counter() - start) / 60

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plotted = plot(curves, fp16_runs, out.with_suffix(".png"))
    command = f"python experiments/accuracy_lm.py --seeds {args.seeds} --steps {args.steps}"
    command += run_options(args)
    m = config["model_config"]
    bits = 1 / math.log(2)
    loss = {p: [e["loss"] for e in finals[p]] for p in POLICIES}
    accuracy = {p: [e["accuracy"] for e in finals[p]] for p in POLICIES}
    lines = [
        "# Test loss per policy at equal budget: byte-level Transformer LM on pydoc (CPU)",
        "",
        *environment(
            command,
            f"{cpu_cores()}, CPU only, no GPU (a VM shared with other jobs); "
            + versions("jax", "jaxlib", "flax", "optax", "jmp", python_first=True),
            took=f"{minutes:.1f} min for {args.seeds * len(POLICIES)} runs",
        ),
        f"- recipe: {CONFIG}: {m['num_layers']}-layer Transformer, d_model {m['d_model']}, "
        f"{m['num_heads']} heads, MLP {m['mlp_dim']}; {config['optimizer']} "
        f"{config['learning_rate']:g} ({config['schedule']}, {config['warmup_steps']} warmup "
        f"steps), grad-norm clip {config['max_grad_norm']:g}; batch {config['batch_size']} x "
        f"{config['seq_len']} bytes, {args.steps} steps; activations={args.activations!r} "
        "(jamp.wrap; auto: float32 on CPUs)",
        f"- data: {dataset_facts(args.data_dir, config['seq_len'])}; the test loss is over every "
        "byte of the test windows",
        '- mean ± sd over seeds; "vs float32" is the mean of the per-seed differences (a seed '
        "fixes the init and the data order for every policy) [smallest, largest]",
        "",
        "| policy | test loss per seed (nats/byte) | bits/byte | vs float32 (bits/byte) "
        "| next-byte accuracy | vs float32 (points) | s per run |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in POLICIES:
        lines.append(
            f"| {p} | {', '.join(f'{v:.4f}' for v in loss[p])} | {mean_sd(loss[p], bits)} "
            f"| {vs_float32(loss[p], loss['float32'], bits)} | {mean_sd(accuracy[p])} "
            f"| {vs_float32(accuracy[p], accuracy['float32'], 100)} "
            f"| {statistics.mean(seconds[p]):.0f} |"
        )
    lines += ["", *loss_scale_lines(fp16_runs)]
    write_page(out, lines, "training loss and loss scale" if plotted else "")


if __name__ == "__main__":
    main()
