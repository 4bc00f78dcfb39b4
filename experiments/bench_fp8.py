"""fp8 against bf16: train-step time and temporary memory of the Transformer LM by width, and what
the compiled program really runs.

    python experiments/bench_fp8.py            # on a GPU (Hopper / Ada: fp8 GEMMs), ~2-3 min
    python experiments/bench_fp8.py --quick    # a tiny check on any machine, writes nothing

Per width (GPU: GPT-2 small, 12 x 768 at sequence 1024, then 4 x 2048 and 2 x 4096, where the
GEMMs are large enough for fp8 to pay; CPU: small sizes, fp8 is emulated there), one full jitted
train step (`jamp.make_train_step`, Adam, fp32 master weights, donated state) of

  mixed_bfloat16   jamp.wrap(model, "mixed_bfloat16")
  mixed_fp8        jamp.wrap(model, "mixed_fp8") with a delayed-scaling state (history 16)
  mixed_fp8_cur    the same with current scaling (an amax reduction before every GEMM)
  flax_bf16        the peer: the same network in plain Flax, dtype=bf16 on every layer
                   (experiments/_fp8_peer.py's PeerLM)
  flax_fp8         the same with flax.linen.fp8_ops' Fp8DirectDotGeneralOp on the same layer
                   matmuls (delayed scaling, history 16), its fp8 variables threaded by a
                   hand-written step

timed interleaved in rounds (experiments/_harness/timing.py); it reports the median per-round ratio to
mixed_bfloat16. From each compiled step it counts the GEMMs by operand types: on a GPU an fp8
GEMM is a cuBLASLt custom call whose operands are f8e4m3fn / f8e5m2 (XLA falls back to a wider
GEMM on GPUs without fp8, silently: this is where that shows). Writes
experiments/results/fp8_speed_<machine>.md.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time

import jax
import optax
from _harness import RESULTS
from _harness.environment import command, device_description, machine_name, today, versions
from _harness.tables import fmt_ratio
from _harness.timing import interleaved, median_ms, ratio_stats, stepper

import jamp
from jamp import fp8
from jamp.models.transformer import TransformerLM
from jamp.train import tasks

KEY = jax.random.key(0)
TX = optax.adam(1e-4)


def widths(on_gpu: bool, quick: bool):
    """(label, model sizes, batch, seq)."""
    if quick:
        return [("tiny 1 x 64", dict(num_layers=1, d_model=64, num_heads=2, mlp_dim=256), 4, 32)]
    if on_gpu:
        return [
            ("GPT-2 small 12 x 768", dict(num_layers=12, d_model=768, num_heads=12), 16, 1024),
            ("4 x 2048", dict(num_layers=4, d_model=2048, num_heads=16), 16, 1024),
            ("2 x 4096", dict(num_layers=2, d_model=4096, num_heads=32), 8, 1024),
        ]
    return [
        ("2 x 256", dict(num_layers=2, d_model=256, num_heads=4), 16, 128),
        ("2 x 512", dict(num_layers=2, d_model=512, num_heads=8), 8, 128),
    ]


def gemm_counts(hlo: str) -> dict[str, int]:
    """Dots and GEMM custom calls of an optimized HLO module by operand types."""
    types, counts = {}, collections.Counter()
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = \(?(\w+)\[.*?\]\S* (\w+(?:-\w+)?)\((.*?)\)", line)
        if not m:
            continue
        name, dtype, op, args = m.groups()
        types[name] = dtype
        operands = [a.strip().lstrip("%") for a in args.split(",")][:2]
        if op == "dot" or (op == "custom-call" and "matmul" in line):
            kind = "dot" if op == "dot" else "gemm"
            target = re.search(r'custom_call_target="([^"]+)"', line)
            label = f"{kind} {'x'.join(types.get(a, '?') for a in operands)}"
            if target:
                label += f" ({target.group(1)})"
            counts[label] += 1
    return dict(counts)


def _runner(step, state, data):
    """Compiles `step` once; returns (a step runner that carries the donated state, (compile
    seconds, temp MiB), the compiled step's GEMMs by operand type)."""
    t0 = time.perf_counter()
    compiled = step.lower(state, data, KEY).compile()
    compile_s = time.perf_counter() - t0
    temp_mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
    run = stepper(compiled, state, data, KEY)
    return run, (compile_s, temp_mib), gemm_counts(compiled.as_text())


def build_jamp(sizes, batch, seq, policy, recipe):
    cfg = dict(sizes, mlp_dim=sizes.get("mlp_dim", 4 * sizes["d_model"]), max_len=seq)
    model = jamp.wrap(TransformerLM(vocab_size=50304 if seq >= 1024 else 256, **cfg), policy)
    tokens = jax.random.randint(KEY, (batch, seq + 1), 0, 256)
    data = {"tokens": tokens}
    params = model.init(KEY, tokens[:, :-1])["params"]
    loss_fn = tasks.make_loss_fn(model, "lm")
    f8 = None
    if recipe:
        f8 = fp8.init_state(loss_fn, params, {}, data, KEY, recipe=recipe)
    state = jamp.TrainState.create(params, TX, fp8_state=f8)
    step = jax.jit(jamp.make_train_step(loss_fn, TX), donate_argnums=0)
    return _runner(step, state, data)


def build_flax(sizes, batch, seq, fp8_ops: bool):
    """The Flax peer (experiments/_fp8_peer.py), bf16 layers, with or without flax's fp8 op."""
    from _fp8_peer import PeerLM, fp8_dot_cls
    from _fp8_peer import make_train_step as peer_step
    from flax.training import train_state

    cfg = dict(sizes, mlp_dim=sizes.get("mlp_dim", 4 * sizes["d_model"]), max_len=seq)
    dot_cls = fp8_dot_cls(16) if fp8_ops else None
    model = PeerLM(vocab_size=50304 if seq >= 1024 else 256, dot_cls=dot_cls, **cfg)
    tokens = jax.random.randint(KEY, (batch, seq + 1), 0, 256)
    data = {"tokens": tokens}
    variables = dict(model.init(KEY, tokens[:, :-1]))
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables, tx=TX)
    step = peer_step(tasks.make_loss_fn(model, "lm"), None, None)
    return _runner(step, state, data)


VARIANTS = {
    "mixed_bfloat16": ("mixed_bfloat16", None),
    "mixed_fp8": ("mixed_fp8", "delayed"),
    "mixed_fp8_cur": ("mixed_fp8", "current"),
    "flax_bf16": ("flax", False),
    "flax_fp8": ("flax", True),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    rounds = args.rounds or (2 if args.quick else 7)
    steps = 1 if args.quick else 5
    lines = [
        f"# fp8 vs bf16 train step, Transformer LM ({machine_name()})",
        "",
        f"{today()}, `{command()}`, {device_description()}, {versions('jax')}; {rounds} rounds "
        f"x {steps} steps, median per-round ratio [min-max].",
        "The baseline is mixed_bfloat16 (bf16 GEMMs with fp32 accumulation), not float32.",
        "",
        "| width | batch x seq | variant | ms/step | vs bf16 | compile s | temp MiB "
        "| GEMMs in the compiled step |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    t_start = time.perf_counter()
    for label, sizes, batch, seq in widths(on_gpu, args.quick):
        runners, compile_s, gemms = {}, {}, {}
        for name, (policy, recipe) in VARIANTS.items():
            if policy == "flax":
                built = build_flax(sizes, batch, seq, recipe)
            else:
                built = build_jamp(sizes, batch, seq, policy, recipe)
            runners[name], compile_s[name], gemms[name] = built
        for run in runners.values():  # warm up
            jax.block_until_ready(run())
        times = interleaved(runners, rounds, steps)
        for name in VARIANTS:
            stats = ratio_stats(times[name], times["mixed_bfloat16"])
            ms = median_ms(times[name])
            counts = "; ".join(f"{k}: {v}" for k, v in sorted(gemms[name].items()))
            ratio = "1" if name == "mixed_bfloat16" else fmt_ratio(stats, 3)
            lines.append(
                f"| {label} | {batch} x {seq} | {name} | {ms:.2f} | {ratio} | "
                f"{compile_s[name][0]:.1f} | {compile_s[name][1]:.1f} | {counts} |"
            )
            print(lines[-1], flush=True)
    lines += ["", f"Wall time {time.perf_counter() - t_start:.0f} s."]
    if on_gpu and not any("f8" in line for line in lines if "mixed_fp8 " in line):
        lines.append("No fp8 GEMM in the compiled fp8 steps: XLA fell back to a wider GEMM.")
    text = "\n".join(lines) + "\n"
    if args.quick:
        print(text)
        return 0
    out = RESULTS / f"fp8_speed_{machine_name()}.md"
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
