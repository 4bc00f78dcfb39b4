"""How the training program calls its steps: placed on pmap replicas or a sharded mesh
(`place_steps`), and, as the loop calls it (`Steps`), the calibrating step that a fresh delayed fp8
state takes first, built anew when adaptive precision changes the model."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jamp import fp8, parallel, sharding


@dataclasses.dataclass
class Placement:
    """How the run puts state and batches on devices: pmap replicas or a sharded mesh."""

    place: Callable  # host state -> device state
    batch: Callable  # host batch -> device batch
    train_step: Callable  # (state, batch, rng) -> (state, metrics)
    eval_step: Callable  # (state, batch) -> metric sums
    fetch: Callable  # device metrics -> one copy
    host: Callable  # device state -> what a checkpoint saves and the summary reads


def place_steps(run, train_step_fn, eval_fn, state) -> Placement:
    """`train_step_fn(axis_name)` / `eval_fn(axis_name)` build the steps for either kind."""
    if run.parallelism == "sharded":
        mesh = run.mesh
        shardings = sharding.state_shardings(state, mesh)
        # Several processes: each loaded only its slice of the global batch (see get_dataset).
        process_local = jax.process_count() > 1

        def place(s):
            if _placed(s, shardings):  # restored from a checkpoint straight onto the mesh
                return s
            return sharding.shard_state(s, mesh)

        return Placement(
            place=place,
            batch=lambda b: sharding.shard_batch(b, mesh, process_local=process_local),
            train_step=sharding.make_sharded_train_step(train_step_fn(None), mesh, shardings),
            eval_step=sharding.make_sharded_eval_step(eval_fn(None), mesh, shardings),
            # Metrics come out replicated: every process reads them from its own devices, also
            # where the arrays span other processes' devices (not fully addressable).
            fetch=lambda m: m,
            host=lambda s: s,  # Orbax saves sharded arrays as they are, each process its shards
        )
    return Placement(
        place=parallel.replicate,
        batch=parallel.shard,
        train_step=parallel.make_p_train_step(train_step_fn(parallel.AXIS_NAME)),
        eval_step=parallel.make_p_eval_step(eval_fn(parallel.AXIS_NAME)),
        fetch=parallel.unreplicate,
        host=parallel.unreplicate,
    )


def _placed(state, shardings) -> bool:
    leaves, wanted = jax.tree.leaves(state), jax.tree.leaves(shardings)
    return len(leaves) == len(wanted) and all(
        isinstance(x, jax.Array) and x.sharding == w for x, w in zip(leaves, wanted)
    )


class Steps:
    """The run's train step as the loop calls it: placed (pmap replicas or a sharded mesh), the
    calibrating step first where a fresh delayed fp8 state needs one, built anew when adaptive
    precision changes the model; and which call compiles a new program (the throughput leaves
    that call out)."""

    def __init__(self, run, make_step: Callable, make_eval: Callable, state, calibrate, start):
        self._run, self._make_step, self._make_eval = run, make_step, make_eval
        self.placement = place_steps(run, make_step, make_eval, state)
        # A fresh delayed fp8 state: the first step quantises by each tensor's own amax and
        # fills the histories (the plain step would skip it, quantised by scales of 1).
        self.calibrate = calibrate
        self._compiled_at = start + 1  # the step whose call compiles a new program

    def compiles(self, step: int) -> bool:
        """Whether the call that takes step `step + 1` compiles a program."""
        return self.calibrate or step + 1 == self._compiled_at

    def __call__(self, state, batch, rng, step: int):
        placement = self.placement
        if not self.calibrate:
            return placement.train_step(state, placement.batch(batch), rng)
        self.calibrate, self._compiled_at = False, step + 2  # the plain step compiles next

        def calibrating(axis_name):
            return fp8.calibrating(self._make_step(axis_name))

        first = place_steps(self._run, calibrating, self._make_eval, state).train_step
        return first(state, placement.batch(batch), rng)

    def rebuild(self, state, calibrate: bool, step: int) -> None:
        """The steps of a new model (adaptive precision) after step `step`: the next call
        compiles them."""
        self.placement = place_steps(self._run, self._make_step, self._make_eval, state)
        self.calibrate = calibrate
        self._compiled_at = step + 1


def replicated(run, tree):
    """`tree` (host values of replicated state: a loss scale, fp8 sites) placed as the state
    holds such values: replicated under pmap; replicated over the mesh when sharded (every
    process holds the same values, so this works across processes, where copying the whole
    state through the host would not)."""
    if run.parallelism != "sharded":
        return parallel.replicate(tree)
    replicated = NamedSharding(run.mesh, PartitionSpec())
    return jax.device_put(jax.tree.map(np.asarray, tree), replicated)
