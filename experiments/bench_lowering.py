"""Which matmul lowering a CPU should get: "native" vs "upcast" against float32 and flax bf16.

    python experiments/bench_lowering.py          # ~10 min
    python experiments/bench_lowering.py --quick  # smoke

jamp.mixed_ops lowers a mixed matmul in one of two forms (jamp.hardware.matmul_lowering):
"native" hands XLA 16-bit operands (on CPUs in the canonical layout behind optimization barriers
that XLA:CPU's bf16 kernels need), "upcast" widens the 16-bit operands to float32 and runs a
float32 dot (the same products, exact in float32). For the Transformer LM of experiments/suite.py
(4 x 256, seq 128, batch 16, Adam, fp32 master weights) it times one full jitted train step of

  float32             the jamp.models network as written
  flax_bf16           the same network with the model's own dtype=bfloat16 (peers_flax.py)
  mixed_bf16_native   jamp.wrap(model, "mixed_bfloat16") traced under the "native" lowering
  mixed_bf16_upcast   the same under "upcast"
  mixed_f16_native / mixed_f16_upcast   the same for "mixed_float16" (no loss scale: the
                      lowering alone)

interleaved in rounds (experiments/_harness/timing.py), once per XLA configuration, each in a fresh
process (XLA_FLAGS are read when jax starts):

  default   XLA as shipped. On this machine bf16 matmuls are native (avx512_bf16).
  no_ynn    --xla_cpu_experimental_ynn_fusion_type= : XLA:CPU's YNNPACK matmul kernels off, so
            no dot takes bf16 operands natively (XLA converts them to float32) and float32 dots
            run on Eigen instead. A stand-in for a CPU without native bf16, not a replica of one:
            the float32 baseline's library changes too.

--xla_cpu_max_isa=AVX2 does not simulate such a CPU: YNNPACK picks its kernels from CPUID and
ignores it (checked and reported by the 2-D matmul probe below). Each configuration starts with
that probe (1024^3 bf16 x bf16 -> f32 vs f32), so the table shows whether bf16 was native there.
Writes experiments/results/lowering_cpu.md; text below its "<!-- notes -->" line is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from _harness import EXPERIMENTS, RESULTS
from _harness.environment import benchmark_environment, loadavg
from _harness.tables import fmt_ratio, write_keeping_notes

OUT = RESULTS / "lowering_cpu.md"
CONFIGS = {
    "default": "",
    "no_ynn": "--xla_cpu_experimental_ynn_fusion_type=",
    "max_isa_avx2": "--xla_cpu_max_isa=AVX2",
}
# Configurations that only get the 2-D matmul probe: it shows they do not simulate anything.
PROBE_ONLY = {"max_isa_avx2"}
LM = dict(num_layers=4, d_model=256, num_heads=4, mlp_dim=1024)
VOCAB, BATCH, SEQ = 256, 16, 128


# ----- the child: one XLA configuration, all variants side by side


def _matmul_probe(jax, jnp, rounds=7):
    """Median per-round ratio of a 2-D bf16 x bf16 -> f32 matmul's time to the f32 one's."""
    from _harness.timing import interleaved, median_ms, ratio_stats
    from jax import lax

    a = jax.random.normal(jax.random.key(0), (1024, 1024))
    b = jax.random.normal(jax.random.key(1), (1024, 1024))
    dims = (((1,), (0,)), ((), ()))
    f32 = jax.jit(lambda x, y: lax.dot_general(x, y, dims))
    bf = jax.jit(lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=jnp.float32))
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    runners = {"f32": lambda: f32(a, b), "bf16": lambda: bf(a16, b16)}
    for run in runners.values():
        jax.block_until_ready(run())
    times = interleaved(runners, rounds, 5)
    return {
        "bf16_over_f32": ratio_stats(times["bf16"], times["f32"]),
        "f32_ms": median_ms(times["f32"]),
    }


def _variants():
    import jax.numpy as jnp
    from peers_flax import hand_model

    from jamp.loss_scale import NoOpLossScale
    from jamp.models import get_model
    from jamp.wrap import wrap

    model = get_model("transformer_lm", VOCAB, **LM)
    out = {
        "float32": (model, None),
        "flax_bf16": (hand_model("transformer_lm", jnp.bfloat16, VOCAB, **LM), None),
    }
    for policy, short in (("mixed_bfloat16", "bf16"), ("mixed_float16", "f16")):
        for lowering in ("native", "upcast"):
            out[f"mixed_{short}_{lowering}"] = (wrap(model, policy), lowering)
    return out, NoOpLossScale


def child(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from _harness.data import random_batch
    from _harness.timing import interleaved, stepper
    from _harness.xla import hlo_summary

    from jamp import hardware
    from jamp.state import TrainState
    from jamp.step import make_train_step
    from jamp.train.tasks import make_loss_fn

    tx, key = optax.adam(1e-4), jax.random.key(0)
    batch = jax.tree.map(jnp.asarray, random_batch("lm", BATCH, vocab=VOCAB, seq_len=SEQ))
    variants, loss_scale = _variants()
    info, runners = {}, {}
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    if args.config in PROBE_ONLY:
        variants = {}
    for name, (module, lowering) in variants.items():
        print(f"[{args.config}] compiling {name} ...", flush=True)
        params = module.init(key, batch["tokens"][:, :-1])["params"]
        state = TrainState.create(params, tx, loss_scale=loss_scale())
        step = jax.jit(make_train_step(make_loss_fn(module, "lm"), tx), donate_argnums=0)
        t0 = time.perf_counter()
        with hardware.pinned_lowering(lowering or "auto"):  # read while tracing
            compiled = step.lower(state, batch, key).compile()
        info[name] = {"compile_s": time.perf_counter() - t0, "hlo": hlo_summary(compiled.as_text())}
        run = stepper(compiled, state, batch, key)
        losses = [float(run()["loss"]) for _ in range(3)]  # warm-up, and a check that it trains
        assert np.all(np.isfinite(losses)), f"{name}: non-finite losses {losses}"
        info[name]["losses"] = losses
        runners[name] = run
    print(f"[{args.config}] timing {args.rounds} rounds x {args.steps} steps", flush=True)
    times = interleaved(runners, args.rounds, args.steps) if runners else {}
    for name, t in times.items():
        info[name]["times"] = t
    with hardware.pinned_lowering("auto"):
        auto = hardware.matmul_lowering(jnp.bfloat16)
    return {
        "config": args.config,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "probe": _matmul_probe(jax, jnp),
        "support": str(hardware.support(jnp.bfloat16)),
        "auto_lowering": auto,
        "info": info,
    }


# ----- the parent: one child per configuration, then the report


def run_config(name, args) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + CONFIGS[name]).strip()
    env.pop("JAMP_MATMUL_LOWERING", None)  # each variant pins its own
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--child", name, "--json", str(out)]
        cmd += ["--rounds", str(args.rounds), "--steps", str(args.steps)]
        cmd += ["--variants", args.variants] if args.variants else []
        subprocess.run(cmd, env=env, check=True, cwd=EXPERIMENTS.parent)
        return json.loads(out.read_text())


def config_table(result) -> list[str]:
    from _harness.timing import median_ms, ratio_stats

    info = result["info"]
    probe = result["probe"]
    rows = [
        f"### {result['config']}: XLA_FLAGS={result['xla_flags']!r}",
        "",
        f"- 2-D matmul probe (1024^3): bf16 x bf16 -> f32 takes "
        f"{fmt_ratio(probe['bf16_over_f32'])} of f32's time (f32 {probe['f32_ms']:.1f} ms) — "
        + ("bf16 native here" if probe["bf16_over_f32"][0] < 0.8 else "no bf16 speed-up here"),
        f"- jamp.hardware: {result['support']}; auto lowering for bf16: "
        f"**{result['auto_lowering']}**",
        "",
        "| variant | step ms | speed-up vs float32 | speed-up vs flax_bf16 | compile s "
        "| loss over warm-up |",
        "|---|---|---|---|---|---|",
    ]
    if not info:
        return rows[:5] + ["", "(probe only: the train step was not timed here)", ""]
    for name, i in info.items():
        vs32 = ratio_stats(info["float32"]["times"], i["times"])  # >1: faster than float32
        vsbf = ratio_stats(info["flax_bf16"]["times"], i["times"])
        rows.append(
            f"| {name} | {median_ms(i['times']):.1f} | {fmt_ratio(vs32)} "
            f"| {fmt_ratio(vsbf)} | {i['compile_s']:.2f} "
            f"| {i['losses'][0]:.4f} → {i['losses'][-1]:.4f} |"
        )
    rows += ["", "XLA ops (operand dtypes -> result; ynn = inside a YNNPACK fusion):", ""]
    rows += [f"- {n}: {i['hlo']}" for n, i in info.items()]
    return rows + [""]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--configs", default="default,no_ynn,max_isa_avx2")
    p.add_argument("--variants", default="", help="comma-separated subset (float32 and "
                   "flax_bf16 are the baselines of the table: keep them)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="2 rounds x 1 step, writes nothing")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.config = args.child
        pathlib.Path(args.json).write_text(json.dumps(child(args)))
        return
    if args.quick:
        args.rounds, args.steps = 2, 1
    out = args.out or (None if args.quick else OUT)
    start, load0 = time.perf_counter(), loadavg()
    results = [run_config(name, args) for name in args.configs.split(",")]
    lines = [
        "# Matmul lowering on CPU: native vs upcast, against float32 and the model's own bf16",
        "",
        *benchmark_environment(load0, packages=("jax", "jaxlib")),
        f"- workload: Transformer LM {LM['num_layers']} x {LM['d_model']}, seq {SEQ}, batch "
        f"{BATCH}, vocab {VOCAB}, Adam, full jitted train step, donated state",
        f"- {args.rounds} rounds x {args.steps} steps per variant, interleaved; ratios: median "
        "of per-round ratios [min-max]; speed-up > 1 means faster; total "
        f"{(time.perf_counter() - start) / 60:.1f} min",
        "",
    ]
    for r in results:
        lines += config_table(r)
    text = "\n".join(lines)
    print("\n" + text)
    if out:
        write_keeping_notes(out, text)


if __name__ == "__main__":
    main()
