"""The GPT-2-small table on one GPU inside a short loan: every row written as soon as it is timed.

    python experiments/gpu_suite.py --out DIR             # on a GPU (experiments/gpu_suite.sh)
    python experiments/gpu_suite.py --quick --out DIR     # the CPU dry run, tiny shapes

Rows (experiments/gpt2_variants.py; batch 8 x 1024 unless named, AdamW, next-token loss, random
tokens): jamp mixed_bfloat16, the same with the head and loss in chunks
(jamp.losses.fused_linear_cross_entropy), float32 (TF32: JAX's default precision on NVIDIA
GPUs), the hand-written bf16 network with cuDNN attention, PyTorch's GPT-2 (Hugging Face's) under
torch.autocast(bfloat16) + torch.compile as the peer (gpu_suite_torch.py), jamp mixed_float16
(dynamic loss scale), Hugging Face's Flax GPT-2 wrapped in mixed_bfloat16 (transformers < 5),
with the inputs shifted and with the loss as Hugging Face's own recipe writes it (run_clm_flax:
the logits shifted, one-hot labels);
jamp bf16 and the peer at batch 32 (where the MFU target is); jamp mixed_fp8 (delayed
scaling); then the jamp bf16 step again under other XLA settings (command buffers off, cuBLAS
GEMMs instead of Triton).

Each row is its own process (its own peak memory, its own XLA flags). They start together, up to
--parallel at once, so that their compiles (17-40 s each on the loaned machine) overlap on its
CPU cores, and take a lock for the timed part, so that no two time the GPU at once. A row's
time: the median of 3 blocks of 10 steps after 3 warm-up steps; its peak: the allocator's peak
bytes (JAX's `peak_bytes_in_use`, torch's `max_memory_allocated`). Beside it, XLA's plan for the
same program and the step time `jamp.inspect.timing` predicts from it (a model, not a
measurement). The jamp bf16 row also profiles 5 steps with jax.profiler: its 20 costliest
kernels by measured time, the prediction beside each.

Writes into --out, each time a row lands: gpu_suite.md (the tables), gpu_suite_rows.jsonl (one
JSON row per line), gpu_suite_kernels.md (the profile's table) and gpu_suite.log (the workers'
output). A row still running at --deadline is killed and left out, with a line saying so.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _harness import RESULTS  # noqa: E402
from _harness.environment import device_record  # noqa: E402

#: (row, variant of gpt2_variants or "torch", XLA flags, label), in the order they start.
ROWS = (
    ("lm_jamp_bf16", "lm_jamp_bf16", "", "jamp.wrap mixed_bfloat16 + make_train_step"),
    (
        "lm_jamp_bf16_chunked",
        "lm_jamp_bf16_chunked",
        "",
        "the same, head + loss in chunks (jamp.losses.fused_linear_cross_entropy)",
    ),
    ("lm_fp32", "lm_fp32", "", "float32 (TF32), plain value_and_grad + optax"),
    ("lm_hand_bf16", "lm_hand_bf16", "", "hand-written bf16 Flax, cuDNN attention, plain step"),
    ("torch_compile_bf16", "torch", "", "PyTorch GPT-2, torch.autocast(bf16) + torch.compile"),
    ("lm_jamp_f16", "lm_jamp_f16", "", "jamp.wrap mixed_float16 + make_train_step (loss scale)"),
    ("hf_jamp_bf16", "hf_jamp_bf16", "", "Hugging Face Flax GPT-2, jamp.wrap mixed_bfloat16"),
    (
        "hf_jamp_bf16_hfloss",
        "hf_jamp_bf16_hfloss",
        "",
        "the same, the loss as HF's run_clm_flax writes it (logits shifted, one-hot labels)",
    ),
    ("lm_jamp_bf16_b32", "lm_jamp_bf16", "", "jamp.wrap mixed_bfloat16, batch 32"),
    ("torch_compile_bf16_b32", "torch", "", "PyTorch GPT-2, autocast + torch.compile, batch 32"),
    ("lm_jamp_fp8", "lm_jamp_fp8", "", "jamp.wrap mixed_fp8 (delayed scaling) + make_train_step"),
    (
        "lm_jamp_bf16_no_cmdbuf",
        "lm_jamp_bf16",
        "--xla_gpu_enable_command_buffer=",
        "jamp bf16, XLA command buffers off",
    ),
    (
        "lm_jamp_bf16_cublas",
        "lm_jamp_bf16",
        "--xla_gpu_enable_triton_gemm=false",
        "jamp bf16, cuBLAS GEMMs (Triton GEMMs off)",
    ),
)
PROFILED = "lm_jamp_bf16"
#: Rows at their own batch (the MFU target is at 32); the others take --batch.
BATCH = {"lm_jamp_bf16_b32": 32, "torch_compile_bf16_b32": 32}
WARMUP, BLOCKS, STEPS = 3, 3, 10
PEAK_TFLOPS = 989.4  # H100 SXM and H200 dense bf16, for MFU (PaLM's model FLOPs)


def _gpu():
    """The GPU of jamp.target that the predictions are for: the one this machine has (a loan
    may be an H100 or an H200), the H200 on a CPU (the dry run)."""
    import jax

    from jamp.target import GPUS

    kind = getattr(jax.devices()[0], "device_kind", "")
    return next((g for g in GPUS.values() if g.kind == kind), GPUS["h200"])


# ----- a worker: one row in its own process


def _timed(run, lock_path: pathlib.Path, steps: int, blocks: int, warmup: int):
    """Under the lock: `warmup` calls, then `blocks` blocks of `steps`; seconds per step."""
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for _ in range(warmup):
                run(True)
            times = []
            for _ in range(blocks):
                start = time.perf_counter()
                for _ in range(steps):
                    run(False)
                run(True)  # wait for the block's last step
                times.append((time.perf_counter() - start) / (steps + 1))
            return times
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _jax_row(row, variant, args) -> dict:
    import gpt2_variants
    import jax

    from jamp import hlo
    from jamp.inspect import timing

    on_gpu = jax.default_backend() == "gpu"
    built = gpt2_variants.build(variant, batch=args.batch, quick=args.quick)
    state = built.make_args()
    started = time.perf_counter()
    compiled = built.step.lower(*state).compile()
    compile_s = time.perf_counter() - started
    text = compiled.as_text()
    program = hlo.parse(text)
    estimate = timing.estimate(program, _gpu()) if on_gpu or args.quick else None
    losses = []

    def run(wait):
        nonlocal state
        out = compiled(*state)
        state = gpt2_variants.next_state(variant, state, out)
        if wait:
            loss = out[1]["loss"] if isinstance(out[1], dict) else out[2]
            losses.append(float(loss))

    times = _timed(run, args.lock, args.steps, args.blocks, args.warmup)
    stats = jax.devices()[0].memory_stats() or {}
    memory = compiled.memory_analysis()
    step = statistics.median(times)
    tokens = args.batch * (gpt2_variants.QUICK if args.quick else gpt2_variants.GPT2)["seq"]
    out = {
        "step_ms": step * 1e3,
        "tokens_per_s": tokens / step,
        "mfu": built.model_flops / step / (PEAK_TFLOPS * 1e12),
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30 or None,
        "plan_peak_gib": (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
        )
        / 2**30,
        "compile_s": compile_s,
        "loss_first_last": [losses[0], losses[-1]],
        "params": built.params,
        "attention": _attention_masks(program),
    }
    if estimate is not None:
        out.update(predicted_ms=estimate.seconds * 1e3, kernels=estimate.kernels)
    if row == PROFILED and args.profile:
        out["profile"] = _profile(compiled, run, text, estimate, args)
    return out


def _attention_masks(program) -> str:
    """cuDNN's fused attention calls of a program by mask, as cuDNN runs them: "12 causal" (half
    the scores skipped), "12 none + bias" (every score computed, an additive bias read); "-"
    without any (attention written out, or none)."""
    from jamp.hlo.kernels import attention_mask

    masks: dict[str, int] = {}
    for inst in program.instructions:
        mask = attention_mask(inst)
        if mask is not None:
            masks[mask] = masks.get(mask, 0) + 1
    return ", ".join(f"{n} {mask}" for mask, n in sorted(masks.items())) or "-"


def _profile(compiled, run, text, estimate, args) -> dict:
    """5 steps under jax.profiler: measured time per kernel, the prediction beside each."""
    import tempfile

    import jax

    from jamp.inspect import _profile_trace as trace

    logdir = tempfile.mkdtemp(prefix="jamp-suite-profile-")
    with open(args.lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            run(True)
            with jax.profiler.trace(logdir):
                for _ in range(5):
                    run(False)
                run(True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    space = trace.read(logdir)
    module = compiled.as_text().split("\n", 1)[0].split()[1].rstrip(",")
    timelines, _, source = trace.timelines_of(space, module)
    measured: dict[str, float] = {}
    for timeline in timelines[:1]:
        for start, end, op in timeline:
            measured[op] = measured.get(op, 0.0) + (end - start) / 6e6  # ns -> ms per step, 6 steps
    predicted = {}
    if estimate is not None:
        from jamp import hlo
        from jamp.hlo.kernels import kernels
        from jamp.inspect.timing import kernel_seconds

        gpu = _gpu()
        for k in kernels(hlo.parse(text)):
            predicted[k.name] = (kernel_seconds(k, gpu)[0] * k.count * 1e3, k.kind)
    top = sorted(measured.items(), key=lambda kv: -kv[1])[:20]
    return {
        "source": source,
        "module": module,
        "measured_total_ms": sum(measured.values()),
        "kernels_seen": len(measured),
        "top": [
            {
                "kernel": op,
                "measured_ms": ms,
                "predicted_ms": predicted.get(op, (None, ""))[0],
                "kind": predicted.get(op, (None, ""))[1],
            }
            for op, ms in top
        ],
    }


def worker(args) -> None:
    row, variant, _, label = next(r for r in ROWS if r[0] == args.worker)
    args.batch = BATCH.get(row, args.batch)
    started = time.perf_counter()
    try:
        if variant == "torch":
            import gpu_suite_torch

            result = gpu_suite_torch.row(args, _timed)
        else:
            result = _jax_row(row, variant, args)
    except ImportError as e:  # a missing peer (torch, transformers): the row says so
        result = {"skipped": f"{type(e).__name__}: {e}"}
    result.update(row=row, label=label, batch=args.batch, wall_s=time.perf_counter() - started)
    result.update(device_record(), predicted_for=_gpu().name)
    (args.out / f".row-{row}.json").write_text(json.dumps(result))


# ----- the driver


def _per_token(row: dict, other) -> str:
    """`row`'s tokens/s over `other`'s (rows at other batches compare per token)."""
    return f"{row['tokens_per_s'] / other['tokens_per_s']:.2f}x" if other else "-"


def _table(rows: list[dict], quick: bool) -> str:
    base = next((r for r in rows if r["row"] == "lm_fp32" and "step_ms" in r), None)
    peers = {
        r.get("batch"): r for r in rows if r["row"].startswith("torch_compile") and "step_ms" in r
    }
    lines = [
        "| row | batch | step ms | tokens/s | vs fp32 | vs torch.compile | MFU | peak GiB "
        "| XLA plan GiB "
        "| predicted ms (error) | kernels | cuDNN attention | compile s | loss first -> last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "step_ms" not in r:
            lines.append(f"| {r['label']} | {r.get('skipped', 'no result')} |" + " |" * 12)
            continue
        ms = r["step_ms"]
        pred = r.get("predicted_ms")
        err = f"{pred:.2f} ({pred / ms - 1:+.1%})" if pred else "-"
        peer = peers.get(r.get("batch"))
        lines.append(
            f"| {r['label']} | {r.get('batch', '-')} | {ms:.2f} | {r['tokens_per_s'] / 1e3:.1f}k "
            f"| {_per_token(r, base)} | {_per_token(r, peer)} | {r['mfu']:.1%} | "
            + (f"{r['peak_gib']:.2f}" if r.get("peak_gib") else "-")
            + f" | {r.get('plan_peak_gib', 0) or 0:.2f} | {err} | {r.get('kernels', '-')} "
            f"| {r.get('attention', '-')} | {r['compile_s']:.1f} | {r['loss_first_last'][0]:.3f} -> "
            f"{r['loss_first_last'][1]:.3f} |"
        )
    shape = (
        "tiny shapes (--quick)"
        if quick
        else "GPT-2 small (12 x 768, vocab 50304), sequences of 1024, batch 8 unless a row says"
    )
    head = [
        "# GPU suite",
        "",
        f"{shape}; AdamW; step time = median of {BLOCKS} blocks of {STEPS} steps after "
        f"{WARMUP} warm-up steps, each row in its own process; fp32 = TF32 (JAX's default "
        "matmul precision on NVIDIA GPUs); peak = the allocator's peak bytes; XLA plan = "
        "its buffer assignment for the program; predicted = jamp.inspect.timing's model of the "
        "compiled program (a model, not a measurement); MFU = PaLM's model FLOPs against "
        f"{PEAK_TFLOPS} TFLOP/s; vs fp32 and vs torch.compile are ratios of tokens/s (the "
        "torch.compile row at the row's batch).",
        "",
    ]
    env = rows[0] if rows else {}
    head.append(
        f"Device: {env.get('device', '?')} ({env.get('backend', '?')}), jax {env.get('jax', '?')}; "
        f"predicted for jamp.target's {env.get('predicted_for', '?')}."
    )
    return "\n".join(head + [""] + lines) + "\n"


def _kernel_table(profile: dict) -> str:
    lines = [
        "# The jamp bf16 step's costliest kernels, measured (jax.profiler) and predicted",
        "",
        f"From {profile['source']}, module {profile['module']}: {profile['kernels_seen']} kernels "
        f"seen, {profile['measured_total_ms']:.2f} ms of kernel time per step. Predicted = "
        "jamp.inspect.timing (a model, not a measurement).",
        "",
        "| kernel | kind | measured ms/step | predicted ms/step |",
        "|---|---|---|---|",
    ]
    for k in profile["top"]:
        pred = f"{k['predicted_ms']:.3f}" if k["predicted_ms"] is not None else "-"
        lines.append(f"| {k['kernel']} | {k['kind']} | {k['measured_ms']:.3f} | {pred} |")
    return "\n".join(lines) + "\n"


def driver(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "gpu_suite.log", "a")
    lock = args.out / ".gpu_suite.lock"
    deadline = time.monotonic() + args.deadline
    pending = [r for r in ROWS if not args.rows or r[0] in args.rows]
    running: dict[str, subprocess.Popen] = {}
    rows: list[dict] = []
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
    common = ["--out", str(args.out), "--lock", str(lock), "--batch", str(args.batch)]
    common += ["--quick"] * args.quick + ["--profile"] * (not args.no_profile)
    while (pending or running) and time.monotonic() < deadline:
        while pending and len(running) < args.parallel:
            row, _, flags, _ = pending.pop(0)
            row_env = dict(env)
            if flags:
                row_env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
            cmd = [sys.executable, __file__, "--worker", row, *common]
            running[row] = subprocess.Popen(cmd, env=row_env, stdout=log, stderr=log)
            print(f"[{time.strftime('%H:%M:%S')}] started {row}", flush=True)
        for row, proc in list(running.items()):
            if proc.poll() is None:
                continue
            del running[row]
            path = args.out / f".row-{row}.json"
            if path.exists():
                result = json.loads(path.read_text())
                path.unlink()
            else:
                label = next(r[3] for r in ROWS if r[0] == row)
                result = {"row": row, "label": label, "skipped": f"exit {proc.returncode}"}
            rows.append(result)
            _write(args.out, rows, args.quick)
            print(f"[{time.strftime('%H:%M:%S')}] {row}: {_brief(result)}", flush=True)
        time.sleep(0.5)
    for row, proc in running.items():
        proc.kill()
        label = next(r[3] for r in ROWS if r[0] == row)
        rows.append(
            {"row": row, "label": label, "skipped": f"killed at the {args.deadline} s deadline"}
        )
        print(f"deadline: {row} killed", flush=True)
    _write(args.out, rows, args.quick)
    return (
        0
        if rows and all("step_ms" in r or "ImportError" in r.get("skipped", "") for r in rows)
        else 1
    )


def _brief(result: dict) -> str:
    if "step_ms" not in result:
        return result.get("skipped", "no result")
    pred = result.get("predicted_ms")
    return f"{result['step_ms']:.2f} ms" + (f" (predicted {pred:.2f})" if pred else "")


def _write(out: pathlib.Path, rows: list[dict], quick: bool) -> None:
    (out / "gpu_suite_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "gpu_suite.md").write_text(_table(rows, quick))
    profiled = next((r for r in rows if r.get("profile")), None)
    if profiled:
        (out / "gpu_suite_kernels.md").write_text(_kernel_table(profiled["profile"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "gpu_suite")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: the CPU dry run")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=5, help="rows compiling at once")
    parser.add_argument("--deadline", type=float, default=270.0, help="seconds for all rows")
    parser.add_argument("--rows", nargs="*", help="only these rows")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--lock", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps, args.blocks, args.warmup = STEPS, BLOCKS, WARMUP
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
