"""`train_and_evaluate(config, workdir)`: the training program, wired from the library's parts.

The ml_collections config is converted once, at the top, into the small dataclasses each part owns
(`RunConfig` here, `jamp.data.DataConfig`, `jamp.optim.OptimConfig`); nothing below sees the
ConfigDict. Every check that can fail on user input runs before the workdir is touched, and a
checkpoint is restored before anything is written into the workdir.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import pathlib
import signal
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from jamp import data as data_lib
from jamp import parallel, tasks
from jamp.checkpoint import Checkpointer
from jamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from jamp.metrics import MetricWriter, mean_metrics, peak_memory_mib, summary_table
from jamp.models import get_model, model_task
from jamp.optim import OptimConfig, make_optimizer
from jamp.overflow_watch import ON_PERSISTENT_OVERFLOW, OverflowWatch, TrainingDiverged, advice
from jamp.precision import describe, get_policy
from jamp.state import TrainState
from jamp.step import make_eval_step, make_train_step
from jamp.wrap import wrap

LOSS_SCALES = ("auto", "dynamic", "static", "none")


class ConfigError(ValueError):
    """A config value the program cannot run with; its message is one line for the user."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The loop's own settings, taken from the config."""

    model: str
    model_config: dict
    batch_size: int
    policy: jmp.Policy
    loss_scale: Any
    num_train_steps: int
    accumulation_steps: int
    max_grad_norm: float | None
    log_every_steps: int
    eval_every_steps: int
    checkpoint_every_steps: int
    max_checkpoints_to_keep: int
    seed: int
    on_persistent_overflow: str
    persistent_overflow_steps: int


def _make_loss_scale(kind: str, p: ml_collections.ConfigDict, policy: jmp.Policy):
    if kind not in LOSS_SCALES:
        raise ConfigError(f"unknown loss_scale {kind!r}; accepted: {', '.join(LOSS_SCALES)}")
    if kind == "auto":
        kind = "dynamic" if np.dtype(policy.compute_dtype) == np.float16 else "none"
    if kind == "none":
        return NoOpLossScale()
    # The fields whose names differ from the library's arguments are checked here, so that the
    # message names the config field; the library checks the others.
    initial, low, high = float(p.initial), float(p.min_scale), float(p.max_scale)
    if not 0 < initial < math.inf:
        raise ConfigError(f"loss_scale_params.initial must be finite and > 0, got {initial}")
    if kind == "static":
        return StaticLossScale(initial)
    if not 0 < low <= high < math.inf:
        raise ConfigError(
            "loss_scale_params need 0 < min_scale <= max_scale < inf, "
            f"got min_scale {low} and max_scale {high}"
        )
    if not low <= initial <= high:
        raise ConfigError(
            f"loss_scale_params.initial must be between min_scale {low} and max_scale {high}, "
            f"got {initial}"
        )
    try:
        return DynamicLossScale(
            initial,
            growth_interval=int(p.growth_interval),
            growth_factor=float(p.growth_factor),
            backoff_factor=float(p.backoff_factor),
            hysteresis=int(p.hysteresis),
            min_loss_scale=low,
            max_loss_scale=high,
        )
    except ValueError as e:  # "DynamicLossScale: growth_factor must be > 1, got 1.0"
        raise ConfigError(f"loss_scale_params: {e}") from None


def _positive(config, *names):
    for name in names:
        value = config[name]
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def parse_config(config: ml_collections.ConfigDict):
    """Validates `config` and splits it into (RunConfig, DataConfig, OptimConfig).

    Raises:
      ConfigError: with a one-line message naming the bad field and what is accepted.
    """
    _positive(config, "batch_size", "num_train_steps", "accumulation_steps", "log_every_steps")
    _positive(config, "eval_every_steps", "checkpoint_every_steps", "max_checkpoints_to_keep")
    _positive(config, "persistent_overflow_steps")
    if config.on_persistent_overflow not in ON_PERSISTENT_OVERFLOW:
        raise ConfigError(
            f"unknown on_persistent_overflow {config.on_persistent_overflow!r}; accepted: "
            f"{', '.join(ON_PERSISTENT_OVERFLOW)}"
        )
    try:
        policy = get_policy(config.policy)
        loss_scale = _make_loss_scale(config.loss_scale, config.loss_scale_params, policy)
        task = model_task(config.model)
        optim = OptimConfig(
            optimizer=config.optimizer,
            learning_rate=float(config.learning_rate),
            schedule=config.schedule,
            warmup_steps=int(config.warmup_steps),
            num_train_steps=int(config.num_train_steps),
            weight_decay=float(config.weight_decay),
            momentum=float(config.momentum),
        )
        data = data_lib.DataConfig(
            dataset=config.dataset,
            batch_size=int(config.batch_size),
            data_dir=config.data_dir or None,
            seq_len=int(config.seq_len),
            seed=int(config.seed),
            download=bool(config.download),
            **_synthetic_fields(config),
        )
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    if not config.max_grad_norm >= 0:  # also NaN
        raise ConfigError(
            f"max_grad_norm must be >= 0 (0: no clipping), got {config.max_grad_norm}"
        )
    # Checked here rather than when the step is traced, after the workdir has been written.
    devices = jax.device_count()
    per_device, remainder = divmod(config.batch_size, devices)
    if not remainder and per_device % config.accumulation_steps:
        raise ConfigError(
            f"accumulation_steps {config.accumulation_steps} does not divide the per-device batch "
            f"of {per_device} (batch_size {config.batch_size} over {devices} devices): use a "
            f"batch_size that is a multiple of {devices * config.accumulation_steps}"
        )
    run = RunConfig(
        model=config.model,
        model_config=config.model_config.to_dict(),
        batch_size=config.batch_size,
        policy=policy,
        loss_scale=loss_scale,
        num_train_steps=config.num_train_steps,
        accumulation_steps=config.accumulation_steps,
        max_grad_norm=float(config.max_grad_norm) or None,
        log_every_steps=config.log_every_steps,
        eval_every_steps=config.eval_every_steps,
        checkpoint_every_steps=config.checkpoint_every_steps,
        max_checkpoints_to_keep=config.max_checkpoints_to_keep,
        seed=int(config.seed),
        on_persistent_overflow=config.on_persistent_overflow,
        persistent_overflow_steps=config.persistent_overflow_steps,
    )
    return run, data, optim, task


def _synthetic_fields(config) -> dict:
    # Only the synthetic recipes carry these fields.
    fields = {}
    for name in ("image_shape", "num_classes", "vocab_size"):
        if name in config:
            value = config[name]
            fields[name] = tuple(value) if isinstance(value, (list, tuple)) else value
    return fields


def resolve_workdir(workdir: str | None) -> pathlib.Path:
    """The workdir to use (a fresh one under ./runs/ when None), checked without creating it."""
    if not workdir and jax.process_count() > 1:  # each process would pick its own time stamp
        raise ConfigError("a multi-process run needs --workdir, the same one for every process")
    if not workdir:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        workdir = pathlib.Path("runs") / stamp
        print(f"workdir: {workdir.resolve()}", flush=True)
    path = pathlib.Path(workdir).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"workdir {path} is not writable: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"workdir {path} is not writable: no write permission on {existing}")
    return path


def prepare_workdir(path: pathlib.Path) -> pathlib.Path:
    """Creates the workdir and checks that a file can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".jamp_write_probe.{jax.process_index()}"  # processes share the workdir
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"workdir {path} is not writable: {e.strerror or e}") from None
    return path


def _init_state(model, tx, loss_scale, info, seed) -> TrainState:
    dtype = jnp.int32 if info.task == "lm" else jnp.float32
    dummy = jnp.zeros((1, *info.input_shape), dtype)
    variables = dict(model.init(jax.random.key(seed), dummy, train=False))
    params = variables.pop("params")
    return TrainState.create(params, tx, model_state=variables, loss_scale=loss_scale)


class _StopFlag:
    """Turns SIGTERM and Ctrl-C into a request to save and stop after the current step.

    All processes of a multi-process run must stop at the same step: one that stopped alone would
    leave the others waiting in a collective for ever. There `should_stop` compares the processes'
    flags every `every` steps (a signal to any process stops all) and answers False in between.
    """

    def __init__(self, every: int = 1):
        self.signal = None
        self._every = every
        self._stopping = False
        self._saved = {}

    def should_stop(self, step: int) -> bool:
        if jax.process_count() == 1:
            return self.signal is not None
        if step % self._every == 0:
            signalled = multihost_utils.process_allgather(np.int32(self.signal is not None))
            self._stopping = bool(np.any(signalled))
            if self._stopping and self.signal is None:
                self.signal = "a signal to another process"
        return self._stopping

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        del frame
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


def evaluate(p_eval_step, state, dataset, task) -> dict:
    """One pass over the eval split; returns accuracy (and loss / perplexity for lm)."""
    totals = None
    for batch in dataset.eval_batches():
        sums = parallel.unreplicate(p_eval_step(state, parallel.shard(batch)))
        sums = jax.device_get(sums)
        totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
    return tasks.summarize_eval(task, totals)


def _progress(total, initial):
    if not sys.stderr.isatty() or jax.process_index() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=0.5)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | None) -> dict:
    """Trains and evaluates the model `config` describes; returns the summary it prints.

    Resumes from the latest checkpoint in `workdir/checkpoints` if there is one. Raises
    `ConfigError`, `jamp.data.DataError` or `jamp.checkpoint.CheckpointError` (one-line messages)
    for problems with the user's input, before writing anything into the workdir.
    """
    t_begin = time.perf_counter()
    run, data_cfg, optim_cfg, task = parse_config(config)
    workdir = resolve_workdir(workdir)
    # Each process reads its slice of every global batch; the batch divides over all devices.
    data_cfg = dataclasses.replace(
        data_cfg, process_index=jax.process_index(), process_count=jax.process_count()
    )
    dataset = data_lib.get_dataset(data_cfg, jax.device_count())
    if dataset.info.task != task:
        raise ConfigError(
            f"model {run.model!r} trains on {task} data but dataset {data_cfg.dataset!r} is "
            f"{dataset.info.task} data"
        )
    try:
        model = wrap(get_model(run.model, dataset.info.num_classes, **run.model_config), run.policy)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    workdir = prepare_workdir(workdir)
    tx, schedule = make_optimizer(optim_cfg)
    state = _init_state(model, tx, run.loss_scale, dataset.info, run.seed)
    with Checkpointer(workdir / "checkpoints", max_to_keep=run.max_checkpoints_to_keep) as ckpt:
        if ckpt.latest_step() is not None:
            # CheckpointError if it belongs to another config; damaged newer ones are set aside
            state = ckpt.restore(state, set_aside_damaged=True)
            print(f"resuming from the checkpoint at step {int(state.step)}", flush=True)
        start = int(state.step)
        primary = jax.process_index() == 0  # the others hold the same averaged metrics
        with (
            MetricWriter(workdir, purge_step=start, enabled=primary) as writer,
            _StopFlag(every=run.log_every_steps) as stop,
        ):
            writer.write_config(config.to_dict())
            summary = _train(
                run, task, model, tx, schedule, state, start, dataset, ckpt, writer, stop, t_begin
            )
    summary["workdir"] = str(workdir)
    if jax.process_index() == 0:
        print(summary_table(summary), flush=True)
    return summary


def _train(
    run, task, model, tx, schedule, state, start, dataset, checkpointer, writer, stop, t_begin
):
    train_step = make_train_step(
        tasks.make_loss_fn(model, task),
        tx,
        axis_name=parallel.AXIS_NAME,
        accumulation_steps=run.accumulation_steps,
        max_grad_norm=run.max_grad_norm,
    )
    p_train_step = parallel.make_p_train_step(train_step)
    p_eval_step = parallel.make_p_eval_step(
        make_eval_step(tasks.make_eval_fn(model, task), axis_name=parallel.AXIS_NAME)
    )
    rng = jax.random.key(run.seed)
    state = parallel.replicate(state)
    batches = dataset.train_batches(start_step=start)
    bar = _progress(run.num_train_steps, start)
    pending, window_start, wait, eval_metrics = [], None, 0.0, {}
    steps_timed, time_timed = 0, 0.0
    overflow = OverflowWatch(run.loss_scale, run.persistent_overflow_steps)
    step = start
    while step < run.num_train_steps and not stop.should_stop(step):
        t0 = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - t0
        state, metrics = p_train_step(state, parallel.shard(batch), rng)
        pending.append(metrics)
        step += 1
        if bar is not None:
            bar.update(1)
        if step == start + 1:  # the first step compiles: keep it out of the throughput
            jax.block_until_ready(metrics)
            _watch_overflow(overflow, [parallel.unreplicate(metrics)], step, run, bar)
            window_start, wait, pending = time.perf_counter(), 0.0, []
            continue
        if step % run.log_every_steps == 0 or step == run.num_train_steps:
            window = [parallel.unreplicate(m) for m in jax.device_get(pending)]
            record = mean_metrics(window)
            elapsed = time.perf_counter() - window_start
            record["examples_per_sec"] = len(pending) * run.batch_size / elapsed
            record["data_wait_fraction"] = wait / elapsed
            record["learning_rate"] = float(schedule(step - record.get("skipped_steps", 0)))
            writer.write(step, record, kind="train")
            steps_timed, time_timed = steps_timed + len(pending), time_timed + elapsed
            _show(bar, step, record)
            _watch_overflow(overflow, window, step, run, bar)
            pending, window_start, wait = [], time.perf_counter(), 0.0
        hook_start = time.perf_counter()
        if step % run.eval_every_steps == 0 and step < run.num_train_steps:
            eval_metrics = evaluate(p_eval_step, state, dataset, task)
            writer.write(step, eval_metrics, kind="eval")
        if step % run.checkpoint_every_steps == 0:
            checkpointer.save(step, parallel.unreplicate(state))
        window_start += time.perf_counter() - hook_start  # hooks are not training throughput
    if bar is not None:
        bar.close()
    final = parallel.unreplicate(state)
    if checkpointer.latest_step() != step:
        checkpointer.save(step, final)
    if not stop.should_stop(step):
        eval_metrics = evaluate(p_eval_step, state, dataset, task)
        writer.write(step, eval_metrics, kind="eval")
    else:
        print(
            f"stopped by {stop.signal} at step {step}; checkpoint saved, run again with the "
            "same --workdir to resume",
            flush=True,
        )
    return _summary(run, task, final, step, eval_metrics, steps_timed, time_timed, dataset, t_begin)


def _show(bar, step, record):
    text = (
        f"loss {record['loss']:.4f}  scale {record['loss_scale']:g}  "
        f"{record['examples_per_sec']:.0f} ex/s"
    )
    if bar is not None:
        bar.set_postfix_str(text)
    elif jax.process_index() == 0:
        print(f"step {step}  {text}", flush=True)


def _watch_overflow(watch, window, step, run, bar):
    """Stops or warns when the last steps were all skipped with the loss scale at its floor."""
    message = watch.update(window, step)
    if message is None:
        return
    if run.on_persistent_overflow == "stop":
        if bar is not None:
            bar.close()
        raise TrainingDiverged(f"training stopped at {message}; {advice()}")
    if jax.process_index() == 0:  # every process sees the same averaged metrics
        text = f"warning: {message}; continuing as on_persistent_overflow=warn asks; {advice()}"
        if bar is not None:
            bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)


def _summary(run, task, state, step, eval_metrics, steps_timed, time_timed, dataset, t_begin):
    metric = "perplexity" if task == "lm" else "accuracy"
    memory = peak_memory_mib()
    return {
        "policy": describe(run.policy),
        "loss scale": type(run.loss_scale).__name__,
        "steps": step,
        "skipped steps": int(state.skipped_steps),
        "final loss scale": float(state.loss_scale.loss_scale),
        f"eval {metric}": eval_metrics.get(metric),
        "throughput (examples/s)": (
            round(steps_timed * run.batch_size / time_timed, 1) if time_timed else None
        ),
        "wall time (s)": round(time.perf_counter() - t_begin, 1),
        "peak memory (MiB)": memory,
    }
