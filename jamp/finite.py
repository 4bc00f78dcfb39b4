"""Whether a gradient tree is finite (in all, or module by module), and the choice of one tree or
another on that verdict: how a train step skips an update whose gradients overflowed.

Example:
  >>> grads_finite = all_finite(grads)
  >>> params = select_tree(grads_finite, new_params, params)
"""

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jmp

from jamp import grad_stats

T = TypeVar("T")


def all_finite(tree: Any) -> jax.Array:
    """Returns a bool scalar array: True when every leaf of `tree` is finite.

    Delegates to `jmp.all_finite`, which handles int and bool leaves and empty trees.
    Under `pmap`, average the gradients first so every replica reaches the same verdict.

    Example:
      >>> bool(all_finite({"w": jnp.array([1.0, jnp.inf])}))
      False
    """
    return jmp.all_finite(tree)


def finite_by_group(tree: Any, depth: int = 1) -> dict[str, jax.Array]:
    """Returns `{group: bool scalar}`: whether every leaf of each group of `tree` is finite.

    A group is a path prefix of `depth` branching levels: for a Flax params tree with depth=1,
    the model's top-level modules ("Dense_0", "Block_3", ...; an NNX model's list of blocks gives
    one group per item, "blocks/3"). The flags come from one pass over the leaves
    (`jamp.grad_stats`, which gives the global norm from the same pass), so a train step can
    say which modules overflowed at no extra cost; `all_finite(tree)` is the `and` of the values.

    Example:
      >>> flags = finite_by_group({"a": {"w": jnp.ones(2)}, "b": {"w": jnp.array([jnp.inf])}})
      >>> {k: bool(v) for k, v in flags.items()}
      {'a': True, 'b': False}
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth!r}.")
    return grad_stats.grad_stats(tree, depth).finite_by_group


def select_tree(pred: Any, a: T, b: T) -> T:
    """Returns `a` where the bool scalar `pred` is True, else `b`, leaf by leaf.

    Args:
      pred: bool scalar (Python bool or array, possibly traced).
      a, b: trees of the same structure and leaf dtypes.

    Returns:
      A tree like `a`; use it to skip an update whose gradients overflowed.

    Example:
      >>> params = select_tree(grads_finite, new_params, params)
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(f"pred must be a bool scalar, got {pred.dtype}{pred.shape}")
    return jmp.select_tree(pred, a, b)
