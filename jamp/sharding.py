"""Sharded-`jit` training on a device mesh: data parallelism and FSDP beside `jamp.parallel`'s pmap.

Besides `jamp.parallel`, the only module that places arrays on devices. Under `jamp.parallel`
every device holds the whole state (fp32 params, both Adam moments: 12+ bytes per parameter);
here the state is split over the mesh's `fsdp` axis, so each device holds 1/fsdp of it, and the
very step that `make_train_step` builds runs under `jax.jit` with the batch split over `data` and
`fsdp` together. Its gradients are global arrays, so the finiteness check, and with it the skip
decision, is one decision for every device by construction.

Typical use (one process, 8 devices):

    >>> mesh = make_mesh("data=2,fsdp=4")
    >>> state = shard_state(TrainState.create(params, tx, loss_scale=DynamicLossScale()), mesh)
    >>> step = make_sharded_train_step(make_train_step(loss_fn, tx), mesh, state_shardings(state))
    >>> for batch in batches:
    ...   state, metrics = step(state, shard_batch(batch, mesh), key)

Placement rule: each param, and every optimizer-state leaf with the param's path and shape (Adam's
moments), is split over `fsdp` along its largest dimension that `fsdp` divides; a leaf with no
such dimension (a scalar, a bias of odd width) stays replicated, and `describe` says so. Mutable
model state (batch statistics), the loss scale and the counters are replicated. Axes `data`, `fsdp`
and `tensor` may appear in a mesh.

Tensor parallelism comes from `rules`: `(path pattern, spec)` pairs, the pattern an fnmatch glob
over the param's path ("*/Dense_0/kernel", as `jamp.wrap`'s overrides match), the spec one mesh
axis (or None, or a tuple of axes) per dimension, e.g. Megatron's MLP:

    >>> rules = [("*/Dense_0/kernel", (None, "tensor")), ("*/Dense_1/kernel", ("tensor", None))]

The first matching rule places a param's dimensions; FSDP then splits the largest dimension the
rule left free. An axis the mesh lacks is dropped, so one set of rules serves every mesh. Models
that carry Flax partitioning metadata (`nn.with_partitioning`, `nn.with_logical_partitioning`)
give their rules through `rules_from_metadata`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jamp import hardware, hlo, placement
from jamp.engine import placing
from jamp.placement import AXES, Rules, path_keys
from jamp.placement import describe as describe  # re-exported: the public surface is here
from jamp.placement import rules_from_metadata as rules_from_metadata

PyTree = Any

#: The axes a batch is split over (FSDP is data parallel too).
BATCH_AXES = ("data", "fsdp")


def _parse(spec: Union[str, Mapping[str, int]]) -> dict[str, int]:
    items: list[tuple[str, Any]]  # (axis, size as given: int or text)
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        items = []
        for part in (p.strip() for p in str(spec).split(",") if p.strip()):
            name, eq, size = part.partition("=")
            if not eq:
                raise ValueError(f"mesh part {part!r} is not axis=size (e.g. 'data=2,fsdp=4')")
            items.append((name.strip(), size.strip()))
    sizes: dict[str, int] = {}
    for name, size in items:
        if name not in AXES:
            raise ValueError(f"unknown mesh axis {name!r}; axes: {', '.join(AXES)}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} given twice")
        try:
            value = int(size)
        except (TypeError, ValueError):
            value = 0
        if value != -1 and value < 1:
            raise ValueError(f"mesh axis {name}={size!r}: sizes are positive integers, or -1")
        sizes[name] = value
    if not sizes:
        raise ValueError("empty mesh; give axis=size pairs, e.g. 'fsdp=8' or 'data=2,fsdp=4'")
    if list(sizes.values()).count(-1) > 1:
        raise ValueError("only one mesh axis may be -1 (the devices left over)")
    return sizes


def make_mesh(
    spec: Union[str, Mapping[str, int]], devices: Optional[Sequence[jax.Device]] = None
) -> Mesh:
    """A mesh over all devices of all processes, e.g. `make_mesh("data=2,fsdp=4")`.

    Args:
      spec: `"axis=size,..."` or a mapping, over axes `data`, `fsdp`, `tensor` (any subset, in any
        order; the mesh lists them in that order); one size may be -1, the devices left over.
      devices: the devices to use; `jax.devices()` (every process's) when None.

    Returns:
      A `jax.sharding.Mesh` whose sizes multiply out to the number of devices.

    Raises:
      ValueError: one line naming what is wrong and what exists.
    """
    sizes = _parse(spec)
    devices = list(jax.devices() if devices is None else devices)
    known = math.prod(v for v in sizes.values() if v != -1)
    for name, value in sizes.items():
        if value == -1:
            if len(devices) % known:
                raise ValueError(
                    f"mesh {spec!r}: {len(devices)} devices do not divide by {known}"
                    f" ({_what_exists(devices)})"
                )
            sizes[name] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(
            f"mesh {spec!r} needs {math.prod(sizes.values())} devices; there are "
            f"{len(devices)} ({_what_exists(devices)})"
        )
    names = tuple(a for a in AXES if a in sizes)
    shape = tuple(sizes[a] for a in names)
    return Mesh(mesh_utils.create_device_mesh(shape, devices), names)


def _what_exists(devices) -> str:
    kinds = sorted({d.platform for d in devices})
    processes = len({d.process_index for d in devices})
    return f"{'/'.join(kinds)} x{len(devices)} over {processes} process(es)"


def state_shardings(state, mesh: Optional[Mesh] = None, rules: Optional[Rules] = None) -> PyTree:
    """The `NamedSharding` of every leaf of a `TrainState` on `mesh` (see the module docstring).

    With `mesh` None, `state` must already be placed (by `shard_state`): its leaves' shardings.
    """
    if mesh is None:
        return jax.tree.map(lambda x: x.sharding, state)
    specs = [spec for _, _, spec, _ in placement.state_plan(state, mesh, rules)]
    treedef = jax.tree.structure(state)
    return jax.tree.unflatten(treedef, [NamedSharding(mesh, s) for s in specs])


def shard_state(state, mesh: Mesh, rules: Optional[Rules] = None):
    """`state` (a `jamp.TrainState` of host or single-device arrays) placed on `mesh`.

    Args:
      state: the state to place.
      mesh: from `make_mesh`.
      rules: tensor-parallel placement, `(path pattern, spec)` pairs (see the module docstring);
        FSDP splits what they leave free.

    Raises:
      ValueError: one line naming a rule that does not fit its param or the known axes.
    """
    # From host copies: the sharded step donates its state, and a device_put that reused a
    # buffer of `state` (it does, for replicated scalars already on a device) would free it.
    shardings = state_shardings(state, mesh, rules)
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s), state, shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over the mesh's `data` and `fsdp` axes, the rest replicated."""
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    return NamedSharding(mesh, P(axes if axes else None))


def shard_batch(batch: PyTree, mesh: Mesh, *, process_local: bool = False) -> PyTree:
    """A global batch onto `mesh`, its leading axis split over `data` and `fsdp`.

    Args:
      batch: a pytree of arrays with a leading batch axis: the global batch, or with
        `process_local=True` this process's slice of it (every process passes its own).
      mesh: from `make_mesh`.

    Raises:
      ValueError: the batch does not divide over the devices it is split across.
    """
    sharding = batch_sharding(mesh)
    ways = math.prod(placement.axis_size(mesh, a) for a in BATCH_AXES)

    def place(x):
        n = np.shape(x)[0] * (jax.process_count() if process_local else 1)
        if n % ways:
            raise ValueError(
                f"a batch of {n} does not split over {ways} devices (data x fsdp); "
                f"use a multiple of {ways}"
            )
        if process_local:
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))
        return jax.device_put(x, sharding)

    return jax.tree.map(place, batch)


class _ParamPlacement:
    """Where each param lives, for `jamp.autocast.placing`: a model's variables are matched to
    the state's params by path (the one ends the other: a model may be applied to
    `{"params": params}`, or a submodule to a subtree) and shape. Only a layout hint: a wrong
    match could cost speed, never change a value."""

    def __init__(self, params: PyTree, shardings: PyTree):
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        self._known = [
            (path_keys(path), tuple(np.shape(leaf)), s)
            for (path, leaf), s in zip(flat, jax.tree.leaves(shardings))
        ]

    def __call__(self, path, shape):
        keys = path_keys(path)
        found = {
            s
            for k, kshape, s in self._known
            if kshape == shape and (keys[-len(k) :] == k or k[-len(keys) :] == keys)
        }
        if len(found) != 1:
            return None  # unknown, or ambiguous: leave the layout to XLA
        (sharding,) = found
        if sharding.is_fully_replicated:
            return None
        # Read by matmuls gathered over fsdp (a tensor-parallel split stays): one 16-bit gather
        # that the backward pass reuses.
        spec = [
            tuple(a for a in placement.axis_names(e) if a != "fsdp") or None for e in sharding.spec
        ]
        return sharding, NamedSharding(sharding.mesh, P(*spec))


def _placing_params(fn, state_sharding, mesh: Mesh):
    """`fn(state, ...)` traced with `autocast.placing` the state's params: 16-bit gathers, and
    gradients reduced in the policy's reduce dtype (see `jamp.wrap`); and traced for the mesh's
    devices (`jamp.hardware.compiling_for`), so a mesh of GPUs built on a CPU host gets the GPU's
    forms (16-bit activations under "auto", native 16-bit matmuls)."""

    def placed(state, *args):
        with (
            hardware.compiling_for(mesh.devices.flat[0]),
            placing(_ParamPlacement(state.params, state_sharding.params)),
        ):
            return fn(state, *args)

    return placed


def make_sharded_train_step(train_step, mesh: Mesh, state_sharding: PyTree):
    """`train_step` (from `jamp.make_train_step`, without `axis_name`) jitted for `mesh`.

    The state goes in and comes out with `state_sharding` (donated: its buffers are reused), the
    batch split as `shard_batch` splits it, the key and metrics replicated. A `jamp.wrap`ped
    model inside casts each sharded param to the compute dtype on its shard, so the params are
    gathered in 16 bits, and its matmuls' param gradients are reduce-scattered in the policy's
    reduce dtype (float32 unless the policy says e.g. "mixed_bfloat16,reduce=bf16").
    """
    if getattr(train_step, "axis_name", None) is not None:
        raise ValueError(
            "make_sharded_train_step takes a step made without axis_name: under jit the "
            "gradients are global arrays, there is no replica axis to average over"
        )
    replicated = NamedSharding(mesh, P())
    return jax.jit(
        _placing_params(train_step, state_sharding, mesh),
        in_shardings=(state_sharding, batch_sharding(mesh), replicated),
        out_shardings=(state_sharding, replicated),
        donate_argnums=(0,),
    )


def make_sharded_eval_step(eval_step, mesh: Mesh, state_sharding: PyTree):
    """`eval_step` (from `jamp.make_eval_step`, without `axis_name`) jitted for `mesh`: the state
    as placed (params gathered in the compute dtype), the batch split as `shard_batch` splits
    it, the metrics replicated."""
    return jax.jit(
        _placing_params(eval_step, state_sharding, mesh),
        in_shardings=(state_sharding, batch_sharding(mesh)),
        out_shardings=NamedSharding(mesh, P()),
    )


def collectives(jitted, *args, **kwargs) -> list[hlo.Collective]:
    """The collectives of `jitted(*args, **kwargs)` as XLA's SPMD partitioner placed them: kind,
    dtype, per-device shape and bytes, and the JAX name stack each came from.

    Read before any backend widens 16-bit collectives (XLA:CPU runs them in float32); see
    `jamp.hlo`. E.g. under "mixed_bfloat16" every matmul weight is all-gathered as bf16.
    """
    return hlo.collectives(hlo.partitioned_hlo(jitted, *args, **kwargs))
