"""The benchmark suite: speed, compile time and memory per precision policy, beside the peers.

    python experiments/suite.py            # this machine's full suite (CPU here: ~15 min)
    python experiments/suite.py --quick    # smoke run, a few minutes, writes nothing

For the seed CNN, a CIFAR ResNet-20 and the Transformer LM (and, on a GPU, a GPT-2-small-sized
LM at sequence length 1024) it times one full jitted train step (jamp.step.make_train_step with
Adam, fp32 master weights, donated state) of every variant, interleaved in rounds
(experiments/_harness/timing.py) so that ratios are taken within a round:

  float32          the jamp.models network as written, default matmul precision (GPU: TF32)
  float32_highest  GPU only: the same with jax_default_matmul_precision="highest" (true fp32)
  mixed_bfloat16   jamp.wrap(model, "mixed_bfloat16") (activations="auto": float32 activations on
                   CPUs, 16-bit on GPUs)
  mixed_bfloat16_act16 / _act32
                   the same with the other activation form ("compute" on CPUs, "float32" on GPUs)
  mixed_float16    jamp.wrap(model, "mixed_float16") with a DynamicLossScale
  bfloat16         jamp.wrap(model, "bfloat16"): bf16 params, compute and output (no fp32 master)
  flax_bf16        the network written in plain Flax with dtype=bf16 on every layer (peers_flax.py)
  torch_*          the network in PyTorch: fp32, torch.autocast(bfloat16), torch.autocast(float16)
                   + GradScaler; conv nets in channels_last (peers_torch.py; skipped with a
                   note when torch is not installed). On this CPU torch's fp16 step is 20-30x
                   slower than its fp32 one, so it is timed one step per round.

plus, compiled but not timed, mixed_float16 without loss scaling (the compile-time control). Per
variant it reports step time, examples/s, speed-up over its own framework's fp32 (median of
per-round ratios), lower+compile time, XLA's memory analysis (temporary, argument, output bytes)
and achieved FLOP/s (XLA's cost analysis of the fp32 step; MFU against the chip's peak on GPUs).

Writes experiments/results/<machine>.md and <machine>.png (speed-up and memory per policy). The
accuracy half of the suite (loss curves and loss scale per policy at equal budget) lives in
experiments/accuracy_digits.py and experiments/accuracy_lm.py; `--accuracy` runs them too, and
their results are summarised in the same file when present.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import EXPERIMENTS, RESULTS
from _harness.data import random_batch
from _harness.environment import (
    command,
    device_description,
    environment,
    machine_name,
    versions,
    xla_flags,
)
from _harness.plots import pyplot, save
from _harness.tables import fmt_ratio, write_keeping_notes
from _harness.timing import interleaved, median_ms, ratio_stats, stepper
from _harness.xla import hlo_summary
from peers_flax import hand_model

from jamp.loss_scale import DynamicLossScale, NoOpLossScale
from jamp.models import get_model, model_task
from jamp.state import TrainState
from jamp.step import make_train_step
from jamp.train.tasks import make_loss_fn, model_inputs
from jamp.wrap import wrap

TX = optax.adam(1e-4)
KEY = jax.random.key(0)
SLOW = ("torch_mixed_float16",)  # timed one step per round (fp16 has no fast path on CPUs)
# Dense peak FLOP/s for MFU (vendor datasheets, without sparsity) of the GPUs lent to this project.
_HOPPER = {"bfloat16": 989e12, "float16": 989e12, "tf32": 494e12, "float32": 67e12}
PEAK_FLOPS = {"NVIDIA H200": _HOPPER, "NVIDIA H100 80GB HBM3": _HOPPER}


@dataclasses.dataclass
class Workload:
    label: str
    model: str
    batch_size: int
    model_config: dict
    steps: int  # steps per variant per round
    image_size: int = 32
    seq_len: int = 128
    vocab: int = 256

    @property
    def task(self):
        return model_task(self.model)

    def batch(self):
        return random_batch(
            self.task,
            self.batch_size,
            vocab=self.vocab,
            seq_len=self.seq_len,
            image_size=self.image_size,
        )

    def num_classes(self):
        return self.vocab if self.task == "lm" else 10

    def examples_per_step(self):
        # Tokens for language models, images otherwise.
        return self.batch_size * (self.seq_len if self.task == "lm" else 1)


def workloads(on_gpu: bool, quick: bool) -> list[Workload]:
    lm = dict(num_layers=4, d_model=256, num_heads=4, mlp_dim=1024)
    scale = 4 if on_gpu else 1
    out = [
        Workload("seed CNN, CIFAR 32x32x3", "seed_cnn", 64 * scale, {}, steps=6),
        Workload("ResNet-20 (BatchNorm), CIFAR 32x32x3", "resnet20", 64 * scale, {}, steps=3),
        Workload("Transformer LM 4 x 256, seq 128", "transformer_lm", 16 * scale, lm, steps=6),
    ]
    if on_gpu:
        gpt2 = dict(num_layers=12, d_model=768, num_heads=12, mlp_dim=3072, max_len=1024)
        # First: it is the one with a target, and a lent GPU's time is short.
        out.insert(
            0,
            Workload(
                "GPT-2-small-sized LM 12 x 768, seq 1024",
                "transformer_lm",
                16,
                gpt2,
                steps=5,
                seq_len=1024,
                vocab=50304,
            ),
        )
    if quick:
        for w in out:
            w.steps = 1
    return out


# ----- JAX variants


def jax_variants(w: Workload, on_gpu: bool) -> dict:
    """name -> (module, loss-scale factory, matmul precision or None, timed?)."""
    model = get_model(w.model, w.num_classes(), **w.model_config)
    out = {"float32": (model, NoOpLossScale, None, True)}
    if on_gpu:
        out["float32_highest"] = (model, NoOpLossScale, "highest", True)
    out["mixed_bfloat16"] = (wrap(model, "mixed_bfloat16"), NoOpLossScale, None, True)
    # The activation form "auto" does not pick on this platform, to show that the pick is right.
    other = "float32" if on_gpu else "compute"
    out[f"mixed_bfloat16_act{'32' if on_gpu else '16'}"] = (
        wrap(model, "mixed_bfloat16", activations=other),
        NoOpLossScale,
        None,
        True,
    )
    out["mixed_float16"] = (wrap(model, "mixed_float16"), DynamicLossScale, None, True)
    out["bfloat16"] = (wrap(model, "bfloat16"), NoOpLossScale, None, True)
    out["flax_bf16"] = (
        hand_model(w.model, jnp.bfloat16, w.num_classes(), **w.model_config),
        NoOpLossScale,
        None,
        True,
    )
    out["mixed_float16_noscale"] = (wrap(model, "mixed_float16"), NoOpLossScale, None, False)
    return out


def compile_variant(w, module, loss_scale, precision, batch, reps):
    variables = module.init(KEY, model_inputs(w.task, batch))
    params = variables["params"]
    model_state = {k: v for k, v in variables.items() if k != "params"}
    state = TrainState.create(params, TX, model_state=model_state, loss_scale=loss_scale())
    step = jax.jit(make_train_step(make_loss_fn(module, w.task), TX), donate_argnums=0)
    seconds = []
    for _ in range(reps):  # the fastest of `reps` fresh compiles: compile time is load-sensitive
        jax.clear_caches()
        t0 = time.perf_counter()
        scope = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
        with scope:
            compiled = step.lower(state, batch, KEY).compile()
        seconds.append(time.perf_counter() - t0)
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "compiled": compiled,
        "state": state,
        "compile_s": min(seconds),
        "temp": mem.temp_size_in_bytes,
        "args": mem.argument_size_in_bytes,
        "out": mem.output_size_in_bytes,
        "flops": float((cost or {}).get("flops", 0.0)),
        "hlo": hlo_summary(compiled.as_text()),
    }


# ----- PyTorch variants


def torch_runners(w: Workload, batch_np) -> tuple[dict, str]:
    try:
        import peers_torch
    except ImportError as e:  # the module itself imports torch lazily; this is belt and braces
        return {}, f"PyTorch peer not importable ({e})"
    ok, why = peers_torch.available()
    if not ok:
        return {}, why
    runners, notes = {}, []
    config = dict(w.model_config, vocab_size=w.vocab) if w.task == "lm" else {}
    for policy in ("float32", "mixed_bfloat16", "mixed_float16"):
        name = f"torch_{policy}"
        try:
            runners[name] = peers_torch.make_step(w.model, policy, batch_np, **config)
        except Exception as e:  # noqa: BLE001 - reported as a skip in the results
            notes.append(f"{name} skipped: {str(e).splitlines()[0]}")
    return runners, "; ".join(notes)


# ----- one workload


def bench(w: Workload, rounds: int, on_gpu: bool, with_torch: bool, compile_reps: int) -> dict:
    batch_np = w.batch()
    batch = jax.tree.map(jnp.asarray, batch_np)
    info = {}
    for name, (module, loss_scale, precision, timed) in jax_variants(w, on_gpu).items():
        print(f"[{w.model}] compiling {name} ...", flush=True)
        info[name] = compile_variant(w, module, loss_scale, precision, batch, compile_reps)
        info[name].update(framework="jax", timed=timed)
    runners = {
        n: stepper(i["compiled"], i["state"], batch, KEY) for n, i in info.items() if i["timed"]
    }
    note = "PyTorch peer not requested (--no-torch)"
    if with_torch:
        extra, note = torch_runners(w, batch_np)
        for name, run in extra.items():
            info[name] = {"framework": "torch", "timed": True}
            runners[name] = run
    # Warm up (oneDNN builds torch's kernels in the first steps) and check every variant trains.
    for name, run in runners.items():
        losses = [float(_loss_of(run())) for _ in range(2 if name in SLOW else 5)]
        info[name]["losses"] = losses
        if not np.all(np.isfinite(losses)):
            print(f"[{w.model}] WARNING {name}: non-finite losses {losses}", flush=True)
    print(f"[{w.model}] timing {len(runners)} variants, {rounds} rounds x {w.steps} steps",
          flush=True)  # fmt: skip
    times = interleaved(runners, rounds, {n: 1 if n in SLOW else w.steps for n in runners})
    for name, t in times.items():
        info[name]["times"] = t
    return {"workload": w, "info": info, "torch_note": note}


def _loss_of(out):
    return out["loss"] if isinstance(out, dict) else out


# ----- reporting


def speedups(result) -> dict:
    """name -> (median, min, max) of per-round fp32_time / variant_time (own framework's fp32)."""
    info, out = result["info"], {}
    for name, i in info.items():
        if "times" not in i:
            continue
        base = "torch_float32" if i["framework"] == "torch" else "float32"
        if base in info and "times" in info[base]:
            med, lo, hi = ratio_stats(i["times"], info[base]["times"])
            out[name] = (1 / med, 1 / hi, 1 / lo)
    return out


def _peak(policy_name):
    kind = jax.devices()[0].device_kind
    peaks = PEAK_FLOPS.get(kind)
    if not peaks:
        return None
    if policy_name == "float32":
        return peaks["tf32"]
    if policy_name == "float32_highest":
        return peaks["float32"]
    return peaks["float16"] if "float16" in policy_name else peaks["bfloat16"]


def model_table(result) -> list[str]:
    w, info = result["workload"], result["info"]
    unit = "tokens/s" if w.task == "lm" else "images/s"
    work = info["float32"]["flops"]  # XLA's count for the fp32 step: the model's work per step
    ups = speedups(result)
    rows = [
        f"### {w.label}, batch {w.batch_size}",
        "",
        f"| variant | step ms | {unit} | speed-up vs own fp32 | compile s | temp MiB | args MiB "
        "| out MiB | TFLOP/s (MFU) | loss over warm-up steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, i in info.items():
        if "times" in i:
            ms = median_ms(i["times"])
            rate = f"{w.examples_per_step() / ms * 1e3:,.0f}"
            up = fmt_ratio(ups[name]) if name in ups else "-"
            tflops = work / ms * 1e3 / 1e12
            peak = _peak(name) if i["framework"] == "jax" else None
            flops = f"{tflops:.3f}" + (f" ({tflops * 1e12 / peak:.0%})" if peak else "")
            losses = " → ".join(f"{x:.4f}" for x in (i["losses"][0], i["losses"][-1]))
        else:
            ms_txt = "not timed"
            rate = up = flops = losses = "-"
        row = [name, f"{ms:.1f}" if "times" in i else ms_txt, rate, up]
        if i["framework"] == "jax":
            row += [f"{i['compile_s']:.2f}"] + [
                f"{i[k] / 2**20:.1f}" for k in ("temp", "args", "out")
            ]
        else:
            row += ["-", "-", "-", "-"]
        rows.append("| " + " | ".join(row + [flops, losses]) + " |")
    rows += ["", f"PyTorch: {result['torch_note'] or 'all three variants ran'}.", ""]
    rows += ["XLA ops (operand dtypes -> result; ynn = inside a YNNPACK fusion):", ""]
    rows += [f"- {n}: {i['hlo']}" for n, i in info.items() if i["framework"] == "jax"]
    return rows + [""]


def headline(results) -> list[str]:
    rows = [
        "| workload | mixed_bf16 speed-up | mixed_bf16 temp / fp32 | mixed_f16 (dynamic scale) "
        "speed-up | compile: scaled / unscaled f16 | jamp mixed_bf16 vs flax_bf16 (time) "
        "| jamp mixed_bf16 vs torch bf16 autocast (time) "
        "| mixed_bf16 with the other activation form: speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        info, ups = r["info"], speedups(r)
        bf, f16 = info["mixed_bfloat16"], info["mixed_float16"]
        temp = bf["temp"] / max(info["float32"]["temp"], 1)
        comp = f16["compile_s"] / info["mixed_float16_noscale"]["compile_s"]
        hand = fmt_ratio(ratio_stats(bf["times"], info["flax_bf16"]["times"]))
        torch = "-"
        if "torch_mixed_bfloat16" in info:
            torch = fmt_ratio(ratio_stats(bf["times"], info["torch_mixed_bfloat16"]["times"]))
        other = [v for v in ("mixed_bfloat16_act16", "mixed_bfloat16_act32") if v in ups]
        other = f"{other[0][-5:]}: {fmt_ratio(ups[other[0]])}" if other else "-"
        rows.append(
            f"| {r['workload'].label} | {fmt_ratio(ups['mixed_bfloat16'])} | {temp:.2f} "
            f"| {fmt_ratio(ups['mixed_float16'])} | {comp:.2f} | {hand} | {torch} | {other} |"
        )
    return rows


def plot(results, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (ax_up, ax_mem) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [w["workload"].label.split(",")[0] for w in results]
    variants = [
        "mixed_bfloat16",
        "mixed_float16",
        "bfloat16",
        "flax_bf16",
        "torch_mixed_bfloat16",
        "torch_mixed_float16",
    ]
    width = 0.8 / len(variants)
    top = 1.0
    for k, v in enumerate(variants):
        ups = [speedups(r).get(v, (np.nan,))[0] for r in results]
        top = max([top] + [u for u in ups if np.isfinite(u)])
        ax_up.bar(np.arange(len(results)) + k * width, ups, width, label=v)
    ax_up.axhline(1.0, color="k", lw=0.8)
    ax_up.set_ylim(0, top * 1.45)  # room for the legend above the bars
    ax_up.set(xticks=np.arange(len(results)) + 0.4 - width / 2, xticklabels=names,
              ylabel="speed-up over own framework's fp32", title="step speed-up per policy")  # fmt: skip
    ax_up.legend(fontsize=8, ncol=3, loc="upper left")
    mem_variants = ["float32", "mixed_bfloat16", "mixed_float16", "bfloat16", "flax_bf16"]
    width = 0.8 / len(mem_variants)
    for k, v in enumerate(mem_variants):
        temps = [r["info"][v]["temp"] / 2**20 for r in results]
        ax_mem.bar(np.arange(len(results)) + k * width, temps, width, label=v)
    ax_mem.set(xticks=np.arange(len(results)) + 0.4 - width / 2, xticklabels=names,
               ylabel="MiB", title="XLA temporary memory of the train step")  # fmt: skip
    ax_mem.set_ylim(0, ax_mem.get_ylim()[1] * 1.3)
    ax_mem.legend(fontsize=8, ncol=3, loc="upper left")
    return save(fig, path)


def accuracy_section() -> list[str]:
    rows = ["## Accuracy at equal budget", ""]
    found = False
    for stem, what in (("accuracy_digits_cpu", "seed CNN on digits"),
                       ("accuracy_lm_cpu", "Transformer LM on pydoc text")):  # fmt: skip
        md = RESULTS / f"{stem}.md"
        if md.exists():
            found = True
            rows.append(f"- {what}: [{stem}.md]({stem}.md), loss curves and loss scale in "
                        f"[{stem}.png]({stem}.png)")  # fmt: skip
    if not found:
        rows.append("- not run yet: `python experiments/suite.py --accuracy`")
    return rows + [""]


def setup(args, elapsed) -> list[str]:
    """The results file's head: the environment record and the baselines' precision."""
    device = jax.devices()[0]
    precision = jax.config.jax_default_matmul_precision or "default"
    fp32_note = (
        "true fp32 on CPU (XLA:CPU has no TF32 or bf16-pass modes)"
        if device.platform == "cpu"
        else "TF32 on this GPU; float32_highest is true fp32"
    )
    machine = (
        f"{device_description()}; {jax.device_count()} {device.platform} device(s), "
        f"{os.cpu_count()} host cores; {xla_flags()}"
    )
    packages = versions("jax", "jaxlib", "flax", "optax", "torch", missing="not installed")
    return environment(command(), machine, packages) + [
        f"- fp32 baselines: jax matmul precision {precision!r} ({fp32_note}); PyTorch "
        "`torch.set_float32_matmul_precision('highest')`",
        f"- {args.rounds} interleaved rounds; ratios are medians of per-round ratios [min-max]; "
        f"step ms is the median over rounds; compile s is the fastest of 2 fresh compiles (1 on GPU); total wall time {elapsed / 60:.1f} min",
    ]


def run_accuracy():
    for script in ("accuracy_digits.py", "accuracy_lm.py"):
        print(f"running {script} ...", flush=True)
        subprocess.run([sys.executable, str(EXPERIMENTS / script)], check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 9 (CPU), 5 (GPU)")
    parser.add_argument("--models", default="", help="comma-separated model names to keep")
    parser.add_argument("--no-torch", action="store_true", help="leave out the PyTorch peer")
    parser.add_argument("--accuracy", action="store_true", help="also run the accuracy scripts")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 step, writes nothing")
    parser.add_argument("--out", default=None, help="results file stem (default: machine name)")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    args.rounds = 2 if args.quick else (args.rounds or (5 if on_gpu else 9))
    start = time.perf_counter()
    results = []
    for w in workloads(on_gpu, args.quick):
        if args.models and w.model not in args.models.split(","):
            continue
        reps = 1 if args.quick or on_gpu else 2
        results.append(bench(w, args.rounds, on_gpu, not args.no_torch, reps))
        # Written after every workload, so that a run stopped by a time limit keeps what it did.
        write_results(results, args, time.perf_counter() - start, final=False)
    if args.accuracy:
        run_accuracy()
    write_results(results, args, time.perf_counter() - start, final=True)


def write_results(results, args, elapsed, final):
    lines = [f"# jamp benchmark suite: {machine_name()}", ""]
    lines += setup(args, elapsed)
    if not final:
        lines += ["- PARTIAL: written before the last workload finished"]
    lines += ["", "## Headline", ""] + headline(results) + ["", "## Per workload", ""]
    for r in results:
        lines += model_table(r)
    lines += accuracy_section()
    text = "\n".join(lines) + "\n"
    if final:
        print("\n" + text)
    if args.quick:
        return
    stem = args.out or machine_name()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{stem}.md"
    if plot(results, RESULTS / f"{stem}.png"):
        text += f"\n![speed-up and memory per policy]({stem}.png)\n"
    write_keeping_notes(path, text)
    if final:
        print("wrote", path)


if __name__ == "__main__":
    main()
