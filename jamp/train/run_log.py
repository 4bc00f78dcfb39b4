"""What the training program tells its user while it runs: the progress line, skipped steps and
the modules that overflowed, the persistent-overflow stop, the profile of the first steps, and
the device's 16-bit support; the throughput's bookkeeping (`Window`) and the log lines (`Log`).
Split from `jamp.train.loop`, which calls these at its log points.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Optional

import jax
import numpy as np

from jamp import fp8, hardware, lowbit, precision
from jamp.inspect.overflow import forward_nonfinite
from jamp.inspect.profile import profile_steps
from jamp.precision import auto_reason
from jamp.train import tasks
from jamp.train.metrics import MetricWriter, mean_metrics, peak_memory_mib
from jamp.train.overflow_watch import (
    OverflowLog,
    OverflowWatch,
    TrainingDiverged,
    advice,
    without_flags,
)
from jamp.train.run_config import RunConfig


def show_progress(bar, step, record, counts):
    text = (
        f"loss {record['loss']:.4f}  scale {record['loss_scale']:g}  "
        f"{record['examples_per_sec']:.0f} ex/s"
    )
    if counts:  # the modules whose gradients overflowed in this window, most often first
        worst = sorted(counts, key=counts.get, reverse=True)
        text += f"  overflow: {', '.join(worst[:3])}" + (" ..." if len(worst) > 3 else "")
    if bar is not None:
        bar.set_postfix_str(text)
    elif jax.process_index() == 0:
        print(f"step {step}  {text}", flush=True)


def profile_first_steps(run, p_train_step, placement, state, batches, rng, step, workdir):
    """Runs the first steps under the profiler (profile_steps): one warm-up step, then
    `run.profile_steps` profiled ones; they are training steps like any other (same batches, same
    updates), only their metrics are not logged. Writes profile.txt / .png / .json."""
    if step + 1 + run.profile_steps > run.num_train_steps:
        print(
            f"profile_steps: {run.num_train_steps - step} steps left, fewer than the "
            f"{run.profile_steps} + 1 warm-up to profile; not profiling",
            flush=True,
        )
        return state, step
    device_batches = (placement.batch(b) for b in batches)
    state, profile = profile_steps(
        p_train_step,
        state,
        device_batches,
        run.profile_steps,
        rng=rng,
        logdir=workdir / "profile_trace",  # for TensorBoard's / XProf's own viewers
    )
    if jax.process_index() == 0:
        profile.save(workdir)
        print(profile.table(), flush=True)
        print(f"profile written to {workdir / 'profile.png'} and profile.txt", flush=True)
    return state, step + 1 + run.profile_steps


def bare_dtype_note(spec, policy) -> str:
    """A line for a policy given as a bare 16-bit dtype name (`bf16`): it keeps the params in
    that dtype too, as in jmp, where a newcomer may have meant the mixed preset; else ""."""
    if not isinstance(spec, str) or "=" in spec or spec.strip() in precision.PRESETS:
        return ""
    params = np.dtype(policy.param_dtype)
    if params == np.float32:
        return ""
    return (
        f"note: policy {spec!r} keeps the params in {params.name} too (a bare dtype name sets all "
        f"three dtypes, as in jmp); for float32 params and {params.name} compute, use "
        f"'mixed_{params.name}'"
    )


def hardware_notes(spec, policy) -> dict:
    """Prints which policy "auto" picked and a warning when the policy's 16-bit compute dtype is
    emulated here (naming the faster choice); returns the summary's rows for both."""
    picked = auto_reason(spec)
    warning = hardware.emulation_warning(policy)
    bare = bare_dtype_note(spec, policy)
    if jax.process_index() == 0:
        if picked:
            print(picked, flush=True)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        if bare:
            print(bare, file=sys.stderr, flush=True)
    compute = np.dtype(policy.compute_dtype)
    rows = {"auto policy": picked} if picked else {}
    if precision.is_fp8(policy):
        support = hardware.support(fp8.E4M3)
        native = {True: "native", False: "emulated", None: "unknown"}[support.native]
        lowering = hardware.matmul_lowering(compute)
        rows["hardware"] = f"fp8 {native} on {support.device}; the bfloat16 matmuls: {lowering}"
    elif compute != np.float32:
        support = hardware.support(compute)
        native = {True: "native", False: "emulated", None: "unknown"}[support.native]
        lowering = hardware.matmul_lowering(compute)
        rows["hardware"] = f"{compute.name} {native} on {support.device}; {lowering} matmuls"
    # (the warning is printed once, above: the summary's hardware row says "emulated")
    return rows


def say(bar, text):
    if jax.process_index() != 0:  # every process sees the same averaged metrics
        return
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)


def note_overflows(log, window, step, writer, bar) -> dict[str, int]:
    """Logs the skipped steps of a window (the last being `step`) with the modules whose
    gradients were non-finite; returns how many of those steps each module overflowed in."""
    events = log.update(window, first_step=step - len(window) + 1)
    counts: dict[str, int] = {}
    for at, names in events:
        writer.write_event(at, "overflow", grads_nonfinite=names)
        for name in names:
            counts[name] = counts.get(name, 0) + 1
    if events:
        steps = ", ".join(str(at) for at, _ in events[:5]) + (" ..." if len(events) > 5 else "")
        worst = ", ".join(f"{n} ({c})" for n, c in sorted(counts.items(), key=lambda x: -x[1]))
        say(bar, f"step {steps}: skipped, non-finite gradients in {worst}")
    return counts


def trace_overflow(model, task, host_state, batch, rng, step, writer, bar):
    """Re-runs a skipped step's batch forward, every module's output checked (trace_nonfinite)."""
    variables = {"params": host_state.params, **host_state.model_state}
    # The step's own dropout key also folded in the replica index: masks may differ.
    key = jax.random.fold_in(rng, step - 1)
    found = forward_nonfinite(
        model, variables, tasks.model_inputs(task, batch), train=True, rngs={"dropout": key}
    )
    writer.write_event(step, "overflow_trace", forward_nonfinite=list(found.modules))
    say(bar, f"step {step}: skipped; {found.describe()}")


def note_precision_changes(changes, writer, bar):
    """Logs adaptive precision's changes: a line each, a metrics.jsonl / TensorBoard event."""
    for change in changes:
        writer.write_event(
            change.step,
            "precision_change",
            module=change.module,
            from_dtype=change.from_dtype,
            to_dtype=change.to_dtype,
            reason=change.reason,
        )
        say(bar, change.describe())


def watch_overflow(watch, window, step, run, bar, adapt=None):
    """Stops or warns when the last steps were all skipped with the loss scale at its floor."""
    message = watch.update(window, step)
    if message is None:
        return
    stuck = adapt.why_stuck() if adapt is not None else None
    tips = advice()
    if stuck:
        message = f"{message}; {stuck}"
        if adapt.nothing_left():  # float32 already: the format's advice would mislead
            tips = ""
    tips = f"; {tips}" if tips else ""
    if run.on_persistent_overflow == "stop":
        if bar is not None:
            bar.close()
        raise TrainingDiverged(f"training stopped at {message}{tips}")
    if jax.process_index() == 0:  # every process sees the same averaged metrics
        text = f"warning: {message}; continuing as on_persistent_overflow=warn asks{tips}"
        if bar is not None:
            bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)


class Window:
    """The steps since the last log line: their metrics (still on the device) and the time they
    took, less what is not training throughput (compiling, the hooks); the time spent waiting
    for data is counted apart. Its totals over the run give the summary's throughput."""

    def __init__(self) -> None:
        self.pending: list = []
        self.start: Optional[float] = None  # None until the first (compiling) step is done
        self.wait = 0.0
        self.steps_timed, self.time_timed = 0, 0.0

    def restart(self) -> None:
        self.pending, self.start, self.wait = [], time.perf_counter(), 0.0

    def leave_out(self, since: float) -> None:
        """Keeps the time from `since` until now out of the window's."""
        if self.start is not None:
            self.start += time.perf_counter() - since

    def close(self) -> float:
        """The window's seconds, added to the run's totals."""
        assert self.start is not None
        elapsed = time.perf_counter() - self.start
        self.steps_timed += len(self.pending)
        self.time_timed += elapsed
        return elapsed


@dataclasses.dataclass
class Log:
    """Where the loop's observations go: the metrics files, the progress bar, the overflow
    counts by module and the watch for a run whose loss scale keeps falling."""

    run: RunConfig
    writer: MetricWriter
    bar: Any
    adapt: Any
    overflow: OverflowWatch
    overflows: OverflowLog = dataclasses.field(default_factory=OverflowLog)

    def first_step(self, fetched: list, step: int) -> None:
        """The first step compiles: its overflows are noted, its time and metrics are not."""
        note_overflows(self.overflows, fetched, step, self.writer, self.bar)
        watch_overflow(self.overflow, fetched, step, self.run, self.bar, self.adapt)

    def window(self, window: Window, fetched: list, step: int, schedule) -> None:
        """One log line: the window's mean metrics, its throughput and overflows."""
        counts = note_overflows(self.overflows, fetched, step, self.writer, self.bar)
        record = mean_metrics([without_flags(m) for m in fetched])
        record.update({f"nonfinite/{name}": n for name, n in counts.items()})
        elapsed = window.close()  # after the fetch: the device has finished the window's steps
        record["examples_per_sec"] = len(window.pending) * self.run.batch_size / elapsed
        record["data_wait_fraction"] = window.wait / elapsed
        record["learning_rate"] = float(schedule(step - record.get("skipped_steps", 0)))
        self.writer.write(step, record, kind="train")
        show_progress(self.bar, step, record, counts)
        watch_overflow(self.overflow, fetched, step, self.run, self.bar, self.adapt)


def _fp8_summary(run, state) -> str:
    recipe, history, margin = run.fp8
    sites = len(state.fp8_state.sites) if fp8.uses_state(state.fp8_state) else 0
    how = "current"
    if recipe == "delayed":
        how = f"delayed (amax history {history})"
    return (
        f"{how}, margin {margin:g}, {sites} fp8 matmuls; output head, embedding and "
        "convolutions bf16"
    )


def summary(run, task, state, step, eval_metrics, window, dataset, t_begin) -> dict:
    """The run's summary table: what ran, how far, how fast, in how much memory."""
    metric = "perplexity" if task == "lm" else "accuracy"
    memory = peak_memory_mib()
    if run.parallelism == "sharded":
        axes = ", ".join(f"{a}={n}" for a, n in run.mesh.shape.items())
        parallelism = f"sharded jit, mesh {axes}"
    else:
        parallelism = f"pmap over {jax.device_count()} devices"
    return {
        "policy": precision.describe(run.policy),
        "parallelism": parallelism,
        "loss scale": type(run.loss_scale).__name__,
        **({"fp8 scaling": _fp8_summary(run, state)} if run.fp8 else {}),
        "steps": step,
        "skipped steps": int(state.skipped_steps),
        "final loss scale": float(state.loss_scale.loss_scale),
        f"eval {metric}": eval_metrics.get(metric),
        "throughput (examples/s)": (
            round(window.steps_timed * run.batch_size / window.time_timed, 1)
            if window.time_timed
            else None
        ),
        "wall time (s)": round(time.perf_counter() - t_begin, 1),
        "peak memory (MiB)": memory,
        "state bytes per param": state_bytes(run, state),
    }


def state_bytes(run, state) -> str:
    """Params and optimizer state per parameter (gradients not included), e.g. "12.00 (params
    4.00, optimizer 8.00)"; with 16-bit params, how their updates are rounded."""
    per = lowbit.bytes_per_param(state)
    copies = f", 16-bit copies {per['copies']:.2f}" if per["copies"] else ""
    text = (
        f"{per['total']:.2f} (params {per['params']:.2f}{copies}, optimizer {per['opt_state']:.2f})"
    )
    param_dtype = np.dtype(run.policy.param_dtype)
    if param_dtype != np.float32:
        text += f"; {param_dtype.name} params, {run.param_rounding} rounding"
    return text
