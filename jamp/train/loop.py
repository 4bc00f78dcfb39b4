"""`train_and_evaluate(config, workdir)`: the training program, wired from the library's parts.

The ml_collections config is converted once, at the top, into the small dataclasses each part owns
(`jamp.train.run_config.parse_config`); nothing below sees the ConfigDict. Every check that can fail on
user input runs before the workdir is touched, and a checkpoint is restored before anything is
written into the workdir.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jamp import adaptive, sharding
from jamp.models import NnxModel, get_model
from jamp.precision import is_fp8
from jamp.state import TrainState
from jamp.step import make_eval_step
from jamp.train import adapting, fp8_sites, recipe_step, run_log, tasks
from jamp.train import data as data_lib
from jamp.train.checkpoint import Checkpointer
from jamp.train.metrics import MetricWriter, summary_table
from jamp.train.nnx_adapter import LinenView
from jamp.train.optim import make_optimizer
from jamp.train.overflow_watch import (  # noqa: F401 (TrainingDiverged is loop's API too)
    OverflowWatch,
    TrainingDiverged,
)
from jamp.train.run_config import (  # noqa: F401 (ConfigError and parse_config are loop's API too)
    ConfigError,
    RunConfig,
    parse_config,
    prepare_workdir,
    resolve_workdir,
)
from jamp.train.steps import Placement, Steps, replicated
from jamp.train.stop import StopFlag
from jamp.wrap import wrap


def build_model(run: RunConfig, data_cfg, task: str):
    """The dataset and the wrapped model a parsed config describes: `(dataset, model)`.

    Raises ConfigError (the model does not fit the data, a bad model_config or override) or
    `jamp.train.data.DataError`, with one-line messages; writes nothing.
    """
    dataset = data_lib.get_dataset(data_cfg, jax.device_count())
    return dataset, make_model(run, dataset.info, task, data_cfg.dataset)


def make_model(run: RunConfig, info, task: str, dataset: str):
    """The wrapped model of a parsed config, for data described by `info` (the `DatasetInfo` of
    dataset `dataset`).

    Raises ConfigError with a one-line message (the model does not fit the data, a bad
    model_config or override).
    """
    if info.task != task:
        raise ConfigError(
            f"model {run.model!r} trains on {task} data but dataset {dataset!r} is {info.task} data"
        )
    try:
        model = get_model(run.model, info.num_classes, **run.model_config)
        if isinstance(model, NnxModel):  # built by init, once the input shape is known
            model = LinenView(model, run.policy, run.activations)
        else:
            model = wrap(model, run.policy, activations=run.activations)
        if run.keep_in_float32:  # first:N / last:N need the model's blocks
            static = keep_in_float32(run, model, info)
            model = adapting.rewrap(model, static)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return model


def keep_in_float32(run: RunConfig, model, info) -> dict:
    """The `keep_in_float32` overrides of `run` for `model` (as `build_model` first wrapped it)."""
    if not run.keep_in_float32:
        return {}
    _, top_level = adapting.layout(model, info)
    paths = adapting.module_paths(model, info)
    try:
        return adaptive.placement_overrides(run.keep_in_float32, top_level, paths)
    except ValueError as e:
        raise ConfigError(f"keep_in_float32 {e}") from None


def init_state(
    model, tx, loss_scale, info, seed, fp8_scaling=None, adaptive_state=None, *, adaptive=False
) -> TrainState:
    """A fresh TrainState for `model` on data described by `info` (a dataset's `.info`).

    `fp8_scaling`, `(recipe, history, margin)` under an fp8 policy, gives it an fp8 state with a
    site for every fp8 matmul of the train step's loss. Under a 16-bit policy it keeps the
    params' copies in the compute dtype (`compute_params`), except for an adaptive run
    (`adaptive`, or an `adaptive_state`)."""
    dtype = jnp.int32 if info.task == "lm" else jnp.float32
    dummy = jnp.zeros((1, *info.input_shape), dtype)
    variables = dict(model.init(jax.random.key(seed), dummy, train=False))
    params = variables.pop("params")
    fp8_state = None
    if fp8_scaling is not None:
        fp8_state = fp8_sites.fp8_state_for(model, info, params, variables, fp8_scaling)
    return TrainState.create(
        params,
        tx,
        model_state=variables,
        loss_scale=loss_scale,
        fp8_state=fp8_state,
        adaptive_state=adaptive_state,
        compute_dtype=_copies_dtype(model, fp8_scaling, adaptive or adaptive_state is not None),
    )


def fresh_state(run, model, tx, info, adaptive_state=None) -> TrainState:
    """The recipe's fresh TrainState (`init_state` with the run's loss scale, seed, fp8 scaling
    and adaptive precision): what the loop, `--compile_for` and `python -m jamp.inspect` start
    from, as `jamp.train.recipe_step` gives their step."""
    return init_state(
        model,
        tx,
        run.loss_scale,
        info,
        run.seed,
        run.fp8,
        adaptive_state,
        adaptive=bool(run.adaptive),
    )


def _copies_dtype(model, fp8_scaling, adaptive: bool):
    """The dtype the state keeps the params' matrices in between steps (`compute_params`): a
    wrapped model's 16-bit compute dtype; None under fp8 (its matmuls cast with scales of their
    own) and adaptive precision (its promotions change which matmuls cast to what)."""
    policy = getattr(model, "policy", None)
    if policy is None or fp8_scaling is not None or adaptive or is_fp8(policy):
        return None
    dtype = jnp.dtype(policy.compute_dtype)
    return dtype if dtype.itemsize == 2 else None


def _restore_target(run, state):
    """What a checkpoint is restored into: under pmap the host state; sharded, the state's shapes
    and dtypes with the mesh's shardings, so that each process reads only its own shards and the
    restored state is on the mesh already (whichever parallelism wrote the checkpoint)."""
    if run.parallelism != "sharded":
        return state
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
        state,
        sharding.state_shardings(state, run.mesh),
    )


def evaluate(placement: Placement, state, dataset, task) -> dict:
    """One pass over the eval split; returns accuracy (and loss / perplexity for lm)."""
    totals: Any = None  # the summed metrics (a dict), from the first batch on
    for batch in dataset.eval_batches():
        sums = placement.fetch(placement.eval_step(state, placement.batch(batch)))
        sums = jax.device_get(sums)
        totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
    return tasks.summarize_eval(task, totals)


def _progress(total, initial):
    if not sys.stderr.isatty() or jax.process_index() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=0.5)


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str | pathlib.Path | None
) -> dict:
    """Trains and evaluates the model `config` describes; returns the summary it prints.

    Resumes from the latest checkpoint in `workdir/checkpoints` if there is one. Raises
    `ConfigError`, `jamp.train.data.DataError` or `jamp.train.checkpoint.CheckpointError` (one-line messages)
    for problems with the user's input, before writing anything into the workdir.
    """
    t_begin = time.perf_counter()
    run, data_cfg, optim_cfg, task = parse_config(config)
    workdir = resolve_workdir(workdir)
    # Each process reads its slice of every global batch; the batch divides over all devices.
    data_cfg = dataclasses.replace(
        data_cfg, process_index=jax.process_index(), process_count=jax.process_count()
    )
    dataset, model = build_model(run, data_cfg, task)
    adapt = None
    if run.adaptive:
        static = keep_in_float32(run, model, dataset.info)
        adapt = adapting.Adapting(run, model, dataset.info, static)
    workdir = prepare_workdir(workdir)
    tx, schedule = make_optimizer(optim_cfg)
    state = fresh_state(run, model, tx, dataset.info, adapt.init_state() if adapt else None)
    with Checkpointer(workdir / "checkpoints", max_to_keep=run.max_checkpoints_to_keep) as ckpt:
        if ckpt.latest_step() is not None:
            state = _restore(run, model, dataset.info, adapt, ckpt, state)
            if int(state.step) >= run.num_train_steps:
                return _complete(run, int(state.step), workdir)
        notes = run_log.hardware_notes(config.policy, run.policy)
        start = int(state.step)
        primary = jax.process_index() == 0  # the others hold the same averaged metrics
        with (
            MetricWriter(workdir, purge_step=start, enabled=primary) as writer,
            StopFlag(every=run.log_every_steps) as stop,
        ):
            writer.write_config(config.to_dict())
            session = _Session(
                run, task, model, tx, schedule, dataset, ckpt, writer, stop, workdir, adapt
            )
            summary = _Loop(session, state, start).train(state, t_begin)
    summary.update(notes)
    summary["workdir"] = str(workdir)
    if jax.process_index() == 0:
        print(summary_table(summary), flush=True)
    return summary


def _restore(run, model, info, adapt, ckpt: Checkpointer, state):
    """The latest checkpoint, restored in `state`'s form: CheckpointError if it belongs to another
    config (damaged newer ones are set aside); its fp8 sites under their names now; with adaptive
    precision, the promotions made before it hold again."""
    fit = fp8_sites.Fp8Sites(model, info, adapt is not None) if run.fp8 else None
    state = ckpt.restore(_restore_target(run, state), set_aside_damaged=True, fit=fit)
    if fit is not None:  # sites stored under their former names: their names now
        state = fit.current(state)
    if int(state.step) >= run.num_train_steps:
        return state
    print(f"resuming from the checkpoint at step {int(state.step)}", flush=True)
    if adapt is not None:
        state = adapt.resume(state)
        if run.fp8:
            fp8_sites.check_sites(run, adapt.model, info, state)
    return state


def _complete(run, step: int, workdir: pathlib.Path) -> dict:
    """A run whose checkpoint already holds its last step: one line saying so and how to go
    on, instead of a run of 0 steps with no throughput."""
    if jax.process_index() == 0:
        print(
            f"the run in {workdir} is complete: its checkpoint is at step {step} of "
            f"num_train_steps={run.num_train_steps}; to train on, raise --config.num_train_steps; "
            "to start afresh, give another --workdir",
            flush=True,
        )
    return {"complete": True, "step": step, "workdir": str(workdir)}


@dataclasses.dataclass
class _Session:
    """What a run trains with, fixed for its length (the model may change under `adapt`)."""

    run: RunConfig
    task: str
    model: Any
    tx: Any
    schedule: Any
    dataset: Any
    checkpointer: Checkpointer
    writer: MetricWriter
    stop: StopFlag
    workdir: pathlib.Path
    adapt: Any  # adaptive precision in the loop (`adapting.Adapting`), or None

    def current_model(self):  # with adaptive precision, the one its promotions (restored too) give
        return self.model if self.adapt is None else self.adapt.model


class _Loop:
    """A session's training loop from step `start`: its steps, batches, logging and hooks."""

    def __init__(self, s: _Session, state, start: int):
        run = s.run
        self.s, self.start = s, start
        calibrate = start == 0 and fp8_sites.needs_calibration(run, state)  # restored: full
        self.steps = Steps(run, self._train_step_fn, self._eval_step_fn, state, calibrate, start)
        self.rng = jax.random.key(run.seed)
        self.batches = s.dataset.train_batches(start_step=start)
        self.bar = _progress(run.num_train_steps, start)
        watch = OverflowWatch(run.loss_scale, run.persistent_overflow_steps)
        self.log = run_log.Log(run, s.writer, self.bar, s.adapt, watch)
        self.window = run_log.Window()
        self.eval_metrics: dict = {}

    def _train_step_fn(self, axis_name):
        s = self.s
        return recipe_step.train_step(s.run, s.current_model(), s.task, s.tx, axis_name)

    def _eval_step_fn(self, axis_name):
        eval_fn = tasks.make_eval_fn(self.s.current_model(), self.s.task)
        return make_eval_step(eval_fn, axis_name=axis_name)

    def train(self, state, t_begin: float) -> dict:
        """Trains from `start` to the run's last step (or a stop signal); the run's summary."""
        run = self.s.run
        state, step = self.steps.placement.place(state), self.start
        if run.profile_steps:
            state, step = self._profile(state, step)
        while step < run.num_train_steps and not self.s.stop.should_stop(step):
            state, step = self._step(state, step)
            self._hooks(state, step)
        return self._finish(state, step, t_begin)

    def _profile(self, state, step: int):
        if self.steps.calibrate:  # the profiled steps are plain ones
            state, _ = self.steps(state, next(self.batches), self.rng, step)
            step += 1
        placement = self.steps.placement
        state, step = run_log.profile_first_steps(
            self.s.run,
            placement.train_step,
            placement,
            state,
            self.batches,
            self.rng,
            step,
            self.s.workdir,
        )
        if self.bar is not None:
            self.bar.update(step - self.start)
        self.window.restart()
        return state, step

    def _step(self, state, step: int):
        """One train step, with what follows it: adaptive precision, an overflow's trace, logs."""
        s, steps, window = self.s, self.steps, self.window
        t0 = time.perf_counter()
        batch = next(self.batches)
        window.wait += time.perf_counter() - t0
        compiles, t_call = steps.compiles(step), time.perf_counter()
        state, metrics = steps(state, batch, self.rng, step)
        if compiles:
            window.leave_out(t_call)  # a compilation is not throughput
        window.pending.append(metrics)
        step += 1
        if self.bar is not None:
            self.bar.update(1)
        if s.adapt is not None:
            state = _adapt_step(s.run, s.adapt, steps, state, metrics, step, s.dataset, self.log)
        if s.run.trace_nonfinite and not bool(np.all(jax.device_get(metrics["grads_finite"]))):
            # Costs a wait for the device every step, and a forward pass on skipped ones only.
            host = steps.placement.host(state)
            model = s.current_model()
            run_log.trace_overflow(model, s.task, host, batch, self.rng, step, s.writer, self.bar)
        self._log(metrics, step)
        return state, step

    def _log(self, metrics, step: int) -> None:
        run, placement = self.s.run, self.steps.placement
        if step == self.start + 1:  # the first step compiles: keep it out of the throughput
            self.log.first_step([jax.device_get(placement.fetch(metrics))], step)
            self.window.restart()
        elif step % run.log_every_steps == 0 or step == run.num_train_steps:
            fetched = [placement.fetch(m) for m in jax.device_get(self.window.pending)]
            self.log.window(self.window, fetched, step, self.s.schedule)
            self.window.restart()

    def _hooks(self, state, step: int) -> None:
        """The evaluation and checkpoint due after `step`; not training throughput."""
        s, hook_start = self.s, time.perf_counter()
        if step % s.run.eval_every_steps == 0 and step < s.run.num_train_steps:
            self.eval_metrics = evaluate(self.steps.placement, state, s.dataset, s.task)
            s.writer.write(step, self.eval_metrics, kind="eval")
        if step % s.run.checkpoint_every_steps == 0:
            s.checkpointer.save(step, _savable(self.steps.placement.host(state), s.adapt))
        self.window.leave_out(hook_start)

    def _finish(self, state, step: int, t_begin: float) -> dict:
        """The last checkpoint and evaluation (none after a stop signal), and the summary."""
        s, placement = self.s, self.steps.placement
        if self.bar is not None:
            self.bar.close()
        if s.adapt is not None and s.adapt.pending:  # the last steps: recorded, not decided
            s.adapt.observe(placement.fetch)
        final = _savable(placement.host(state), s.adapt)
        if s.checkpointer.latest_step() != step:
            s.checkpointer.save(step, final)
        if not s.stop.should_stop(step):
            self.eval_metrics = evaluate(placement, state, s.dataset, s.task)
            s.writer.write(step, self.eval_metrics, kind="eval")
        else:
            print(
                f"stopped by {s.stop.signal} at step {step}; checkpoint saved, run again with the "
                "same --workdir to resume",
                flush=True,
            )
        summary = run_log.summary(
            s.run, s.task, final, step, self.eval_metrics, self.window, s.dataset, t_begin
        )
        summary["overflowing modules"] = self.log.overflows.most_frequent() or "none"
        if s.adapt is not None:
            summary["precision changes"] = s.adapt.summary()
        return summary


def _adapt_step(run, adapt, steps: Steps, state, metrics, step, dataset, log: run_log.Log):
    """Adaptive precision after a step: its flags recorded; when a decision is due and changes
    the precision of some modules, the new model's step (built and compiled once more) and the
    state it starts from."""
    adapt.add(step, metrics)
    if not adapt.due(step):
        return state
    adapt.observe(steps.placement.fetch)
    changes = adapt.decide(step)
    if not changes:
        return state
    run_log.note_precision_changes(changes, log.writer, log.bar)
    # Promoted, the module no longer forces the scale down: start it afresh, placed like the
    # scale it replaces (the rest of the state stays put).
    state = state.replace(loss_scale=replicated(run, run.loss_scale))
    calibrate = False
    if run.fp8:  # the promoted modules' fp8 sites are gone from the program
        fp8_state, added = fp8_sites.after_promotion(run, adapt.model, dataset.info, state)
        state = state.replace(fp8_state=fp8_state)
        # A module back in fp8: its sites' first step fills their histories.
        calibrate = added and fp8_sites.needs_calibration(run, state)
    steps.rebuild(state, calibrate, step)
    return state


def _savable(host_state, adapt):
    """What a checkpoint saves: the host state with the adaptive controller's current state."""
    return host_state if adapt is None else adapt.with_state(host_state)
