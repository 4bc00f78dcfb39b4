"""`python -m jamp.train --config=<recipe> --compile_for=<target>`: will the recipe fit the GPUs?

The recipe's model, state and train step are built abstractly (shapes only: nothing is
allocated, no dataset is read), under its policy and parallelism (pmap, or sharded on
`--config.mesh`), compiled for the target's GPUs (`jamp.compile_for`), and the report printed:
memory per device by dtype, GEMMs, attention, collectives, and whether the planned peak fits
in the memory JAX's allocator takes. Then the largest global batch that fits is searched:
the planned peak grows about linearly with the batch, so a line through two compiled points
guesses it, and compiles at the guess and one step above confirm it. The search compiles without
XLA's rematerialization pass (`NO_REMAT`): left on, XLA recomputes activations to squeeze a step
under the GPU's memory, so ever larger batches "fit" at a growing cost in time, and the peak
stops saying how much memory the batch needs.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jamp import lowbit, parallel, sharding
from jamp.precision import describe
from jamp.target import Target, compile_for, get_target, memory_fraction
from jamp.train import data as data_lib
from jamp.train import loop, recipe_step
from jamp.train.optim import OptimConfig, make_optimizer
from jamp.train.run_config import ConfigError, RunConfig, parse_config

#: XLA options for the batch search's compiles: no rematerialization (see the module docstring).
NO_REMAT = {"xla_disable_hlo_passes": "rematerialization"}


@dataclasses.dataclass
class Recipe:
    """A recipe parsed for a target: what `compile_at(batch)` compiles."""

    run: RunConfig
    data: data_lib.DataConfig
    optim: OptimConfig
    task: str
    target: Target

    @property
    def batch_unit(self) -> int:
        """Global batches must be multiples of this: the devices the batch is split over,
        times the accumulation steps."""
        if self.run.parallelism == "sharded":
            shape = dict(self.run.mesh.shape)
            split = math.prod(shape.get(a, 1) for a in sharding.BATCH_AXES)
        else:
            split = self.target.num_devices
        return split * self.run.accumulation_steps


def parse(config, target_name: str) -> Recipe:
    """The recipe `config` for target `target_name`; ConfigError (one line) on a bad one."""
    try:
        target = get_target(target_name)
    except ValueError as e:
        raise ConfigError(f"--compile_for: {e}") from None
    run, data_cfg, optim_cfg, task = parse_config(config, devices=target.devices)
    recipe = Recipe(run, data_cfg, optim_cfg, task, target)
    if run.batch_size % recipe.batch_unit:  # what get_dataset checks in a run
        raise ConfigError(
            f"batch_size {run.batch_size} does not divide evenly over the {target.name} step's "
            f"{recipe.batch_unit // run.accumulation_steps} batch devices x "
            f"{run.accumulation_steps} accumulation steps: use a multiple of {recipe.batch_unit}"
        )
    return recipe


def abstract_batch(info, batch_size: int) -> dict:
    """The shapes and dtypes of a global batch the pipeline would feed (`Dataset._finish`)."""
    if info.task == "lm":
        return {"tokens": jax.ShapeDtypeStruct((batch_size, info.input_shape[0] + 1), jnp.int32)}
    return {
        "image": jax.ShapeDtypeStruct((batch_size, *info.input_shape), jnp.float32),
        "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }


def abstract_state(recipe: Recipe):
    """`(model, tx, state, info)` of the recipe: the state as ShapeDtypeStructs (nothing
    allocated); ConfigError (one line) for a model that does not fit the data."""
    run = recipe.run
    try:
        info = data_lib.shapes(recipe.data)
    except data_lib.DataError as e:
        raise ConfigError(str(e)) from None
    model = loop.make_model(run, info, recipe.task, recipe.data.dataset)
    tx, _ = make_optimizer(recipe.optim)
    state = jax.eval_shape(lambda: loop.fresh_state(run, model, tx, info))
    return model, tx, state, info


def param_count(state) -> int:
    """Parameters in a (possibly abstract) TrainState."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))


def compile_at(recipe: Recipe, batch_size: int, compiler_options: Optional[dict] = None):
    """The `CompileReport` of the recipe's train step at global batch `batch_size`."""
    run, task = recipe.run, recipe.task
    model, tx, state, info = abstract_state(recipe)

    def step_fn(axis_name):
        return recipe_step.train_step(run, model, task, tx, axis_name)

    if run.parallelism == "sharded":
        shardings = sharding.state_shardings(state, run.mesh)
        step = sharding.make_sharded_train_step(step_fn(None), run.mesh, shardings)
    else:
        step = parallel.make_spmd_train_step(step_fn(parallel.AXIS_NAME), recipe.target.devices)
    key = jax.eval_shape(lambda: jax.random.key(run.seed))
    batch = abstract_batch(info, batch_size)
    return compile_for(
        step, state, batch, key, target=recipe.target, compiler_options=compiler_options
    )


@dataclasses.dataclass
class Search:
    """The largest global batch that fits: `batch` (None: not even the smallest one), with the
    planned peaks of every compiled batch (`peaks`)."""

    batch: Optional[int]
    above: Optional[int]  # the smallest batch found not to fit
    peaks: dict
    usable: int
    complete: bool  # False when the compile budget ran out before the two met


def search_batch(
    peak_at: Callable[[int], int],
    start: int,
    unit: int,
    usable: int,
    max_compiles: int = 6,
    known: Optional[dict] = None,
) -> Search:
    """The largest multiple of `unit` whose planned peak (`peak_at(batch)`, bytes) fits `usable`,
    to within 1/32 of it (or one unit, if that is more).

    From the `known` peaks (or a compile at `start`), a line through the two compiled batches
    furthest apart guesses where the peak reaches `usable` (the peak is about affine in the
    batch: state and code do not grow with it, activations do); below any batch known not to
    fit the guess is the line between the bracketing pair (or their middle, where the line
    leaves the bracket). Each guess is compiled, until the largest batch known to fit and the
    smallest known not to are within the resolution, or `max_compiles` ran out.
    """
    peaks = dict(known or {})
    compiles = 0
    if not peaks:
        peaks[start] = peak_at(start)
        compiles += 1
    while True:
        fits = [b for b, p in peaks.items() if p <= usable]
        lo = max(fits, default=0)
        hi = min((b for b, p in peaks.items() if p > usable and b > lo), default=None)
        resolution = max(unit, lo // 32 // unit * unit)
        if hi is not None and hi - lo <= resolution:
            return Search(lo or None, hi, peaks, usable, True)
        if compiles >= max_compiles:
            return Search(lo or None, hi, peaks, usable, False)
        guess = _guess(peaks, usable, lo, hi)
        if hi is None:  # grow, but not wildly
            guess = min(max(guess, lo + resolution), 16 * max(lo, unit))
        elif not lo < guess < hi:
            guess = (lo + hi) // 2
        else:  # close to one end: just inside it, to settle the answer in one compile
            guess = min(max(guess, lo + resolution), hi - resolution)
        guess = max(unit, guess // unit * unit)
        if guess in peaks:  # nothing new to learn between the two
            return Search(lo or None, hi, peaks, usable, False)
        peaks[guess] = peak_at(guess)
        compiles += 1


def _guess(peaks: dict, usable: int, lo: int, hi: Optional[int]) -> int:
    """Where a line through two compiled batches reaches `usable`: the bracketing pair when
    there is one, else the two furthest apart (one point: proportional)."""
    if hi is not None and lo in peaks:
        pairs = [(lo, peaks[lo]), (hi, peaks[hi])]
    else:
        ordered = sorted(peaks.items())
        pairs = [ordered[0], ordered[-1]]
    (b0, p0), (b1, p1) = pairs
    if b1 == b0 or p1 <= p0:
        return int(usable / p1 * b1) if p1 > 0 else 2 * b1
    slope = (p1 - p0) / (b1 - b0)
    return int(b0 + (usable - p0) / slope)


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def _gib(n: float) -> str:
    """Bytes in GiB from 1 GiB, else MiB."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.2f} MiB"


def run_plan(config, target_name: str, workdir: Optional[str], search: bool = True) -> int:
    """Prints the report of the recipe on the target (and the batch search); returns the exit
    status (0). Raises ConfigError (one line) for a bad recipe or target."""
    recipe = parse(config, target_name)
    run = recipe.run
    if run.parallelism == "sharded":
        layout = "sharded jit, mesh " + ", ".join(f"{a}={n}" for a, n in run.mesh.shape.items())
    else:
        layout = f"pmap over {recipe.target.num_devices} devices"
    state = abstract_state(recipe)[2]
    per = lowbit.bytes_per_param(state)
    copies = f", 16-bit copies {per['copies']:.2f}" if per["copies"] else ""
    print(
        f"recipe: model {run.model} ({_count(param_count(state))} params), policy "
        f"{describe(run.policy)}, {layout}, global batch {run.batch_size}; state "
        f"{per['total']:.2f} bytes per param (params {per['params']:.2f}{copies}, optimizer "
        f"{per['opt_state']:.2f}) before sharding (compiled abstractly: nothing allocated, no "
        "data read)",
        flush=True,
    )
    report = compile_at(recipe, run.batch_size)
    print(report.table(), flush=True)
    if workdir:
        path = pathlib.Path(workdir)
        path.mkdir(parents=True, exist_ok=True)
        out = path / f"compile_for_{recipe.target.name.replace(' ', '')}.json"
        out.write_text(report.to_json() + "\n")
        print(f"written: {out}", flush=True)
    if not search:
        return 0
    usable = report.usable_bytes()
    start = report.memory.peak
    # XLA rematerializes only programs near the GPU's memory (its limits seen here: 65-76 % of
    # it); a smaller peak is the program's own.
    if start > report.memory.hbm // 2:
        start = compile_at(recipe, run.batch_size, NO_REMAT).memory.peak
    found = search_batch(
        lambda b: compile_at(recipe, b, NO_REMAT).memory.peak,
        run.batch_size,
        recipe.batch_unit,
        usable,
        known={run.batch_size: start},
    )
    print(_search_line(found, usable, memory_fraction()), flush=True)
    return 0


def _search_line(found: Search, usable: int, fraction: float) -> str:
    compiled = ", ".join(f"{b}: {_gib(p)}" for b, p in sorted(found.peaks.items()))
    share = f"{fraction:.0%}" if fraction >= 0.01 else f"{fraction:.2g}"
    where = f"{_gib(usable)} ({share} of HBM) without recomputation"
    if found.batch is None:
        head = f"no global batch fits in {where}"
    else:
        head = f"largest global batch that fits in {where}: {found.batch}"
        if found.above is not None:
            head += f" ({found.above} does not)"
        if not found.complete:
            head += ", or more: the search stopped after its compiles"
    return (
        f"{head}; planned peak per device by global batch, compiled without XLA's "
        f"rematerialization (which fits larger batches by recomputing, slower): {compiled}"
    )
