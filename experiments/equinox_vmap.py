"""Equinox's `jax.vmap(model)(x)` under `jamp.autocast`: does the gradient step compile to the
batched program's matmuls, or to a weight gradient per example summed after?

One MLP gradient step (eqx.nn.MLP, width 64 by default: 16 -> 64 -> 64 -> 16; mean-square
loss; batch 128 by default)
in four forms: float32, `jax.vmap(jamp.autocast(model))` inside the loss (the wrapping guide's
form), the model autocast once outside the loss and vmapped inside it, and `jamp.autocast` of
the whole loss. For each: the optimized CPU program's dot instructions and its per-example 3-d
values (a (batch, in, out) weight gradient), the step's time on this CPU (best of 7 x 200 calls,
side by side in one run), and, with JAX's CUDA plugin, the H200 program's GEMMs (their count,
the float32 ones, the batched ones), its planned temporaries (XLA's buffer plan, not a measured
peak) and jamp's predicted step time (a model, not a measurement).

    python experiments/equinox_vmap.py [--batch 128] [--width 64] [--no-gpu]

Run it against another checkout of jamp (`PYTHONPATH=/path/to/checkout`) for a before/after.
"""

from __future__ import annotations

import argparse
import platform
import re
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from _harness.environment import cpu_flags, versions

import jamp

POLICY = "mixed_bfloat16"


def _forms():
    def fp32(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    def vmap_of_autocast(m, x):
        return jnp.mean(jax.vmap(jamp.autocast(m, POLICY))(x) ** 2)

    def autocast_outside(m, x):  # `m` is jamp.autocast(model) already (see `_model`)
        return jnp.mean(jax.vmap(m)(x) ** 2)

    return {
        "float32": (fp32, False),
        "jax.vmap(jamp.autocast(model)) in the loss": (vmap_of_autocast, False),
        "model = jamp.autocast(model) outside the loss": (autocast_outside, True),
        "jamp.autocast(loss)": (jamp.autocast(fp32, POLICY, params_argnums=(0,)), False),
    }


def _step(loss, static):
    def grads(params, x):
        return eqx.filter_value_and_grad(loss)(eqx.combine(params, static), x)

    return jax.jit(grads)


def _cpu(step, params, x, reps=7, calls=200):
    hlo = step.lower(params, x).compile().as_text()
    dots = len(re.findall(r" dot\(", hlo))
    batch = x.shape[0]
    per_example = sorted(set(re.findall(rf"\b\w+\[{batch},\d+,\d+\]", hlo)))
    jax.block_until_ready(step(params, x))
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            out = step(params, x)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return dots, per_example, best


def _h200(step, params, x):
    report = jamp.compile_for(step, params, x, target="h200")
    gemms = report.gemms
    fp32 = sum(g.is_fp32 for g in gemms)
    batched = sum(g.batched for g in gemms)
    predicted = report.estimate.seconds if report.estimate is not None else float("nan")
    return len(gemms), fp32, batched, report.memory.temporaries, predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--no-gpu", action="store_true", help="skip the H200 programs")
    args = parser.parse_args()
    model = eqx.nn.MLP(16, 16, args.width, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.batch, 16))
    gpu = not args.no_gpu and jamp.target.plugin_available()
    flags = " ".join(cpu_flags(("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")))
    print(
        f"jamp at {jamp.__file__}; {versions('jax', 'equinox')}; CPU "
        f"{platform.processor() or platform.machine()} ({flags}); "
        f"batch {args.batch}, width {args.width}"
    )
    print(
        "| form | CPU dots | per-example values | CPU step ms | H200 GEMMs (f32, batched) | "
        "H200 temporaries MiB | H200 predicted ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (loss, wrapped) in _forms().items():
        params, static = eqx.partition(
            jamp.autocast(model, POLICY) if wrapped else model, eqx.is_array
        )
        step = _step(loss, static)
        dots, per_example, seconds = _cpu(step, params, x)
        gpu_cells = "n/a | n/a | n/a"
        if gpu:
            count, fp32, batched, temporaries, predicted = _h200(step, params, x)
            gpu_cells = (
                f"{count} ({fp32}, {batched}) | {temporaries / 2**20:.2f} | {predicted * 1e3:.3f}"
            )
        print(
            f"| {name} | {dots} | {' '.join(per_example) or 'none'} | {seconds * 1e3:.3f} | "
            f"{gpu_cells} |"
        )


if __name__ == "__main__":
    main()
