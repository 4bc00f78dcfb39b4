"""Rounding float32 values into 16-bit storage: to nearest, or stochastically (unbiased).

Round-to-nearest bfloat16 stalls a weight whose updates are smaller than half a bfloat16 ulp of
it (8 bits of mantissa: any update below ~0.4 % of the weight is lost every step, however many
steps there are). Stochastic rounding rounds up with probability equal to how far the value lies
towards the next bfloat16, so the rounded value equals the float32 one in expectation and small
updates accumulate on average.

The random bits come from a counter-based stream: a hash (`uniform_bits`) of each element's index
and a seed drawn from the run's key with the step folded in (`seed_of`), mixed with the leaf's
path in the tree (`leaf_seeds`). So every pmap replica and every shard of a sharded array draws
the same bits for the same element, and a resumed run draws what the original drew.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any

#: What `round_tree` takes for `mode`: "auto" is stochastic for bfloat16, nearest for float16.
MODES = ("auto", "stochastic", "nearest")
_BF16, _F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


def stochastic_round(x: jax.Array, seed: jax.Array) -> jax.Array:
    """Rounds float32 `x` to bfloat16, up or down at random: unbiased (E[result] == x).

    bfloat16 is float32's upper 16 bits, so adding 16 uniform random bits to the lower half and
    truncating carries into the kept half with probability (lower half) / 2**16: exactly the
    fraction of the way to the next bfloat16 (in magnitude, so negative values alike). inf and
    nan round as a cast would; a finite value past bfloat16's largest rounds up to inf with the
    same probability as to any other neighbour.

    Args:
      x: the values.
      seed: a JAX key, or a uint32 scalar (`seed_of`): the random bits are `uniform_bits`.
    """
    x = jnp.asarray(x, _F32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    noise = uniform_bits(seed_of(seed), x.shape) >> 16
    upper = ((bits + noise) >> 16).astype(jnp.uint16)
    rounded = lax.bitcast_convert_type(upper, _BF16)  # the kept half as it is: no float convert
    return jnp.where(jnp.isfinite(x), rounded, x.astype(_BF16))  # nan bits could wrap


def seed_of(key: jax.Array) -> jax.Array:
    """A uint32 scalar from a JAX key, typed (`jax.random.key`) or raw (`PRNGKey`: one threefry
    draw); a uint32 scalar as it is."""
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or key.shape:
        return jax.random.bits(key, (), jnp.uint32)
    return key.astype(jnp.uint32)


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser (murmur3's): each input bit flips each output bit with
    probability about 1/2."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def uniform_bits(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """32 random bits per element of `shape`: a hash of the element's index and `seed`.

    Counter-based and elementwise: a shard of a sharded array computes its own elements' bits
    from their global indices, exactly as one device would for the whole array, and the program
    stays small (one threefry draw per step for the seed, not one per array: `seed_of`).
    """
    index = jnp.zeros(shape, jnp.uint32)
    for dim, size in enumerate(shape):
        index = index * jnp.uint32(size) + lax.broadcasted_iota(jnp.uint32, shape, dim)
    seed = jnp.asarray(seed, jnp.uint32)
    if math.prod(shape) > 2**32:  # the linear index wraps: tell its 2**32-element pages apart
        page = jnp.zeros(shape, jnp.uint32)
        for dim in range(len(shape)):  # a hash of the multi-index, so no element repeats
            page = _mix(page + lax.broadcasted_iota(jnp.uint32, shape, dim))
        seed = _mix(seed ^ page)
    return _mix(_mix(index * jnp.uint32(0x9E3779B9) + _mix(seed)) ^ seed)


def path_tag(path) -> int:
    """A stable 31-bit number for a tree path (a key path or its text)."""
    text = path if isinstance(path, str) else jax.tree_util.keystr(path)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def leaf_seeds(seed: jax.Array, tree: PyTree) -> PyTree:
    """A uint32 seed per leaf of `tree`: `seed` (`seed_of` a key) hashed with the leaf's path."""
    seed = seed_of(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _mix(seed ^ jnp.uint32(path_tag(path))), tree
    )


def round_tree(values: PyTree, like: PyTree, mode: str, key: jax.Array | None) -> PyTree:
    """`values` (float32) in the dtypes of `like`'s leaves, rounded by `mode`.

    Args:
      values: float32 leaves (e.g. params after an update applied in float32).
      like: a tree of the same structure whose dtypes the result takes (e.g. the old params).
      mode: "stochastic" (bfloat16 leaves round stochastically, with `leaf_seeds(key, values)`),
        "nearest" (a cast) or "auto" (stochastic for bfloat16 leaves, nearest for float16 ones).
        float32 leaves pass through either way.
      key: the step's rounding key; unused for "nearest".

    Raises:
      ValueError: for an unknown mode, or "stochastic" with a float16 leaf (its 5-bit exponent,
        not its mantissa, is what fails float16 weights: keep them float32).
    """
    if mode not in MODES:
        raise ValueError(f"unknown rounding mode {mode!r}; accepted: {', '.join(MODES)}")
    dtypes = [jnp.result_type(leaf) for leaf in jax.tree.leaves(like)]
    if mode == "stochastic" and jnp.dtype(jnp.float16) in dtypes:
        raise ValueError(
            "stochastic rounding takes bfloat16 or float32 params, not float16 (its range, not "
            "its precision, fails: keep float16 params float32, or round them 'nearest')"
        )
    if mode == "auto":
        mode = "stochastic"
        dtypes = [d for d in dtypes if d != jnp.dtype(jnp.float16)]
    if mode == "nearest" or _BF16 not in dtypes:
        return jax.tree.map(lambda v, o: v.astype(jnp.result_type(o)), values, like)
    assert key is not None, "stochastic rounding needs a key"
    keys = leaf_seeds(key, values)

    def one(v, o, k):
        if jnp.result_type(o) == _BF16:
            return stochastic_round(v, k)
        return v.astype(jnp.result_type(o))

    return jax.tree.map(one, values, like, keys)
