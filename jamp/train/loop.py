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
from jax.sharding import NamedSharding, PartitionSpec

from jamp import adaptive, fp8, lowbit, parallel, sharding
from jamp.models import NnxModel, get_model
from jamp.precision import describe, is_fp8
from jamp.state import TrainState
from jamp.step import make_eval_step
from jamp.train import adapting, recipe_step, run_log, tasks
from jamp.train import data as data_lib
from jamp.train.checkpoint import Checkpointer, CheckpointError
from jamp.train.metrics import MetricWriter, peak_memory_mib, summary_table
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
from jamp.train.steps import Placement, Steps
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
        fp8_state = fp8_state_for(model, info, params, variables, fp8_scaling)
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


def fp8_state_for(model, info, params, model_state, fp8_scaling) -> fp8.Fp8State:
    """A fresh fp8 state (`(recipe, history, margin)`) with a site for every fp8 matmul of the
    train step's loss on `model`; `params` and `model_state` may be abstract."""
    recipe, history, margin = fp8_scaling
    loss_fn, args = _fp8_loss(model, info, params, model_state)
    return fp8.init_state(loss_fn, *args, recipe=recipe, history=history, margin=margin)


def _fp8_loss(model, info, params, model_state):
    """The train step's loss on `model` and example arguments for it, which trace its fp8 sites."""
    dtype = jnp.int32 if info.task == "lm" else jnp.float32
    dummy = jnp.zeros((1, *info.input_shape), dtype)
    if info.task == "lm":
        batch = {"tokens": jnp.zeros((1, info.input_shape[0] + 1), jnp.int32)}
    else:
        batch = {"image": dummy, "label": jnp.zeros((1,), jnp.int32)}
    return tasks.make_loss_fn(model, info.task), (params, model_state, batch, jax.random.key(0))


def _fp8_sites_of(run, model, info) -> fp8.Fp8State:
    """A fresh fp8 state for `model` under `run`'s scaling, from an abstract init (the model
    rebuilt with other overrides: its site set)."""
    variables = dict(adapting.abstract_variables(model, info))
    params = variables.pop("params")
    return fp8_state_for(model, info, params, variables, run.fp8)


def _fp8_after_promotion(run, model, info, state):
    """The placed fp8 state for `model` (rebuilt with other overrides): a site for each of its
    fp8 matmuls, the surviving sites' histories and scales carried over as they are on the
    devices, a site that is new (a demotion back to fp8) fresh; and whether there is one."""
    fresh = _fp8_sites_of(run, model, info)
    new = {name: site for name, site in fresh.sites.items() if name not in state.fp8_state.sites}
    new = _replicated(run, new)  # like every fp8 site; the kept ones stay where they are
    placed = fresh.replace(sites={name: new.get(name, site) for name, site in fresh.sites.items()})
    return fp8.carry_over(placed, state.fp8_state), bool(new)


def _needs_calibration(run, state) -> bool:
    """Whether the next step must fill fresh delayed fp8 sites (`fp8.calibrating`)."""
    return bool(run.fp8) and run.fp8[0] == "delayed" and fp8.uses_state(state.fp8_state)


class _Fp8Sites:
    """What the restore target's fp8 sites are made to be: the checkpoint's, where the run allows
    them to differ. Adaptive precision under fp8: a promotion before the checkpoint removed some
    (`adaptive`). Any fp8 run: a checkpoint written before site names were params paths names
    them as the name stack spelt them ("TransformerLM/DecoderBlock_0/Dense_0/dot_general", now
    "DecoderBlock_0/Dense_0/dot_general"): restored under those names, then renamed (`current`)
    by the map `jamp.fp8.former_names` traces from `model`'s loss."""

    def __init__(self, model, info, adaptive: bool):
        self.model, self.info, self.adaptive = model, info, adaptive
        self._former: dict[str, str] | None = None

    def former(self) -> dict[str, str]:
        """{former site name: current name} for `model`'s loss (traced once, when needed;
        none without a model)."""
        if self._former is None and self.model is None:
            self._former = {}
        if self._former is None:
            variables = dict(adapting.abstract_variables(self.model, self.info))
            params = variables.pop("params")
            loss_fn, args = _fp8_loss(self.model, self.info, params, variables)
            self._former = fp8.former_names(loss_fn, *args)
        return self._former

    def __call__(self, target, stored_tree):
        """`fit` for `Checkpointer.restore`: the target with the stored tree's fp8 site names,
        shaped like this run's sites (its history length) and placed like them."""
        stored = stored_tree.get("fp8_state") if isinstance(stored_tree, dict) else None
        sites = stored.get("sites") if isinstance(stored, dict) else None
        if not isinstance(sites, dict) or target.fp8_state is None:
            return target
        names, current = set(sites), set(target.fp8_state.sites)
        if names == current:
            return target
        like = next(iter(target.fp8_state.sites.values()), None)
        if like is None:  # a model without fp8 matmuls: nothing to hold them
            return target
        stale = names - current
        if stale and stale & set(self.former()):  # named as before
            unknown = sorted(stale - set(self.former()))
            renamed = {self.former().get(n, n) for n in names}
            if unknown or not (renamed <= current if self.adaptive else renamed == current):
                odd = unknown or sorted(current ^ renamed)
                raise CheckpointError(
                    "the checkpoint's fp8 matmul sites are named as jamp named them before site "
                    f"names were params paths, and not all are this model's ({odd[0]!r}); use "
                    "another --workdir or the original config"
                )
        elif not self.adaptive:
            return target  # another model's sites: the restore says what differs

        def spec(leaf):  # this run's shapes (its history length), the checkpoint's names
            sharding = getattr(leaf, "sharding", None)
            return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

        made = {name: jax.tree.map(spec, like) for name in sites}
        return target.replace(fp8_state=target.fp8_state.replace(sites=made))

    def current(self, state):
        """The restored state with its fp8 sites under their current names."""
        if state.fp8_state is None or self._former is None:
            return state  # no site was named as before (the map was never needed)
        if not set(state.fp8_state.sites) & set(self._former):
            return state
        return state.replace(fp8_state=fp8.renamed(state.fp8_state, self._former))


def _check_fp8_sites(run, model, info, state) -> None:
    """Raises CheckpointError when the restored fp8 sites are not those of the model the restored
    promotions give (a checkpoint of another model or config)."""
    want = set(_fp8_sites_of(run, model, info).sites)
    got = set(state.fp8_state.sites)
    if want != got:
        extra = sorted(got - want) or sorted(want - got)
        raise CheckpointError(
            f"the checkpoint's fp8 matmul sites are not this model's under its promotions "
            f"({extra[0]!r} differs); use another --workdir or the original config"
        )


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
            # CheckpointError if it belongs to another config; damaged newer ones are set aside
            fit = _Fp8Sites(model, dataset.info, adapt is not None) if run.fp8 else None
            state = ckpt.restore(_restore_target(run, state), set_aside_damaged=True, fit=fit)
            if fit is not None:  # sites stored under their former names: their names now
                state = fit.current(state)
            if int(state.step) >= run.num_train_steps:
                return _complete(run, int(state.step), workdir)
            print(f"resuming from the checkpoint at step {int(state.step)}", flush=True)
            if adapt is not None:  # the promotions made before the checkpoint hold again
                state = adapt.resume(state)
                if run.fp8:
                    _check_fp8_sites(run, adapt.model, dataset.info, state)
        notes = run_log.hardware_notes(config.policy, run.policy)
        start = int(state.step)
        primary = jax.process_index() == 0  # the others hold the same averaged metrics
        with (
            MetricWriter(workdir, purge_step=start, enabled=primary) as writer,
            StopFlag(every=run.log_every_steps) as stop,
        ):
            writer.write_config(config.to_dict())
            summary = _train(
                run,
                task,
                model,
                tx,
                schedule,
                state,
                start,
                dataset,
                ckpt,
                writer,
                stop,
                t_begin,
                workdir,
                adapt=adapt,
            )
    summary.update(notes)
    summary["workdir"] = str(workdir)
    if jax.process_index() == 0:
        print(summary_table(summary), flush=True)
    return summary


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


def _train(
    run,
    task,
    model,
    tx,
    schedule,
    state,
    start,
    dataset,
    checkpointer,
    writer,
    stop,
    t_begin,
    workdir,
    *,
    adapt=None,
):
    def current_model():  # with adaptive precision, the one its promotions (restored too) give
        return model if adapt is None else adapt.model

    def train_step_fn(axis_name):
        return recipe_step.train_step(run, current_model(), task, tx, axis_name)

    def eval_fn(axis_name):
        return make_eval_step(tasks.make_eval_fn(current_model(), task), axis_name=axis_name)

    calibrate = start == 0 and _needs_calibration(run, state)  # restored: the histories are full
    steps = Steps(run, train_step_fn, eval_fn, state, calibrate, start)
    state = steps.placement.place(state)
    rng = jax.random.key(run.seed)
    batches = dataset.train_batches(start_step=start)
    bar = _progress(run.num_train_steps, start)
    log = run_log.Log(
        run, writer, bar, adapt, OverflowWatch(run.loss_scale, run.persistent_overflow_steps)
    )
    window, eval_metrics, step = run_log.Window(), {}, start
    if run.profile_steps:
        if steps.calibrate:  # the profiled steps are plain ones
            state, _ = steps(state, next(batches), rng, step)
            step += 1
        state, step = run_log.profile_first_steps(
            run, steps.placement.train_step, steps.placement, state, batches, rng, step, workdir
        )
        if bar is not None:
            bar.update(step - start)
        window.restart()
    while step < run.num_train_steps and not stop.should_stop(step):
        t0 = time.perf_counter()
        batch = next(batches)
        window.wait += time.perf_counter() - t0
        compiles, t_call = steps.compiles(step), time.perf_counter()
        state, metrics = steps(state, batch, rng, step)
        if compiles:
            window.leave_out(t_call)  # a compilation is not throughput
        window.pending.append(metrics)
        step += 1
        if bar is not None:
            bar.update(1)
        if adapt is not None:
            state = _adapt_step(run, adapt, steps, state, metrics, step, dataset, log)
        if run.trace_nonfinite and not bool(np.all(jax.device_get(metrics["grads_finite"]))):
            # Costs a wait for the device every step, and a forward pass on skipped ones only.
            host = steps.placement.host(state)
            run_log.trace_overflow(current_model(), task, host, batch, rng, step, writer, bar)
        if step == start + 1:  # the first step compiles: keep it out of the throughput
            log.first_step([jax.device_get(steps.placement.fetch(metrics))], step)
            window.restart()
        elif step % run.log_every_steps == 0 or step == run.num_train_steps:
            fetched = [steps.placement.fetch(m) for m in jax.device_get(window.pending)]
            log.window(window, fetched, step, schedule)
            window.restart()
        hook_start = time.perf_counter()
        if step % run.eval_every_steps == 0 and step < run.num_train_steps:
            eval_metrics = evaluate(steps.placement, state, dataset, task)
            writer.write(step, eval_metrics, kind="eval")
        if step % run.checkpoint_every_steps == 0:
            checkpointer.save(step, _savable(steps.placement.host(state), adapt))
        window.leave_out(hook_start)  # hooks are not training throughput
    if bar is not None:
        bar.close()
    if adapt is not None and adapt.pending:  # the last steps: recorded for a resume, not decided
        adapt.observe(steps.placement.fetch)
    final = _savable(steps.placement.host(state), adapt)
    if checkpointer.latest_step() != step:
        checkpointer.save(step, final)
    if not stop.should_stop(step):
        eval_metrics = evaluate(steps.placement, state, dataset, task)
        writer.write(step, eval_metrics, kind="eval")
    else:
        print(
            f"stopped by {stop.signal} at step {step}; checkpoint saved, run again with the "
            "same --workdir to resume",
            flush=True,
        )
    summary = _summary(run, task, final, step, eval_metrics, window, dataset, t_begin)
    summary["overflowing modules"] = log.overflows.most_frequent() or "none"
    if adapt is not None:
        summary["precision changes"] = adapt.summary()
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
    state = state.replace(loss_scale=_replicated(run, run.loss_scale))
    calibrate = False
    if run.fp8:  # the promoted modules' fp8 sites are gone from the program
        fp8_state, added = _fp8_after_promotion(run, adapt.model, dataset.info, state)
        state = state.replace(fp8_state=fp8_state)
        # A module back in fp8: its sites' first step fills their histories.
        calibrate = added and _needs_calibration(run, state)
    steps.rebuild(state, calibrate, step)
    return state


def _replicated(run, tree):
    """`tree` (host values of replicated state: a loss scale, fp8 sites) placed as the state
    holds such values: replicated under pmap; replicated over the mesh when sharded (every
    process holds the same values, so this works across processes, where copying the whole
    state through the host would not)."""
    if run.parallelism != "sharded":
        return parallel.replicate(tree)
    replicated = NamedSharding(run.mesh, PartitionSpec())
    return jax.device_put(jax.tree.map(np.asarray, tree), replicated)


def _savable(host_state, adapt):
    """What a checkpoint saves: the host state with the adaptive controller's current state."""
    return host_state if adapt is None else adapt.with_state(host_state)


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


def _summary(run, task, state, step, eval_metrics, window, dataset, t_begin):
    metric = "perplexity" if task == "lm" else "accuracy"
    memory = peak_memory_mib()
    if run.parallelism == "sharded":
        axes = ", ".join(f"{a}={n}" for a, n in run.mesh.shape.items())
        parallelism = f"sharded jit, mesh {axes}"
    else:
        parallelism = f"pmap over {jax.device_count()} devices"
    return {
        "policy": describe(run.policy),
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
        "state bytes per param": _state_bytes(run, state),
    }


def _state_bytes(run, state) -> str:
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
