"""The run's state against a checkpoint's: what may differ between them, and what may not.

A state's array leaves as paths to shapes and dtypes (for a `TrainState` and a checkpoint's
stored tree alike) and the first difference between two; the TrainState fields a checkpoint may
lack (added to jamp after it was written, or switched on by the run since) and the params' 16-bit
copies it may hold in another form; the target as the shapes, dtypes and shardings a restore
reads into. `jamp.train.checkpoint` decides from these what it restores and what it refuses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
    return tuple(np.shape(leaf) if not hasattr(leaf, "shape") else leaf.shape), np.dtype(dtype)


def leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Maps 'params/Dense_0/kernel'-style paths to (shape, dtype) for every array leaf of `tree`.

    Works for a `TrainState` and for Orbax's stored metadata tree alike: Orbax stores attributes
    and named-tuple fields as dict keys and tuples as lists, which give the same path strings.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_name(k) for k in path): _shape_dtype(leaf) for path, leaf in leaves}


def describe_mismatch(stored: dict, wanted: dict) -> str | None:
    """Returns the first difference between two `leaf_specs` maps (and how many more), or None."""
    problems = []
    # In the target's order (params first), then what only the checkpoint has.
    for path in [*wanted, *(p for p in stored if p not in wanted)]:
        if path not in wanted:
            problems.append(f"{path} is in the checkpoint but not in this model's state")
        elif path not in stored:
            problems.append(f"{path} is in this model's state but not in the checkpoint")
        elif stored[path][0] != wanted[path][0]:
            problems.append(
                f"{path} has shape {stored[path][0]} in the checkpoint and {wanted[path][0]} here"
            )
        elif stored[path][1] != wanted[path][1]:
            problems.append(
                f"{path} has dtype {stored[path][1]} in the checkpoint and {wanted[path][1]} here"
            )
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else ""
    return problems[0] + more


def same_copies(held: Any, copies: Any) -> bool:
    """Whether a checkpoint's `compute_params` (metadata) are the ones the run keeps: then they
    are restored as stored, and a resumed run reads the very copies the update wrote."""
    if held is None or copies is None:
        return False
    wanted = leaf_specs({"compute_params": copies})
    return describe_mismatch(leaf_specs({"compute_params": held}), wanted) is None


def as_stored(held: Any, params: Any) -> Any:
    """Placeholders for a checkpoint's `compute_params` (to read them and let them go): their
    stored shapes and dtypes, on their params' shardings."""
    if held is None:
        return None

    def like(meta, param):
        if meta is None:
            return None
        sharding = getattr(param, "sharding", None)
        return jax.ShapeDtypeStruct(tuple(meta.shape), meta.dtype, sharding=sharding)

    try:
        return jax.tree.map(like, held, params, is_leaf=lambda x: x is None)
    except ValueError:  # another model's: the params' own mismatch is what gets reported
        return jax.tree.map(lambda m: like(m, None), held, is_leaf=lambda x: x is None)


def fields_added_since(target: Any, stored_tree: Any) -> list[str]:
    """TrainState fields that are None in `target` and absent from a checkpoint's tree (one
    written by a jamp that did not have them, e.g. `fp8_state`)."""
    if not dataclasses.is_dataclass(target) or not isinstance(stored_tree, dict):
        return []
    return [
        f.name
        for f in dataclasses.fields(target)
        if getattr(target, f.name) is None and f.name not in stored_tree
    ]


#: TrainState fields a run may switch on between restarts (a fresh value is kept then).
OPTIONAL_FIELDS = ("adaptive_state",)


def switched_on(target: Any, stored_tree: Any) -> list[str]:
    """OPTIONAL_FIELDS that `target` has and the checkpoint's tree does not."""
    if not dataclasses.is_dataclass(target) or not isinstance(stored_tree, dict):
        return []
    return [
        name
        for name in OPTIONAL_FIELDS
        if getattr(target, name, None) is not None and not stored_tree.get(name)
    ]


def abstract(target: Any) -> Any:
    """The target as shapes, dtypes and shardings; static pytree data is kept as it is."""
    default = jax.sharding.make_single_device_sharding(jax.local_devices()[0])

    def spec(leaf):
        shape, dtype = _shape_dtype(leaf)
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=getattr(leaf, "sharding", None) or default
        )

    return jax.tree_util.tree_map(spec, target)
