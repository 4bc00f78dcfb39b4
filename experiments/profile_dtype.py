"""How far do the profile's shares fall short of the measured step time? (jamp.inspect.profile)

    python experiments/profile_dtype.py           # ~5 min
    python experiments/profile_dtype.py --quick   # ~1 min

Profiles the training program's two default models the way `python -m jamp.train` runs them on
this machine (`jamp.parallel`'s pmapped step over the local devices, random data of the recipes'
shapes): the digits CNN (configs/default.py: seed CNN, 8x8x1 images, batch 64, adam) and the
Transformer LM (configs/lm_tiny_shakespeare.py: 4 layers, d=256, seq 128, batch 32, adamw), each
under two policies. Every variant is profiled `--rounds` times, `--steps` steps a round, rounds
interleaved across variants; reported per variant: the median step time and the range of the
attributed fraction (the sum of the shares) over the rounds, plus the median round's table.
Writes experiments/results/profile_cpu.md and profile_cpu.png (the LM under mixed_bfloat16).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import numpy as np
import optax
from _harness import RESULTS
from _harness.environment import cpu_cores, loadavg, today, versions

import jamp
from jamp import parallel
from jamp.inspect.profile import profile_steps
from jamp.models import SeedCNN, TransformerLM
from jamp.train import tasks


def make_variant(model_name: str, policy: str):
    """(pmapped step, replicated state, endless batch iterator, rng) for one model and policy."""
    rng = np.random.default_rng(0)
    n = jax.local_device_count()
    if model_name == "cnn":
        model, task, tx, dummy = SeedCNN(10), "classification", optax.adam(1e-3), (1, 8, 8, 1)
        batch = {
            "image": rng.random((64, 8, 8, 1), np.float32),
            "label": rng.integers(0, 10, 64).astype(np.int32),
        }
    else:
        model = TransformerLM(vocab_size=65, num_layers=4, d_model=256, num_heads=4, mlp_dim=1024)
        task, tx, dummy = "lm", optax.adamw(1e-3, weight_decay=0.01), (1, 128)
        batch = {"tokens": rng.integers(0, 65, (32, 129)).astype(np.int32)}
    wrapped = jamp.wrap(model, policy)
    x = np.zeros(dummy, np.float32 if task == "classification" else np.int32)
    variables = dict(wrapped.init(jax.random.key(0), x, train=False))
    params = variables.pop("params")
    state = jamp.TrainState.create(
        params, tx, model_state=variables, loss_scale=jamp.loss_scale_for(policy)
    )
    step = jamp.make_train_step(tasks.make_loss_fn(wrapped, task), tx, axis_name=parallel.AXIS_NAME)
    p_step = parallel.make_p_train_step(step)
    assert batch[next(iter(batch))].shape[0] % n == 0

    def batches():
        while True:
            yield parallel.shard(batch)

    return p_step, parallel.replicate(state), batches(), jax.random.key(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    rounds, steps = (2, 5) if args.quick else (args.rounds, args.steps)
    variants = {
        ("cnn", "mixed_float16"): None,
        ("cnn", "float32"): None,
        ("lm", "mixed_bfloat16"): None,
        ("lm", "float32"): None,
    }
    load_before = loadavg()
    live = {key: make_variant(*key) for key in variants}
    results = {key: [] for key in variants}
    for r in range(rounds):
        order = list(variants)[r % len(variants) :] + list(variants)[: r % len(variants)]
        for key in order:
            p_step, state, batches, rng = live[key]
            state, prof = profile_steps(p_step, state, batches, steps, rng=rng)
            live[key] = (p_step, state, batches, rng)
            results[key].append(prof)
            print(f"round {r} {key}: {1e3 * prof.step_seconds:.2f} ms, {prof.gap_line()}")
    write_profile(results, rounds, steps, (load_before, loadavg()))


def _median_round(profs):
    by_time = sorted(profs, key=lambda p: p.step_seconds)
    return by_time[len(by_time) // 2]


def write_profile(results, rounds, steps, load):
    lines = [
        "# Profile split by dtype: shares against the measured step time (CPU)",
        "",
        f"{today()}, `experiments/profile_dtype.py`, {rounds} rounds x {steps} "
        f"profiled steps per variant (after one warm-up step each round), rounds interleaved.",
        f"Machine: {cpu_cores()} shared with other work; "
        f"{jax.local_device_count()} CPU device(s), pmapped step (`jamp.parallel`). "
        f"{versions('jax', python_first=True)}; load average (1 min) "
        f"{load[0]:.1f} before, {load[1]:.1f} after.",
        "",
        "| model | policy | step ms (median) | attributed fraction: median | min | max |",
        "|---|---|---|---|---|---|",
    ]
    for (model, policy), profs in results.items():
        fractions = [p.attributed_fraction for p in profs]
        step = statistics.median(p.step_seconds for p in profs)
        lines.append(
            f"| {model} | {policy} | {1e3 * step:.2f} | {100 * statistics.median(fractions):.1f} %"
            f" | {100 * min(fractions):.1f} % | {100 * max(fractions):.1f} % |"
        )
    for (model, policy), profs in results.items():
        prof = _median_round(profs)
        lines += ["", f"## {model}, {policy} (the median round)", "", "```", prof.table(40), "```"]
    (RESULTS / "profile_cpu.md").write_text("\n".join(lines) + "\n")
    _median_round(results[("lm", "mixed_bfloat16")]).plot(
        str(RESULTS / "profile_cpu.png"), title="Transformer LM, mixed_bfloat16, CPU"
    )
    print("wrote", RESULTS / "profile_cpu.md")


if __name__ == "__main__":
    sys.exit(main())
