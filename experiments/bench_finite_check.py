"""What the per-module finite check costs: one flag per top-level module vs one flag in all.

`jamp.make_train_step` reduces the averaged gradients to one finite flag per top-level module
(`attribution_depth=1`, the default) so that a skipped step says which modules overflowed. This
times that step against the same step with a single flag (`attribution_depth=0`), side by side
in one run (interleaved rounds, see _harness/timing.py), on jamp's Transformer LM and ResNet-20 under
mixed_float16 with a dynamic loss scale, and reports compile times too.

    python experiments/bench_finite_check.py

Writes experiments/results/finite_check_cpu.md.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _harness import RESULTS  # noqa: E402
from _harness.data import random_batch  # noqa: E402
from _harness.environment import benchmark_environment, loadavg  # noqa: E402
from _harness.tables import fmt_ratio  # noqa: E402
from _harness.timing import interleaved, median_ms, ratio_stats, stepper  # noqa: E402

import jamp  # noqa: E402
from jamp.models import get_model  # noqa: E402
from jamp.train import tasks  # noqa: E402
from jamp.train.optim import OptimConfig, make_optimizer  # noqa: E402

WORKLOADS = {
    "Transformer LM 4 x 256, seq 128, batch 16": (
        "transformer_lm",
        dict(num_layers=4, d_model=256, num_heads=4, mlp_dim=1024),
        16,
    ),
    "ResNet-20 (BatchNorm), 32x32x3, batch 64": ("resnet20", {}, 64),
}


def _state(model, task, tx, batch):
    inputs = tasks.model_inputs(task, batch)[:1]
    variables = dict(model.init(jax.random.key(0), inputs, train=False))
    params = variables.pop("params")
    return jamp.TrainState.create(
        params, tx, model_state=variables, loss_scale=jamp.DynamicLossScale(2.0**15)
    )


VARIANTS = {1: "per module", 0: "single flag"}  # attribution_depth -> name


def time_workload(label, rounds, steps, compile_reps):
    name, config, size = WORKLOADS[label]
    task = "lm" if name == "transformer_lm" else "classification"
    model = jamp.wrap(get_model(name, 256 if task == "lm" else 10, **config), "mixed_float16")
    tx, _ = make_optimizer(OptimConfig(optimizer="adam", learning_rate=1e-3, num_train_steps=10))
    batch = jax.device_put(random_batch(task, size))
    key = jax.random.key(0)
    runners, compile_s, groups = {}, {name: [] for name in VARIANTS.values()}, {}
    # Compile times: median of `reps` compiles per variant, alternating, so that neither variant
    # is always the first (warm-up) compile.
    for rep in range(compile_reps):
        order = list(VARIANTS.items())
        for depth, variant in order[::-1] if rep % 2 else order:
            lowered = jax.jit(step_at_depth(model, task, tx, depth), donate_argnums=0).lower(
                _state(model, task, tx, batch), batch, key
            )
            start = time.perf_counter()
            lowered.compile()
            compile_s[variant].append(time.perf_counter() - start)
    compile_s = {k: statistics.median(v) for k, v in compile_s.items()}
    for depth, variant in VARIANTS.items():
        step = step_at_depth(model, task, tx, depth)
        state = _state(model, task, tx, batch)
        compiled = jax.jit(step, donate_argnums=0).lower(state, batch, key).compile()
        if depth:
            groups[variant] = len(jamp.finite_by_group(state.params))
        runners[variant] = stepper(compiled, state, batch, key)
        runners[variant]()  # warm
    times = interleaved(runners, rounds, steps)
    return {
        "label": label,
        "groups": groups["per module"],
        "ms": {k: median_ms(v) for k, v in times.items()},
        "ratio": ratio_stats(times["per module"], times["single flag"]),
        "compile_s": compile_s,
    }


def step_at_depth(model, task, tx, depth):
    return jamp.make_train_step(tasks.make_loss_fn(model, task), tx, attribution_depth=depth)


def results_table(results, args, elapsed, load0):
    lines = [
        "# The per-module finite check vs a single flag",
        "",
        "Train step of a `jamp.wrap`ped model under mixed_float16 (dynamic loss scale, Adam), jitted "
        "on one CPU device; `attribution_depth=1` (one finite flag per top-level module, the "
        "default) vs `attribution_depth=0` (one flag). Ratio: median of per-round ratios "
        "[min-max] of per-module / single-flag step time; above 1 is slower.",
        "",
        "| model | flags | step ms (per module) | step ms (single) | ratio | compile s (per module / single) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['groups']} | {r['ms']['per module']:.1f} | "
            f"{r['ms']['single flag']:.1f} | {fmt_ratio(r['ratio'], 3, spread=3)} | "
            f"{r['compile_s']['per module']:.2f} / {r['compile_s']['single flag']:.2f} |"
        )
    lines += [
        "",
        *benchmark_environment(load0, packages=("jax",)),
        f"- rounds x steps: {args.rounds} x {args.steps}; compile s: median of "
        f"{args.compile_reps} compiles per variant, alternating; wall time {elapsed / 60:.1f} min",
        "- fp32 parts run at jax_default_matmul_precision=DEFAULT (true fp32 on CPU)",
    ]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compile-reps", type=int, default=4)
    p.add_argument("--out", default=str(RESULTS / "finite_check_cpu.md"))
    args = p.parse_args()
    start, load0 = time.perf_counter(), loadavg()
    results = [
        time_workload(label, args.rounds, args.steps, args.compile_reps) for label in WORKLOADS
    ]
    text = results_table(results, args, time.perf_counter() - start, load0)
    print(text)
    pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
