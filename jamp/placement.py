"""Where each leaf of a `TrainState` goes on a mesh: the FSDP rule, tensor-parallel rules, and
`describe`. Pure functions of shapes, a mesh and rules; `jamp.sharding` places the arrays.

The rule: each param, and every optimizer-state leaf with the param's path and shape (Adam's
moments; 8-bit moments' codes, their block scales alike where the blocks divide), is split over `fsdp` along its largest dimension that `fsdp` divides and no rule took;
a leaf with no such dimension (a scalar, a bias of odd width) stays replicated, and `describe`
says why. Mutable model state, the loss scale and the counters are replicated. `rules` are
`(path pattern, spec)` pairs (see `jamp.sharding`); an axis the mesh lacks is dropped.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Mapping, Optional, Sequence, Union

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jamp.lowbit import bytes_per_param

PyTree = Any

#: The mesh axes jamp knows, in the order a mesh lists them.
AXES = ("data", "fsdp", "tensor")

AxisSpec = Union[None, str, Sequence[str]]
#: `(path pattern, spec)` pairs: the first pattern matching a param's path places it.
Rules = Sequence[tuple[str, Sequence[AxisSpec]]]


def axis_size(mesh: Mesh, name: str) -> int:
    return int(mesh.shape[name]) if name in mesh.axis_names else 1


def _fsdp_spec(shape: tuple[int, ...], fsdp: int, taken=()) -> tuple[P, Optional[str]]:
    """The spec splitting the largest dimension `fsdp` divides, and why not, if none does.

    `taken` is the spec a rule gave (one entry per dimension): only its free dimensions split."""
    base = list(taken) + [None] * (len(shape) - len(taken))
    if fsdp == 1 or any("fsdp" in axis_names(e) for e in base):
        return _spec(base), None if any(base) else "no fsdp axis"
    if not shape:
        return P(), "a scalar"
    order = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
    for d in order:
        if base[d] is None and shape[d] % fsdp == 0:
            base[d] = "fsdp"
            return _spec(base), None
    why = f"no dimension of {shape} divides by fsdp={fsdp}"
    return _spec(base), None if any(base) else why


def _spec(entries) -> P:
    """A PartitionSpec without trailing Nones (the canonical spelling of the same placement)."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def axis_names(entry: AxisSpec) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _rule_spec(path: str, shape: tuple[int, ...], spec, mesh: Mesh) -> list:
    """A rule's spec for one param, checked against the param's shape and the mesh: axes the
    mesh lacks dropped; a misfit is a one-line ValueError."""
    spec = list(spec)
    if len(spec) > len(shape):
        raise ValueError(f"rule for {path}: spec {tuple(spec)} has more entries than {shape}")
    used = [a for entry in spec for a in axis_names(entry)]
    twice = sorted({a for a in used if used.count(a) > 1})
    if twice:
        raise ValueError(f"rule for {path}: axis {twice[0]!r} appears twice in {tuple(spec)}")
    out = []
    for d, entry in enumerate(spec):
        names = axis_names(entry)
        bad = [a for a in names if a not in AXES]
        if bad:
            raise ValueError(
                f"rule for {path}: unknown mesh axis {bad[0]!r}; axes: {', '.join(AXES)}"
            )
        names = tuple(a for a in names if a in mesh.axis_names)
        ways = math.prod(int(mesh.shape[a]) for a in names)
        if shape[d] % ways:
            raise ValueError(
                f"rule for {path}: dimension {d} of {shape} does not split {ways} ways "
                f"over {','.join(names)}"
            )
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return out


def rules_from_metadata(variables: PyTree, logical_rules: Optional[Sequence] = None) -> list:
    """Placement rules from Flax partitioning metadata, for `shard_state(..., rules=...)`.

    Args:
      variables: a model's variables (or params) as `init` returns them, still boxed: the
        leaves made with `nn.with_partitioning` / `nn.with_logical_partitioning` carry their axes.
      logical_rules: for logical axis names, `(logical name, mesh axis or None)` pairs, as in
        `flax.linen.logical_axis_rules` (e.g. `[("mlp", "tensor"), ("embed", None)]`).

    Returns:
      One exact-path rule per param whose metadata names an axis.
    """
    if isinstance(variables, Mapping) and "params" in variables:
        variables = variables["params"]
    boxed = jax.tree_util.tree_flatten_with_path(
        variables, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )[0]
    rules = []
    for path, box in boxed:
        if not isinstance(box, nn.Partitioned) or not any(box.names):
            continue
        names = tuple(box.names)
        if isinstance(box, nn.LogicallyPartitioned):  # logical names, mapped onto mesh axes
            mesh_axes = nn.logical_to_mesh_axes(names, logical_rules or box.rules)
            assert mesh_axes is not None  # None only for names=None
            names = tuple(mesh_axes)
        rules.append(("/".join(path_keys(path)), names))
    return rules


def path_keys(path) -> tuple[str, ...]:
    """A pytree key path as strings; an NNX variable's own `.value` at its end is left out, so
    a model's variables inside the traced program (NNX state: `embed/embedding/.value`) match
    the params as a train state holds them (`embed/embedding`)."""
    out = []
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                out.append(str(getattr(entry, attr)))
                break
        else:
            out.append(str(entry))
    return tuple(out)


def _param_specs(
    params: PyTree, mesh: Mesh, rules: Optional[Rules] = None
) -> dict[tuple[str, ...], tuple[tuple, P, Optional[str]]]:
    fsdp = axis_size(mesh, "fsdp")
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys, shape = path_keys(path), tuple(np.shape(leaf))
        name = "/".join(keys)
        rule = next((spec for pat, spec in rules or () if fnmatch.fnmatchcase(name, pat)), ())
        spec, why = _fsdp_spec(shape, fsdp, _rule_spec(name, shape, rule, mesh))
        specs[keys] = (shape, spec, why)
    return specs


def _like_param(keys, shape, param_specs) -> Optional[tuple[P, Optional[str]]]:
    """The spec of the param whose path ends `keys` and whose shape is `shape` (Adam's mu, nu)."""
    for pkeys, (pshape, spec, why) in param_specs.items():
        if pshape == shape and len(keys) >= len(pkeys) and keys[len(keys) - len(pkeys) :] == pkeys:
            return spec, why
    return None


def _like_quantized(keys, shape, param_specs, mesh: Mesh) -> Optional[tuple[P, Optional[str]]]:
    """The spec of an 8-bit optimizer-state leaf (`jamp.lowbit.Quantized`): its codes have the
    param's shape and take its spec; its block scales (the param's leading axes, then one per
    block of the rest) take the same spec, their last axis split like the first of the param's
    axes it stands for, where the blocks divide."""
    if not keys or keys[-1] not in ("codes", "scales"):
        return None
    owner = keys[:-1]
    for pkeys, (pshape, spec, why) in param_specs.items():
        if len(owner) < len(pkeys) or owner[len(owner) - len(pkeys) :] != pkeys:
            continue
        if keys[-1] == "codes" and pshape == shape:
            return spec, why
        lead = len(shape) - 1
        if keys[-1] == "scales" and len(pshape) > lead and pshape[:lead] == shape[:lead]:
            entries = (list(spec) + [None] * len(pshape))[: lead + 1]
            split = math.prod(mesh.shape[a] for a in axis_names(entries[-1]))
            if shape[-1] % split:  # blocks of the merged axes: split with the first, if they divide
                entries[-1] = None
            return _spec(entries), why
    return None


def state_plan(state, mesh: Mesh, rules: Optional[Rules] = None):
    """(field, keys, spec, why-replicated) for every leaf of a TrainState."""
    param_specs = _param_specs(state.params, mesh, rules)
    plan = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = path_keys(path)
        field, rest = keys[0], keys[1:]
        shape = tuple(np.shape(leaf))
        if field in ("params", "compute_params"):  # a 16-bit copy sits where its param does
            _, spec, why = param_specs[rest]
        elif field == "opt_state":
            found = _like_param(rest, shape, param_specs) or _like_quantized(
                rest, shape, param_specs, mesh
            )
            spec, why = found if found else (P(), "optimizer state not shaped like a param")
        elif field == "model_state":
            spec, why = P(), "mutable model state (e.g. batch statistics) is replicated"
        else:
            spec, why = P(), "loss scale and counters are replicated"
        plan.append((field, keys, spec, why))
    return plan


def _spec_text(spec: P) -> str:
    order = {a: i for i, a in enumerate(AXES)}
    axes = sorted({a for e in spec for a in axis_names(e)}, key=lambda a: order.get(a, len(AXES)))
    return f"split over {','.join(axes)}" if axes else "replicated"


def describe(state, mesh: Optional[Mesh] = None, rules: Optional[Rules] = None) -> str:
    """Per group of leaves (field and placement), the bytes per device; what stayed replicated, why.

    `state` is a placed `TrainState` (from `shard_state`: its placement is read from its arrays),
    or any `TrainState` with `mesh` (and the `rules` it would be placed with) given.
    """
    if mesh is not None:
        plan = state_plan(state, mesh, rules)
    else:
        mesh = next(iter(jax.tree.leaves(state))).sharding.mesh
        placed = [leaf.sharding.spec for leaf in jax.tree.leaves(state)]
        plan = [
            (field, keys, spec, why if not any(spec) else None)
            for (field, keys, _, why), spec in zip(state_plan(state, mesh), placed)
        ]
    groups: dict[tuple[str, str], dict] = {}
    total = total_dev = 0
    for (field, keys, spec, why), leaf in zip(plan, jax.tree.leaves(state)):
        shape, itemsize = tuple(np.shape(leaf)), np.dtype(leaf.dtype).itemsize
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        per_dev = int(np.prod(NamedSharding(mesh, spec).shard_shape(shape), dtype=np.int64))
        per_dev *= itemsize
        total, total_dev = total + nbytes, total_dev + per_dev
        g = groups.setdefault((field, _spec_text(spec)), {"n": 0, "dev": 0, "all": 0, "why": {}})
        g["n"], g["dev"], g["all"] = g["n"] + 1, g["dev"] + per_dev, g["all"] + nbytes
        if why and field in ("params", "opt_state"):
            g["why"].setdefault(why, []).append("/".join(keys[1:]))
    mesh_text = ", ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    per = bytes_per_param(state)
    copies = f"16-bit copies {per['copies']:.2f} + " if per["copies"] else ""
    lines = [
        f"mesh {mesh_text}: {total_dev:,} of {total:,} bytes of state per device",
        f"  per parameter: params {per['params']:.2f} + {copies}optimizer {per['opt_state']:.2f} = "
        f"{per['total']:.2f} bytes (gradients not included)",
        f"  {'field':12} {'placement':22} {'leaves':>6} {'bytes/device':>14} {'of total':>14}",
    ]
    for (field, placement), g in groups.items():
        lines.append(f"  {field:12} {placement:22} {g['n']:>6} {g['dev']:>14,} {g['all']:>14,}")
        for why, names in g["why"].items():
            shown = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
            lines.append(f"    replicated, {why}: {shown}")
    return "\n".join(lines)
