"""Data parallelism over local devices: the one module that calls `jax.pmap`.

`jax.pmap` is in maintenance mode (it runs on jit + shard_map since JAX 0.8); keeping every use of it
here lets a sharded-`jit` path stand beside it later without touching the step.

Typical use:

    >>> train_step = make_train_step(loss_fn, tx, axis_name="batch")
    >>> p_train_step = make_p_train_step(train_step, axis_name="batch")
    >>> state = replicate(TrainState.create(params, tx, loss_scale=DynamicLossScale()))
    >>> for batch in batches:
    ...   state, metrics = p_train_step(state, shard(batch), base_key)
    >>> final = unreplicate(state)

Several processes (after `jax.distributed.initialize`): every function here works on the devices
of the process that calls it. Each process replicates the state onto its own devices and shards
its own slice of the global batch; the pmapped step's axis then spans the devices of all
processes, so its `pmean` averages over all of them, and its outputs come back on each process's
own devices.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any

# The pmap axis name used throughout unless a caller picks another one.
AXIS_NAME = "batch"


def local_device_count() -> int:
    """Returns the number of devices this process drives (its share of the pmap axis)."""
    return jax.local_device_count()


def replicate(
    tree: PyTree,
    devices: Sequence[jax.Device] | None = None,
    *,
    axis_name: str = AXIS_NAME,
) -> PyTree:
    """Puts one copy of every leaf on each device, stacked along a new leading device axis.

    Args:
      tree: a pytree of arrays (e.g. a `TrainState`).
      devices: the devices to copy to, in pmap's order; all local devices when None.
      axis_name: the axis name of the pmapped step that will consume the tree. pmap places its
        outputs on a mesh named after its axis; placing the inputs the same way lets the second
        step reuse the first step's executable instead of compiling again.

    Returns:
      The same pytree with every leaf of shape `(num_devices, *leaf.shape)`, sharded so that
      device i holds replica i: `jax.pmap` consumes it without moving data.

    Example:
      >>> state = replicate(TrainState.create(params, tx))
      >>> state.step.shape
      (8,)
    """
    devices = list(jax.local_devices() if devices is None else devices)
    # Exactly the placement pmap gives its outputs: one mesh axis named like the pmap axis,
    # splitting the leading (device) axis across the devices.
    sharding = NamedSharding(Mesh(np.array(devices), (axis_name,)), PartitionSpec(axis_name))

    def put(x):
        # numpy, not jnp, for host values: a python float would become a weakly typed array and
        # the first pmapped call would then compile twice.
        x = x if isinstance(x, jax.Array) else np.asarray(x)
        # Copy the leaf to each device once and assemble the global array from those pieces, so
        # the host never materializes num_devices copies (device_put_replicated is gone in 0.10).
        pieces = [jax.device_put(x[None], device) for device in devices]
        return jax.make_array_from_single_device_arrays((len(devices),) + x.shape, sharding, pieces)

    return jax.tree.map(put, tree)


def unreplicate(tree: PyTree) -> PyTree:
    """Returns the first replica of a replicated pytree (drops the leading device axis).

    Args:
      tree: a pytree whose leaves have a leading device axis, e.g. the output of `replicate` or of
        a pmapped step.

    Returns:
      The pytree with every leaf `x` replaced by `x[0]`.

    Example:
      >>> unreplicate(replicate({"w": jnp.ones(3)}))["w"].shape
      (3,)
    """

    def first(x):
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            # Read replica 0 from the device that holds it: `x[0]` would instead give an array
            # replicated over every device, which then clashes with single-device arrays in jit.
            pieces = x.addressable_shards
            for piece in pieces:
                if (piece.index[0].start or 0) == 0:
                    return piece.data[0]
            # An array laid out over several processes' devices, replica 0 on another process:
            # take one of this process's replicas (the replicas of a pmapped state are equal).
            return pieces[0].data[0]
        return x[0]

    return jax.tree.map(first, tree)


def shard(batch: PyTree, num_devices: int | None = None) -> PyTree:
    """Splits a batch into per-device batches along a new leading axis.

    Args:
      batch: a pytree of arrays (numpy or jax) with the same leading batch axis: the global
        batch, or in a multi-process run this process's slice of it.
      num_devices: the number of shards; the local device count when None.

    Returns:
      The pytree with every leaf reshaped from `(global_batch, ...)` to
      `(num_devices, global_batch // num_devices, ...)`. Shard i is examples
      `[i * per_device, (i + 1) * per_device)`.

    Raises:
      ValueError: if a leaf's leading axis does not divide by the number of devices.

    Example:
      >>> shard({"x": np.zeros((16, 3))}, num_devices=8)["x"].shape
      (8, 2, 3)
    """
    num_devices = local_device_count() if num_devices is None else num_devices

    def split(x):
        size = np.shape(x)[0] if np.ndim(x) else None
        if size is None or size % num_devices:
            raise ValueError(
                f"cannot shard a batch of size {size} across {num_devices} devices: the global "
                f"batch size must be a multiple of the device count."
            )
        return x.reshape((num_devices, size // num_devices) + tuple(np.shape(x)[1:]))

    return jax.tree.map(split, batch)


def _check_axis_name(step: Callable, axis_name: str) -> None:
    """Refuses a step built for another axis: unaveraged replicas would silently drift apart."""
    built_for = getattr(step, "axis_name", axis_name)
    if built_for != axis_name:
        raise ValueError(
            f"the step was built with axis_name={built_for!r} but is pmapped over "
            f"axis_name={axis_name!r}; build it with make_*_step(..., axis_name={axis_name!r})."
        )


def make_p_train_step(
    train_step: Callable,
    *,
    axis_name: str = AXIS_NAME,
    donate_state: bool = True,
) -> Callable:
    """Pmaps a train step over the local devices (of every process, in a multi-process run).

    Args:
      train_step: from `jamp.step.make_train_step(..., axis_name=axis_name)`.
      axis_name: the pmap axis name; it must be the one the step was built with (and the one
        given to `replicate`).
      donate_state: donate the input state's buffers to the output state, so the device holds one
        copy of the state instead of two. The state passed in is unusable afterwards.

    Returns:
      `p_train_step(state, batch, rng) -> (state, metrics)` with `state` replicated, `batch`
      sharded, and `rng` ONE unreplicated key: every device receives the same key and the step
      folds in the replica index. The returned metrics carry the device axis (identical replicas;
      take `unreplicate(metrics)`).

    Example:
      >>> p_train_step = make_p_train_step(make_train_step(loss_fn, tx, axis_name="batch"))
      >>> state, metrics = p_train_step(replicate(state), shard(batch), jax.random.key(0))
    """
    _check_axis_name(train_step, axis_name)
    return jax.pmap(
        train_step,
        axis_name=axis_name,
        in_axes=(0, 0, None),
        donate_argnums=(0,) if donate_state else (),
    )


def make_spmd_train_step(
    train_step: Callable,
    devices: Sequence[Any],
    *,
    axis_name: str = AXIS_NAME,
    donate_state: bool = True,
) -> Callable:
    """What `make_p_train_step` runs, as one SPMD program over `devices` (any devices, also a
    GPU target's that this process cannot run on: see `jamp.compile_for`).

    `jax.pmap` runs on `jit` of `shard_map` since JAX 0.8: the same per-device program, with
    every device holding the whole state, its share of the batch and the same key. Here the
    batch is global (its leading axis split over `devices`) and the state is passed once
    (replicated), not with a device axis.

    Returns:
      `step(state, batch, rng) -> (state, metrics)`, jitted.
    """
    _check_axis_name(train_step, axis_name)
    mesh = Mesh(np.asarray(list(devices)), (axis_name,))
    mapped = jax.shard_map(
        train_step,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(axis_name), PartitionSpec()),
        out_specs=(PartitionSpec(), PartitionSpec()),
        check_vma=False,  # the step averages over the axis itself (pmean), as under pmap
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        mapped,
        in_shardings=(replicated, NamedSharding(mesh, PartitionSpec(axis_name)), replicated),
        out_shardings=(replicated, replicated),
        donate_argnums=(0,) if donate_state else (),
    )


def make_p_eval_step(eval_step: Callable, *, axis_name: str = AXIS_NAME) -> Callable:
    """Pmaps an eval step over the local devices.

    Args:
      eval_step: from `jamp.step.make_eval_step(..., axis_name=axis_name)`.
      axis_name: the pmap axis name; it must be the one the step was built with.

    Returns:
      `p_eval_step(state, batch) -> metrics` with `state` replicated and `batch` sharded; the
      metrics are averaged over devices and carry the device axis.

    Example:
      >>> p_eval_step = make_p_eval_step(make_eval_step(eval_fn, axis_name="batch"))
      >>> metrics = unreplicate(p_eval_step(state, shard(batch)))
    """
    _check_axis_name(eval_step, axis_name)
    return jax.pmap(eval_step, axis_name=axis_name)
