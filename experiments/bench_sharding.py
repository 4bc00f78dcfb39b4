"""Sharding benchmark: pmap vs FSDP on 8 simulated CPU devices — memory, step time, wire bytes.

    python experiments/bench_sharding.py          # full, ~12 min
    python experiments/bench_sharding.py --quick  # smoke, ~1.5 min

For the Transformer LM (jamp.models.TransformerLM under jamp.wrap, 4 layers, d_model 256 and
512, vocab 1024, seq 128, global batch 16) and optax.adam, it builds the same train step
(jamp.make_train_step) in three layouts over 8 devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8, set here before jax is imported):

  pmap            jamp.parallel.replicate + make_p_train_step (axis_name="batch")
  fsdp=8          jamp.sharding.make_mesh / shard_state / make_sharded_train_step / shard_batch
  data=2,fsdp=4   the same on a 2 x 4 mesh

under the policies "float32" (default matmul precision: true fp32 on CPU), "mixed_bfloat16" and
"mixed_bfloat16,reduce=bf16", and reports per layout and policy:

  memory     XLA's memory analysis of the compiled step (argument, output, alias, temp, peak: per
             device, for the pmapped program too) at the global batch and, compiled only, at
             1/2, 4 and 8 times it (--quick: 1/2 and 2), and jamp.sharding.describe's state bytes per device;
             from them per-param and per-token costs (what fits a GPU: gpu_compile.py);
  step time  interleaved in rounds (experiments/_harness/timing.py), ratios against pmap float32
             (float32 and mixed_bfloat16 only: on CPU 16-bit collectives run in float32);
  wire bytes the collectives of the partitioned program (jamp.sharding.collectives, and
             jamp.hlo.collectives on the pmapped program's partitioned HLO): param gathers
             feeding matmuls, matmul-gradient reductions, the rest, by dtype.

Writes experiments/results/sharding_cpu.md and sharding_cpu_{memory,wire}.png; text below the
results file's "<!-- notes -->" line is kept on rerun.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _harness import RESULTS  # noqa: E402
from _harness.data import xy_loss  # noqa: E402
from _harness.environment import benchmark_environment, loadavg  # noqa: E402
from _harness.plots import pyplot, save  # noqa: E402
from _harness.tables import fine_ratio, write_keeping_notes  # noqa: E402
from _harness.timing import RATIO_NOTE, interleaved, median_ms, ratio_stats, stepper  # noqa: E402

from jamp import hlo, parallel, sharding  # noqa: E402
from jamp.loss_scale import loss_scale_for  # noqa: E402
from jamp.models import TransformerLM  # noqa: E402
from jamp.precision import reduce_dtype  # noqa: E402
from jamp.state import TrainState  # noqa: E402
from jamp.step import make_train_step  # noqa: E402
from jamp.wrap import wrap  # noqa: E402

TX = optax.adam(1e-4)
KEY = jax.random.key(0)
OUT = RESULTS / "sharding_cpu.md"
LAYOUTS = ("pmap", "fsdp=8", "data=2,fsdp=4")
POLICIES = ("float32", "mixed_bfloat16", "mixed_bfloat16,reduce=bf16")
TIMED = ("float32", "mixed_bfloat16")  # reduce=bf16 only for the wire bytes (see docstring)
BASE = ("pmap", "float32")
MIB = 2**20

# ladder: batch sizes (x the global batch) compiled for memory only; the smallest bounds the temp
# that does not grow with the batch, the two largest give the temp per token (see costs).
FULL = dict(
    widths=(256, 512), layers=4, vocab=1024, seq=128, batch=16, rounds=9, steps=(3, 2),
    ladder=(0.5, 4, 8),
)  # fmt: skip
QUICK = dict(
    widths=(64,), layers=1, vocab=256, seq=32, batch=16, rounds=2, steps=(1,), ladder=(0.5, 2)
)


# ----- building the steps


def make_module(cfg, d_model):
    return TransformerLM(
        vocab_size=cfg["vocab"],
        num_layers=cfg["layers"],
        d_model=d_model,
        num_heads=max(4, d_model // 64),
        mlp_dim=4 * d_model,
        max_len=cfg["seq"],
    )


def make_batch(cfg, scale=1.0):
    rng = np.random.default_rng(0)
    size = int(cfg["batch"] * scale)
    tokens = rng.integers(0, cfg["vocab"], (size, cfg["seq"] + 1), dtype=np.int32)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def state_bytes_per_device(state, mesh):
    """jamp.sharding.describe's headline: bytes of state per device on `mesh`."""
    head = sharding.describe(state, mesh).splitlines()[0]
    return int(re.search(r": ([\d,]+) of", head).group(1).replace(",", ""))


def build_layout(layout, policy, module, params, batches):
    """(jitted step, [its args, one per batch], state bytes per device)."""
    model = wrap(module, policy)
    state = TrainState.create(params, TX, loss_scale=loss_scale_for(policy))
    if layout == "pmap":
        wire = reduce_dtype(policy)
        step = make_train_step(
            xy_loss(model.apply), TX, axis_name=parallel.AXIS_NAME,
            reduce_dtype=None if wire == jnp.float32 else wire,
        )  # fmt: skip
        jitted = parallel.make_p_train_step(step)
        placed = parallel.replicate(state)
        args = [(placed, parallel.shard(b), KEY) for b in batches]
        # pmap holds the whole state on every device: describe it on a mesh without fsdp.
        dev_bytes = state_bytes_per_device(state, sharding.make_mesh("data=8"))
    else:
        mesh = sharding.make_mesh(layout)
        placed = sharding.shard_state(state, mesh)
        jitted = sharding.make_sharded_train_step(
            make_train_step(xy_loss(model.apply), TX), mesh, sharding.state_shardings(placed)
        )
        args = [(placed, sharding.shard_batch(b, mesh), KEY) for b in batches]
        dev_bytes = state_bytes_per_device(placed, None)
    return jitted, args, dev_bytes


def needed(m):
    """What a step holds at once: its arguments, temps and the outputs not aliased to them."""
    return m["argument"] + m["temp"] + m["output"] - m["alias"]


def memory(compiled):
    m = compiled.memory_analysis()
    keys = ("argument", "output", "alias", "temp")
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in keys}
    out["peak"] = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    return out


def wire_bytes(found):
    """{(category, dtype): [count, bytes]}: gathers into matmuls, matmul-gradient reductions (from
    a matmul, or named after one), the rest."""
    out = collections.defaultdict(lambda: [0, 0])
    for c in found:
        if c.kind == "all-gather" and c.into_matmul:
            cat = "gather"
        elif c.kind in ("all-reduce", "reduce-scatter") and (
            c.from_matmul or c.op_name.endswith("dot_general")
        ):  # the second stage of a two-axis reduction (data after fsdp) reads a slice of the first
            cat = "grad"
        else:
            cat = "other"
        out[(cat, c.dtype)][0] += 1
        out[(cat, c.dtype)][1] += c.nbytes
    return dict(out)


def measure(layout, policy, module, params, batches, cfg):
    """Compiles one variant; returns its figures (and the compiled step, for timing)."""
    t0 = time.perf_counter()
    jitted, ladder, dev_bytes = build_layout(layout, policy, module, params, batches)
    args, per_dev = ladder[0], jax.device_count()
    info = {"state_dev": dev_bytes}
    if policy in TIMED:
        compiled = jitted.lower(*args).compile()
        info["compile_s"] = time.perf_counter() - t0
        info["mem"] = memory(compiled)
        # temp at other batch sizes (compiled, never run): per-device tokens -> temp bytes.
        info["temps"] = {cfg["batch"] * cfg["seq"] // per_dev: info["mem"]["temp"]}
        for a, b in zip(ladder[1:], batches[1:]):
            tokens = b["x"].size // per_dev
            info["temps"][tokens] = memory(jitted.lower(*a).compile())["temp"]
        info["final_dtypes"] = sorted({c.dtype for c in hlo.collectives(compiled.as_text())})
        info["run"] = (compiled, args)
    # The program right after SPMD partitioning, before XLA:CPU widens 16-bit collectives.
    if layout == "pmap":
        found = hlo.collectives(hlo.partitioned_hlo(jitted, *args))
    else:
        found = sharding.collectives(jitted, *args)
    info["wire"] = wire_bytes(found)
    info["batch_dev"] = sum(np.asarray(v).nbytes for v in batches[0].values()) // per_dev
    info["tokens_dev"] = cfg["batch"] * cfg["seq"] // per_dev
    print(
        f"  {layout:14s} {policy:27s} state/dev {dev_bytes / MIB:8.2f} MiB"
        + (
            f", temp {info['mem']['temp'] / MIB:8.2f} MiB (by tokens/dev: "
            + ", ".join(f"{t}: {v / MIB:.1f}" for t, v in sorted(info["temps"].items()))
            + ")"
            f", compiled in {info['compile_s']:.1f} s"
            if "mem" in info
            else ""
        ),
        flush=True,
    )
    return info


# ----- running


def first(x):
    x = np.asarray(x)
    return float(x.reshape(-1)[0])


def bench_width(cfg, d_model, steps):
    module = make_module(cfg, d_model)
    batches = [make_batch(cfg)] + [make_batch(cfg, s) for s in cfg["ladder"]]
    params = wrap(module, "float32").init(KEY, batches[0]["x"][:2])["params"]
    n_params = sum(int(np.size(p)) for p in jax.tree.leaves(params))
    print(f"[d={d_model}] {n_params:,} params; compiling ...", flush=True)
    infos = {}
    for policy in POLICIES:
        for layout in LAYOUTS:
            infos[(layout, policy)] = measure(layout, policy, module, params, batches, cfg)
    runners = {}
    for k, i in infos.items():
        if "run" in i:
            compiled, args = i.pop("run")
            runners[k] = stepper(compiled, *args)
    for k, run in runners.items():  # sanity: finite losses, the same across layouts
        losses = [first(run()["loss"]) for _ in range(3)]
        assert np.all(np.isfinite(losses)), f"{k}: non-finite loss {losses}"
        infos[k]["losses"] = losses
    for k, i in infos.items():
        ref = infos[(BASE[0], k[1])].get("losses") if "losses" in i else None
        if ref and abs(i["losses"][-1] - ref[-1]) > 1e-2 * abs(ref[-1]):
            print(f"[d={d_model}] WARNING: {k} loss {i['losses']} differs from pmap's {ref}")
    print(f"[d={d_model}] timing {cfg['rounds']} rounds x {steps} steps ...", flush=True)
    t0 = time.perf_counter()
    times = interleaved(runners, cfg["rounds"], steps)
    print(f"[d={d_model}] timed in {time.perf_counter() - t0:.0f} s", flush=True)
    for k, t in times.items():
        infos[k]["times"] = t
    return {"d": d_model, "params": n_params, "infos": infos}


# ----- deriving: memory per param and per token


def costs(res, cfg):
    """Per variant, temp over the batch ladder modelled as temp(T) = max(A, G + κT): XLA reuses
    buffers, so the optimizer update's temps and the activations need not be live at once. κ is
    the slope between the two largest batches; G the smallest intercept that puts the line over
    every measured point (XLA's buffer assignment is not smooth in T); A the temp at the smallest
    batch. Per param: s (state), a = A/P, g = G/P; k = κ / (layers x d_model)."""
    out = {}
    for key, i in res["infos"].items():
        if "temps" not in i:
            continue
        ladder = sorted(i["temps"].items())
        (t1, v1), (t2, v2) = ladder[-2:]
        kappa = (v2 - v1) / (t2 - t1)
        fixed, low = max(v - kappa * t for t, v in ladder), ladder[0][1]
        model = {t: max(low, fixed + kappa * t) / v - 1 for t, v in ladder}
        out[key] = {
            "s": i["state_dev"] / res["params"],
            "a": low / res["params"],
            "g": fixed / res["params"],
            "kappa": kappa,
            "k": kappa / (cfg["layers"] * res["d"]),
            "act": min(kappa * i["tokens_dev"], i["mem"]["temp"]),  # for the plot
            "check": model[i["tokens_dev"]],  # the model over the measured temp, at the batch
            "over": max(model.values()),  # its largest overestimate on the ladder
        }
    return out


# ----- reporting


def memory_table(res):
    tokens = sorted(next(i["temps"] for i in res["infos"].values() if "temps" in i))
    rows = [
        "| layout | policy | state MiB/dev (describe) | argument | output (alias) | temp "
        "| argument + temp + unaliased output | XLA peak_memory_in_bytes | per device? "
        "| temp at " + " / ".join(str(t) for t in tokens) + " tokens/dev |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (layout, policy), i in res["infos"].items():
        if "mem" not in i:
            continue
        m = i["mem"]
        per_dev = "yes" if m["argument"] == i["state_dev"] + i["batch_dev"] else "no"
        ladder = " / ".join(f"{i['temps'][t] / MIB:.1f}" for t in tokens)
        rows.append(
            f"| {layout} | {policy} | {i['state_dev'] / MIB:.2f} | {m['argument'] / MIB:.2f} "
            f"| {m['output'] / MIB:.2f} ({m['alias'] / MIB:.2f}) | {m['temp'] / MIB:.2f} "
            f"| {needed(m) / MIB:.2f} | {m['peak'] / MIB:.2f} | {per_dev} | {ladder} |"
        )
    return rows


def time_table(res):
    base = res["infos"][BASE]["times"]
    rows = [
        "| layout | policy | step ms (median) | vs pmap float32 | lower+compile s | loss steps 1→3 |",
        "|---|---|---|---|---|---|",
    ]
    for (layout, policy), i in res["infos"].items():
        if "times" not in i:
            continue
        rows.append(
            f"| {layout} | {policy} | {median_ms(i['times']):.1f} "
            f"| {fine_ratio(ratio_stats(i['times'], base))} | {i['compile_s']:.1f} "
            f"| {i['losses'][0]:.4f} → {i['losses'][-1]:.4f} |"
        )
    return rows


def wire_cell(wire, cat):
    parts = [(dt, n, b) for (c, dt), (n, b) in sorted(wire.items()) if c == cat]
    return ", ".join(f"{dt} {b / MIB:.3f} ({n})" for dt, n, b in parts) or "—"


def wire_table(res):
    rows = [
        "| layout | policy | param gathers into matmuls: MiB (count) | matmul-grad reductions "
        "| other collectives | total MiB | dtypes after XLA:CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for (layout, policy), i in res["infos"].items():
        w = i["wire"]
        total = sum(b for _, b in w.values())
        final = ", ".join(i.get("final_dtypes", [])) or "(not compiled)"
        rows.append(
            f"| {layout} | {policy} | {wire_cell(w, 'gather')} | {wire_cell(w, 'grad')} "
            f"| {wire_cell(w, 'other')} | {total / MIB:.3f} | {final} |"
        )
    return rows


def cat_bytes(info, cat):
    """(bytes, count) of one category's collectives, all dtypes."""
    parts = [v for (c, _), v in info["wire"].items() if c == cat]
    return sum(b for _, b in parts), sum(n for n, _ in parts)


def wire_headline(res):
    inf, rows = res["infos"], []
    for layout in LAYOUTS:
        f32, bf16 = inf[(layout, "float32")], inf[(layout, "mixed_bfloat16")]
        red = inf[(layout, "mixed_bfloat16,reduce=bf16")]
        (g32, n32), (g16, n16) = cat_bytes(f32, "gather"), cat_bytes(bf16, "gather")
        (r32, _), (r16, _) = cat_bytes(bf16, "grad"), cat_bytes(red, "grad")
        if g32:
            per = (g16 / n16) / (g32 / n32)
            gathers = (
                f"{g16 / MIB:.3f} / {g32 / MIB:.3f} = {g16 / g32:.3f} | {n16} / {n32} | {per:.3f}"
            )
        else:
            gathers = "none (pmap) | — | —"
        rows.append(
            f"| {layout} | {gathers} | {r16 / MIB:.3f} / {r32 / MIB:.3f} = {r16 / r32:.3f} |"
        )
    return [
        "| layout | param gathers MiB per step, mixed_bfloat16 / float32 | gathers, count "
        "| bytes per gather, bf16 / f32 | matmul-grad reductions MiB, reduce=bf16 / "
        "mixed_bfloat16 |",
        "|---|---|---|---|---|",
    ] + rows


GPU_RESULTS = "gpu_compile_h200.md"


def fit_lines(results, cfg):
    """The CPU program's memory per param and per token. Which models and batches fit a GPU is
    no longer extrapolated from them: the H200's compiler answers it (experiments/gpu_compile.py)."""
    tokens = sorted(results[-1]["infos"][BASE]["temps"])
    lines = [
        "Which model and batch fit a GPU's memory is no longer extrapolated from these CPU "
        f"programs: `experiments/gpu_compile.py` compiles the steps for 8 H200s ({GPU_RESULTS}: "
        "the 1.5B and 7B Llama-style decoders under pmap, fsdp=8 and data=2,fsdp=4, per-device "
        "memory, bytes on the wire by dtype, the largest global batch that fits). What this CPU "
        "program costs, per device and step, with P params and T tokens per device:",
        "",
        "    memory(P, T) = s·P + max(a·P, g·P + κ·T)",
        "",
        "- s: describe's state bytes per device / P (fp32 params + 2 Adam moments: 12 B/param "
        "replicated, 12/F split F ways);",
        "- temp(T) is not a sum: XLA reuses buffers, so the optimizer update's temps and the "
        "activations need not be live at once. Each step is compiled at "
        + ", ".join(str(t) for t in tokens)
        + " tokens per device (never run); κ is the slope of temp between the two largest, g·P "
        "the smallest intercept that puts g·P + κ·T over every measured point (XLA's buffer "
        "assignment is not smooth in T, so this is an upper envelope), a·P the temp at the "
        "smallest batch; k = κ / (layers · d_model). XLA:CPU keeps activations float32 "
        "(jamp.wrap's choice on CPUs) and all-reduces weight gradients at full size, so these "
        "are not a GPU's costs.",
        "",
    ]
    lines += ["| d_model | layout | policy | s | a | g B/param | κ B/token | k "]
    lines[-1] += "| model / measured temp − 1: at the benchmark batch, largest on the ladder |"
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for (layout, policy), v in costs(r, cfg).items():
            lines.append(
                f"| {r['d']} | {layout} | {policy} | {v['s']:.2f} | {v['a']:.2f} | {v['g']:.2f} "
                f"| {v['kappa']:,.0f} | {v['k']:.1f} | {100 * v['check']:+.1f}%, "
                f"{100 * v['over']:+.1f}% |"
            )
    return lines


def headline_memory(results):
    """The README-sized table: per-device MiB at the largest width."""
    res = results[-1]
    rows = [
        f"| layout (8 devices, d_model={res['d']}, {res['params'] / 1e6:.1f} M params) | policy "
        "| params + Adam state MiB/dev | temp MiB/dev | argument + temp + unaliased output "
        "MiB/dev | step time vs pmap float32 |",
        "|---|---|---|---|---|---|",
    ]
    base = res["infos"][BASE]["times"]
    for (layout, policy), i in res["infos"].items():
        if "mem" not in i:
            continue
        rows.append(
            f"| {layout} | {policy} | {i['state_dev'] / MIB:.1f} | {i['mem']['temp'] / MIB:.1f} "
            f"| {needed(i['mem']) / MIB:.1f} | {ratio_stats(i['times'], base)[0]:.2f} |"
        )
    return rows


# ----- plots


def short(key):
    layout, policy = key
    return f"{layout}\n" + policy.replace("mixed_bfloat16", "mixed bf16").replace(",", "\n")


def plot(results, cfg, stem):
    plt = pyplot()
    if plt is None:
        return []
    names = []
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        c = costs(res, cfg)
        keys = [k for k in res["infos"] if k in c]
        state = np.array([res["infos"][k]["state_dev"] for k in keys]) / MIB
        act = np.array([c[k]["act"] for k in keys]) / MIB
        temp = np.array([res["infos"][k]["mem"]["temp"] for k in keys]) / MIB
        x = np.arange(len(keys))
        ax.bar(x, state, label="params + Adam state (describe)", color="#4477aa")
        act = np.clip(act, 0, None)
        ax.bar(
            x,
            temp - act,
            bottom=state,
            label="temp: the rest (grads, gathered weights, Adam)",
            color="#ee9944",
        )
        ax.bar(x, act, bottom=state + temp - act, label="temp: κ·T (activations)", color="#66bb66")
        ax.set_xticks(x, [short(k) for k in keys], fontsize=8)
        ax.set_ylabel("MiB per device (XLA memory analysis)")
        ax.set_ylim(0, 1.4 * max(state + temp))  # room for the legend
        ax.set_title(f"d_model={res['d']}, {res['params'] / 1e6:.1f} M params, 8 CPU devices")
        ax.legend(fontsize=8, loc="upper right")
    save(fig, f"{stem}_memory.png", dpi=110)
    names.append(f"{os.path.basename(stem)}_memory.png")
    fig, axes = plt.subplots(1, len(results), figsize=(7.5 * len(results), 4.8), squeeze=False)
    colors = {"bf16": "#cc6677", "f32": "#4477aa", "pred": "#999999", "s32": "#ddcc77"}
    hatches = {"gather": "", "grad": "//", "other": ".."}
    for ax, res in zip(axes[0], results):
        keys = list(res["infos"])
        x = np.arange(len(keys))
        bottom = np.zeros(len(keys))
        parts = sorted({p for i in res["infos"].values() for p in i["wire"]})
        for cat, dt in parts:
            vals = np.array([res["infos"][k]["wire"].get((cat, dt), [0, 0])[1] for k in keys])
            ax.bar(x, vals / MIB, bottom=bottom, color=colors.get(dt, "#777777"),
                   hatch=hatches[cat], edgecolor="black", linewidth=0.4, label=f"{cat} {dt}")  # fmt: skip
            bottom += vals / MIB
        ax.set_xticks(x, [short(k) for k in keys], fontsize=7)
        ax.set_ylabel("MiB per device per step (collective results)")
        ax.set_ylim(0, 1.45 * max(bottom))
        ax.set_title(f"d_model={res['d']}: collectives after SPMD partitioning")
        ax.legend(fontsize=7, loc="upper center", ncol=3)
    save(fig, f"{stem}_wire.png", dpi=110)
    names.append(f"{os.path.basename(stem)}_wire.png")
    return names


# ----- the results file


def setup_lines(cfg, elapsed, load0):
    """The results file's head: the environment record, the model and how it was timed."""
    shared = (
        " (the machine is shared: another engineer's tests may run at the same time, so only "
        "ratios within this run count)"
    )
    devices = f", {jax.device_count()} simulated devices"
    return benchmark_environment(load0, devices=devices, note=shared) + [
        f"- model: TransformerLM, {cfg['layers']} layers, d_model {', '.join(map(str, cfg['widths']))}"
        f" (heads max(4, d/64), mlp 4d), vocab {cfg['vocab']}, seq {cfg['seq']}, global batch "
        f"{cfg['batch']} (per device {cfg['batch'] // jax.device_count()}; x{', '.join(map(str, cfg['ladder']))} "
        "compiled for memory only); "
        "optax.adam(1e-4); loss scale loss_scale_for(policy) (no-op for these policies)",
        f"- timing: {cfg['rounds']} rounds x steps {cfg['steps']} per variant, interleaved "
        f"(experiments/_harness/timing.py); total wall time {elapsed / 60:.1f} min",
        f"- float32 baselines' matmul precision: jax_default_matmul_precision="
        f"{jax.config.jax_default_matmul_precision!r} (DEFAULT; on CPU that is true fp32)",
        RATIO_NOTE,
    ]


SEMANTICS = [
    "How to read the numbers:",
    "",
    "- XLA's memory analysis describes one device's program, for the pmapped step too (pmap runs "
    "on jit + shard_map): its argument bytes equal the whole unreplicated state plus one device's "
    "batch slice (column 'per device?' checks argument = describe's state bytes/device + batch "
    "bytes/device). Output bytes are mostly aliased to the donated arguments (alias column), so "
    "a step needs about argument + temp + unaliased output. (XLA:CPU's peak_memory_in_bytes "
    "is printed as it comes, for comparison.)",
    "- temp holds the gradients, Adam's update temporaries, gathered param copies and the "
    "activations, in buffers XLA reuses between phases of the step; the plot splits it at the "
    "benchmark batch into κ·T (κ: the slope of temp over the two largest batches) and the rest.",
    "- Wire bytes are the per-device result bytes of every collective in the program right after "
    "SPMD partitioning (jamp.hlo reads it through an XLA dump of that pass), summed over one step: "
    "all-gathers that feed a matmul (the weights), all-reduces / reduce-scatters whose operand "
    "is a matmul result or that are named after one (weight gradients; on a data x fsdp mesh the "
    "second stage, over data, reduces a slice of the first), and the "
    "rest (biases, norm scales, the embedding row lookup and its scatter-add, the loss and "
    "finiteness flag). Result bytes, not link traffic: a ring all-reduce moves about 2(N−1)/N of "
    "its result per device, a reduce-scatter (N−1)/N of its input, an all-gather (N−1)/N of its "
    "result.",
    "- XLA:CPU widens every 16-bit collective to float32 after partitioning (its float "
    "normalization), so the program that actually ran here moves float32 (last column of the "
    "wire table); the partitioned program is the one XLA:GPU runs as it is.",
    "- Step times on one 2-core CPU with 8 simulated devices measure the cost of the partitioned "
    "program's extra work (collectives are memory copies here), not a network: read them as "
    "ratios within this run only.",
]


def results_page(results, cfg, env, pngs):
    lines = ["# jamp sharding benchmark on CPU: pmap vs FSDP, 8 simulated devices", ""] + env
    lines += ["", "## Headline: memory per device and step time", ""] + headline_memory(results)
    lines += ["", "## Headline: what crosses the wire (largest width)", ""]
    lines += wire_headline(results[-1])
    lines += ["", "## Memory per param and per token (and what fits a GPU)", ""]
    lines += fit_lines(results, cfg)
    for res in results:
        lines += ["", f"## d_model={res['d']} ({res['params']:,} params)", ""]
        lines += ["### Memory (MiB per device, XLA memory analysis)", ""] + memory_table(res)
        lines += ["", "### Step time", ""] + time_table(res)
        lines += ["", "### Collectives after SPMD partitioning (per device, one step)", ""]
        lines += wire_table(res) + [""] + wire_headline(res)
    lines += [""] + SEMANTICS
    lines += [""] + [f"![{p}]({p})" for p in pngs]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny widths, 2 rounds: smoke run")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--out", default=None, help=f"results file (default {OUT}; none if --quick)")
    args = p.parse_args()
    if args.out is None and not args.quick:
        args.out = OUT
    cfg = dict(QUICK if args.quick else FULL)
    if args.rounds:
        cfg["rounds"] = args.rounds
    assert jax.device_count() == 8, f"need 8 devices, got {jax.devices()}"
    start, load0 = time.perf_counter(), loadavg()
    results = [bench_width(cfg, d, s) for d, s in zip(cfg["widths"], cfg["steps"])]
    env = setup_lines(cfg, time.perf_counter() - start, load0)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    pngs = plot(results, cfg, os.path.splitext(args.out)[0]) if args.out else []
    text = results_page(results, cfg, env, pngs)
    print("\n" + text)
    if args.out:
        write_keeping_notes(args.out, text)


if __name__ == "__main__":
    main()
