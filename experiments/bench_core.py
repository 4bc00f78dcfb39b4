"""Core CPU benchmark: jamp.wrap vs hand-written bf16 Flax, and the cost of dynamic loss scaling.

    python experiments/bench_core.py          # full, ~10 min
    python experiments/bench_core.py --quick  # smoke, ~1-2 min

For the seed CNN (CIFAR-shaped, batch 64) and a 4-layer Transformer LM (d=256, batch 16, seq 128)
it times the full jitted train step (jamp.step.make_train_step, optax.adam, fp32 params, donated
state) of five variants of the same network, interleaved in rounds (experiments/_harness/timing.py):

  fp32          the jamp.models module as written (default matmul precision: true fp32 on CPU)
  hand_bf16     the same network written here with dtype=bf16, param_dtype=fp32 on every layer
  wrap_bf16     jamp.wrap(model, "mixed_bfloat16")
  wrap_f16      jamp.wrap(model, "mixed_float16") with NoOpLossScale
  wrap_f16_dls  the same with DynamicLossScale()

Headline ratios (median of per-round ratios): (a) wrap_bf16 / hand_bf16, target <= 1.02;
(b) wrap_f16_dls / wrap_f16, target <= 1.03, plus their compile time and XLA temp memory.
Writes experiments/results/core_cpu.md; text below its "<!-- notes -->" line is kept on rerun.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import RESULTS
from _harness.data import xy_loss
from _harness.environment import benchmark_environment, loadavg
from _harness.tables import fine_ratio, write_keeping_notes
from _harness.timing import RATIO_NOTE, interleaved, median_ms, ratio_stats, stepper
from _harness.xla import hlo_summary
from peers_flax import hand_model

from jamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jamp.models import SeedCNN, TransformerLM
from jamp.state import TrainState
from jamp.step import make_train_step
from jamp.wrap import wrap

BF16, F32 = jnp.bfloat16, jnp.float32
TX = optax.adam(1e-4)
KEY = jax.random.key(0)
OUT = RESULTS / "core_cpu.md"


def make_models(name):
    """(plain jamp.models module, hand-written bf16 twin, batch) for one benchmark model."""
    rng = np.random.default_rng(0)
    if name == "cnn":
        batch = {
            "x": jnp.asarray(rng.standard_normal((64, 32, 32, 3)), F32),
            "y": jnp.asarray(rng.integers(0, 10, 64), jnp.int32),
        }
        return SeedCNN(num_classes=10), hand_model("seed_cnn", BF16, 10), batch
    tokens = jnp.asarray(rng.integers(0, 1024, (16, 129)), jnp.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    cfg = dict(num_layers=4, d_model=256, num_heads=4, mlp_dim=1024)
    return (
        TransformerLM(vocab_size=1024, **cfg),
        hand_model("transformer_lm", BF16, 1024, **cfg),
        batch,
    )


# ----- building, compiling and running the variants


def variants(model, hand):
    return {
        "fp32": (model, NoOpLossScale),
        "hand_bf16": (hand, NoOpLossScale),
        "wrap_bf16": (wrap(model, "mixed_bfloat16"), NoOpLossScale),
        "wrap_f16": (wrap(model, "mixed_float16"), NoOpLossScale),
        "wrap_f16_dls": (wrap(model, "mixed_float16"), DynamicLossScale),
        # Controls for (b): the same scale held static (fp16 values as large as under the dynamic
        # scale, none of its logic), and the dynamic machinery on fp32 (its logic, fp32 values).
        "wrap_f16_static": (wrap(model, "mixed_float16"), lambda: StaticLossScale(2.0**16)),
        "fp32_dls": (model, DynamicLossScale),
    }


def compile_all(specs, params, batch, reps):
    """Lowers and compiles every variant `reps` times in rotating order, caches cleared each time."""
    out = {name: {"lower": [], "compile": []} for name in specs}
    names = list(specs)
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            module, loss_scale = specs[name]
            jax.clear_caches()
            step = jax.jit(make_train_step(xy_loss(module.apply), TX), donate_argnums=0)
            state = TrainState.create(jax.tree.map(jnp.copy, params), TX, loss_scale=loss_scale())
            t0 = time.perf_counter()
            lowered = step.lower(state, batch, KEY)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            out[name]["lower"].append(t1 - t0)
            out[name]["compile"].append(time.perf_counter() - t1)
            out[name].update(compiled=compiled, state=state)
    for info in out.values():
        info["compile_s"] = statistics.median(a + b for a, b in zip(info["lower"], info["compile"]))
        info["temp"] = info["compiled"].memory_analysis().temp_size_in_bytes
        info["hlo"] = hlo_summary(info["compiled"].as_text())
    return out


def bench_model(name, rounds, steps, reps, sanity_steps=5):
    model, hand, batch = make_models(name)
    params = model.init(KEY, batch["x"])["params"]
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    hand_params = jax.eval_shape(lambda: hand.init(KEY, batch["x"])["params"])
    assert shapes(hand_params) == shapes(params), "hand-written network differs from jamp.models'"
    specs = variants(model, hand)
    print(f"[{name}] compiling {len(specs)} variants x {reps} ...", flush=True)
    info = compile_all(specs, params, batch, reps)
    runners = {n: stepper(i["compiled"], i["state"], batch, KEY) for n, i in info.items()}
    for n, run in runners.items():  # sanity: finite, and similar losses after a few steps
        metrics = [run() for _ in range(sanity_steps)]
        losses = info[n]["losses"] = [float(m["loss"]) for m in metrics]
        assert np.all(np.isfinite(losses)), f"{name}/{n}: non-finite loss {losses}"
        print(
            f"[{name}] {n:13s} loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"skipped steps {int(metrics[-1]['skipped_steps'])}, "
            f"loss scale {float(metrics[-1]['loss_scale']):g}",
            flush=True,
        )
    ref = info["fp32"]["losses"][-1]
    for n in ("hand_bf16", "wrap_bf16"):
        if abs(info[n]["losses"][-1] - ref) > 0.05 * abs(ref) + 0.05:
            print(f"[{name}] WARNING: {n} loss differs from fp32 after {sanity_steps} steps")
    print(f"[{name}] timing {rounds} rounds x {steps} steps ...", flush=True)
    t0 = time.perf_counter()
    times = interleaved(runners, rounds, steps)
    print(f"[{name}] timed in {time.perf_counter() - t0:.0f} s", flush=True)
    for n in info:
        info[n]["times"] = times[n]
    return info


# ----- reporting


def model_rows(name, info):
    rows = [
        f"### {name}",
        "",
        "| variant | step ms (median) | vs hand_bf16 | vs fp32 | lower+compile s | temp MiB | loss step 1 → 5 |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, i in info.items():
        rows.append(
            f"| {n} | {median_ms(i['times']):.1f} "
            f"| {fine_ratio(ratio_stats(i['times'], info['hand_bf16']['times']))} "
            f"| {fine_ratio(ratio_stats(i['times'], info['fp32']['times']))} "
            f"| {i['compile_s']:.2f} | {i['temp'] / 2**20:.1f} "
            f"| {i['losses'][0]:.4f} → {i['losses'][-1]:.4f} |"
        )
    rows += [
        "",
        "XLA ops per variant (dtypes of operands->result; ynn = inside a `__ynn_fusion`):",
        "",
    ]
    rows += [f"- {n}: {i['hlo']}" for n, i in info.items()]
    return rows + [""]


def headline_rows(results):
    rows = [
        "| model | (a) wrap_bf16 / hand_bf16 step (≤ 1.02) | (b) f16_dls / f16 step (≤ 1.03) "
        "| (b) compile s dls / noop (ratio) | (b) temp MiB dls / noop "
        "| controls: f16_static / f16, fp32_dls / fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for name, info in results.items():
        a = ratio_stats(info["wrap_bf16"]["times"], info["hand_bf16"]["times"])
        b = ratio_stats(info["wrap_f16_dls"]["times"], info["wrap_f16"]["times"])
        d, f = info["wrap_f16_dls"], info["wrap_f16"]
        rows.append(
            f"| {name} | {fine_ratio(a)} | {fine_ratio(b)} "
            f"| {d['compile_s']:.2f} / {f['compile_s']:.2f} ({d['compile_s'] / f['compile_s']:.2f}) "
            f"| {d['temp'] / 2**20:.1f} / {f['temp'] / 2**20:.1f} ({d['temp'] / f['temp']:.2f}) "
            f"| {fine_ratio(ratio_stats(info['wrap_f16_static']['times'], f['times']))}, "
            f"{fine_ratio(ratio_stats(info['fp32_dls']['times'], info['fp32']['times']))} |"
        )
    return rows


def run_lines(args, elapsed, load0):
    """The results file's head: the environment record and how the variants were timed."""
    precision = jax.config.jax_default_matmul_precision
    return benchmark_environment(load0) + [
        f"- rounds x steps per variant: cnn {args.rounds} x {args.cnn_steps}, "
        f"tlm {args.rounds} x {args.tlm_steps}; compile repeats {args.compile_reps}; "
        f"total wall time {elapsed / 60:.1f} min",
        f"- fp32 baseline matmul precision: jax_default_matmul_precision={precision!r} "
        "(DEFAULT; on CPU that is true fp32, no TF32/bf16 passes)",
        RATIO_NOTE,
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=13)
    p.add_argument("--cnn-steps", type=int, default=12)
    p.add_argument("--tlm-steps", type=int, default=8)
    p.add_argument("--compile-reps", type=int, default=3)
    p.add_argument("--models", default="cnn,tlm")
    p.add_argument("--quick", action="store_true", help="2 rounds x 2 steps, 1 compile: smoke run")
    p.add_argument("--out", default=None, help=f"results file (default {OUT}; none if --quick)")
    args = p.parse_args()
    if args.out is None and not args.quick:
        args.out = OUT
    if args.quick:
        args.rounds, args.cnn_steps, args.tlm_steps, args.compile_reps = 2, 2, 2, 1
    start, load0 = time.perf_counter(), loadavg()
    results = {}
    for name in args.models.split(","):
        steps = args.cnn_steps if name == "cnn" else args.tlm_steps
        results[name] = bench_model(name, args.rounds, steps, args.compile_reps)
    env = run_lines(args, time.perf_counter() - start, load0)
    labels = {"cnn": "SeedCNN, 32x32x3, batch 64", "tlm": "TransformerLM 4x256, seq 128, batch 16"}
    lines = ["# jamp core benchmark on CPU", ""] + env + ["", "## Headline", ""]
    lines += headline_rows(results)
    lines += ["", "## Per model", ""]
    for name, info in results.items():
        lines += model_rows(labels.get(name, name), info)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        write_keeping_notes(args.out, text)


if __name__ == "__main__":
    main()
