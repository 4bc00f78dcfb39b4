"""Optimizer state in 16 or 8 bits, around any optax optimizer.

Adam keeps two float32 moments per parameter: 8 of the 12 bytes of state a parameter costs with
float32 master weights. Both wrappers here keep the wrapped optimizer unchanged: they hand it its
state in float32, let it update, and store the result compactly again.

* `bf16_state(tx)` stores every float state array in bfloat16, rounded stochastically by default
  (the moments are running averages: round-to-nearest would stall them like weights); 2 bytes each.
* `int8_state(tx)` stores every float state array of `min_size` or more elements in 8 bits with
  block-wise scales (the 8-bit Adam recipe): each block of about `block` values along the
  trailing axes (cut so that FSDP's shards hold whole blocks: `block_layout`) is scaled by
  its largest magnitude and each value stored as the index of the nearest of 256 codes spaced
  on a dynamic, roughly logarithmic scale (`dynamic_code`); 1 byte each plus a float32 scale
  per block (about 1 + 4/256 bytes). Moments that are never negative (Adam's second moment,
  `nu`) use a code without sign or zero, so they keep 8 bits of magnitude and never round a
  small second moment down to zero (which would divide an update by epsilon alone).

* `kahan(tx)` is the deterministic alternative to stochastically rounded bfloat16 params: a
  compensation buffer (2 bytes per param) carries what rounding to nearest lost into the next
  step.

The codes keep their array's shape (uint8) and the scales its leading axes (then one entry per
block of the rest), so a state array is placed like its parameter when the params are sharded
(`jamp.placement`), scales included.

Example:
    >>> tx = jamp.lowbit.int8_state(optax.adamw(1e-3))  # 8-bit moments: ~2 bytes per param
    >>> state = jamp.TrainState.create(params, tx)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jamp import rounding

PyTree = Any

#: Names of optimizer-state fields (NamedTuple fields, not dict keys) whose values are never
#: negative: optax's second moments (Adam's family's `nu`, AMSGrad's `nu_max`). Not for
#: optimizers whose `nu` is signed (optax.sm3): pass `unsigned=()` there.
UNSIGNED = ("nu", "nu_max")


@struct.dataclass
class Quantized:
    """A float array stored as 8-bit codes with one float32 scale per block of its last axis."""

    codes: jax.Array  # uint8, the array's shape: indices into dynamic_code(signed)
    scales: jax.Array  # float32, (*leading axes, blocks of the rest): each block's absmax
    signed: bool = struct.field(pytree_node=False)
    block: int = struct.field(pytree_node=False)


class LowBitState(NamedTuple):
    """The wrapped optimizer's state with its float arrays stored low-bit, and a step counter
    (the stochastic rounding's random stream)."""

    step: jax.Array
    inner: PyTree


def bytes_per_param(state) -> dict[str, float]:
    """Bytes of state per parameter: {"params", "copies", "opt_state", "total"} (gradients not
    included).

    fp32 master weights with Adam: 4 + 8 = 12; bfloat16 params with bfloat16 moments
    (`jamp.lowbit.bf16_state`): 2 + 4 = 6; with 8-bit moments (`int8_state`): about 2 + 2.03.
    "copies": the 16-bit copies of the params' matrices a state may keep (`compute_params`),
    about 2 when it does, 0 when it does not.
    `state` is a `jamp.TrainState` (its params and opt_state), and may be abstract
    (`jax.ShapeDtypeStruct` leaves).
    """

    def nbytes(tree) -> int:
        return sum(
            int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
        )

    count = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(state.params))
    params, opt = nbytes(state.params) / max(count, 1), nbytes(state.opt_state) / max(count, 1)
    copies = nbytes(getattr(state, "compute_params", None)) / max(count, 1)
    return {"params": params, "copies": copies, "opt_state": opt, "total": params + copies + opt}


def dynamic_code(signed: bool) -> np.ndarray:
    """The 256 values (sorted, in [-1, 1] or (0, 1]) that 8-bit codes stand for.

    Each decade 10**-e (e = 0, 1, ...) gets half as many evenly spaced values as the one above,
    so large values, which dominate an update, keep the finest steps (1/64 of the block's
    largest at the top, signed), and small ones still keep a few significant bits down to
    1e-6 (signed) or 1e-8 (unsigned) of it. The signed code holds 0 and the unsigned one does
    not.
    """
    bits = 6 if signed else 7  # magnitude bits beside the sign
    values = []
    for e in range(bits + 1):
        n = 2 ** (bits - e)
        values += [10.0**-e * (0.1 + 0.9 * (j + 1) / n) for j in range(n)]
    magnitudes = np.array(values)  # 127 (signed) or 255
    if signed:
        code = np.concatenate([-magnitudes, [0.0], magnitudes, [1.0]])  # 1.0 twice: 256
    else:
        code = np.concatenate([[1e-8], magnitudes])
    return np.sort(code).astype(np.float32)


def quantize(x: jax.Array, *, signed: bool, block: int = 256) -> Quantized:
    """`x` as 8-bit codes: each block of about `block` values (along the trailing axes,
    `_rows`; `block_layout`) scaled by its largest magnitude, each value the index of the
    nearest value of `dynamic_code(signed)`."""
    x = jnp.asarray(x, jnp.float32)
    code = dynamic_code(signed)
    rows = _rows(x, block)
    blocks = _blocks(rows, block)
    scales = jnp.max(jnp.abs(blocks), axis=-1)
    normalised = blocks / jnp.where(scales > 0, scales, 1.0)[..., None]
    codes = _nearest(normalised, (code[1:] + code[:-1]) / 2)
    codes = codes.reshape(*blocks.shape[:-2], -1)[..., : rows.shape[-1]]
    return Quantized(codes=codes.reshape(x.shape), scales=scales, signed=signed, block=block)


def _nearest(x: jax.Array, midpoints: np.ndarray) -> jax.Array:
    """uint8 count of `midpoints` (255, sorted) below each value: the index of its nearest code.

    A binary search of eight compares, written out so that it fuses with the scaling into one
    elementwise kernel (jnp.searchsorted's loop costs a while loop per array, and its unrolled
    form a first lookup XLA folds into a constant the size of the array)."""
    table = jnp.asarray(midpoints, jnp.float32)
    index = jnp.where(x > float(midpoints[127]), 128, 0)  # the first probe is the same for all
    for step in (64, 32, 16, 8, 4, 2, 1):
        probe = index + step
        index = jnp.where(x > table[probe - 1], probe, index)
    return index.astype(jnp.uint8)


def dequantize(q: Quantized) -> jax.Array:
    """The float32 array `q` stands for."""
    code = jnp.asarray(dynamic_code(q.signed))
    rows = _rows(q.codes, q.block)
    values = code[_blocks(rows, q.block).astype(jnp.int32)] * q.scales[..., None]
    values = values.reshape(*rows.shape[:-1], -1)[..., : rows.shape[-1]]
    return values.reshape(q.codes.shape)


def _rows(x: jax.Array, block: int) -> jax.Array:
    """`x` with its trailing axes merged into one of at least `block` values (all of them if
    fewer), keeping as many leading axes as possible: a (d, heads, head_dim) kernel's blocks
    span heads, and its leading axes, which FSDP splits, stay the scales' leading axes."""
    keep = x.ndim - 1
    while keep > 0 and math.prod(x.shape[keep:]) < block:
        keep -= 1
    return x.reshape(*x.shape[:keep], -1)


def block_layout(n: int, block: int) -> tuple[int, int]:
    """(blocks, values per block) for a row of `n` values and a `block` of about that many.

    Where it can, a row is cut into a power of two of equal blocks, `n / blocks` values each
    (at most `block`, or up to twice it where `n` has too few factors of two): a row split
    evenly over a power-of-two number of devices (FSDP) then holds whole blocks on each, or
    each block lies evenly across a few, and the quantisation runs where the values are, with no
    gather (a (4096, 11008) kernel split on its last axis: 64 blocks of 172, where blocks of 256
    would straddle the 1376-value shards). Otherwise `ceil(n / block)` blocks of `block`, the
    last padded with zeros."""
    count = 1
    while count * block < n and n % (2 * count) == 0:
        count *= 2
    if n // count <= 2 * block:
        return count, n // count
    return -(-n // block), block


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """`x` (..., n) as (..., blocks, values per block) (`block_layout`), padded with zeros."""
    n = x.shape[-1]
    count, size = block_layout(n, block)
    pad = count * size - n
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], count, size)


def _field_names(path) -> set[str]:
    """The NamedTuple field names along `path` (a param or module named "nu" is not one)."""
    return {k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)}


def _is_float(leaf) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating) and jnp.ndim(leaf) > 0


def _wrap(tx, store, load) -> optax.GradientTransformation:
    """`tx` with its state kept as `store(inner state, count)` and read back with `load`."""

    def init_fn(params):
        count = jnp.zeros((), jnp.int32)
        return LowBitState(step=count, inner=store(tx.init(params), count))

    tx = optax.with_extra_args_support(tx)

    def update_fn(updates, state, params=None, **extra_args):
        inner = load(state.inner)
        updates, inner = tx.update(updates, inner, params, **extra_args)
        count = state.step + 1
        return updates, LowBitState(step=count, inner=store(inner, count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _load(inner: PyTree) -> PyTree:
    def one(leaf):
        if isinstance(leaf, Quantized):
            return dequantize(leaf)
        if _is_float(leaf) and jnp.result_type(leaf) == jnp.bfloat16:
            return jnp.asarray(leaf, jnp.float32)
        return leaf

    return jax.tree.map(one, inner, is_leaf=lambda x: isinstance(x, Quantized))


def bf16_state(
    tx: optax.GradientTransformation, *, rounding_mode: str = "stochastic", seed: int = 0
) -> optax.GradientTransformation:
    """`tx` with its float state arrays stored in bfloat16 (2 bytes per value).

    Args:
      tx: any optax transformation (e.g. `optax.adamw(...)`).
      rounding_mode: "stochastic" (unbiased: the random bits come from `seed`, the update count
        and each array's path, so replicas and shards round alike and a resumed run as the
        original) or "nearest".
      seed: the rounding stream's seed.
    """
    if rounding_mode not in rounding.MODES:
        raise ValueError(
            f"rounding_mode must be one of {', '.join(rounding.MODES)}, got {rounding_mode!r}"
        )

    def store(inner, count):
        key = jax.random.fold_in(jax.random.key(seed), count)
        as_bf16 = jax.tree.map(
            lambda leaf: jnp.zeros((), jnp.bfloat16) if _is_float(leaf) else leaf, inner
        )
        return rounding.round_tree(_load(inner), as_bf16, rounding_mode, key)

    return _wrap(tx, store, _load)


def int8_state(
    tx: optax.GradientTransformation,
    *,
    block: int = 256,
    min_size: int = 4096,
    unsigned: tuple[str, ...] = UNSIGNED,
) -> optax.GradientTransformation:
    """`tx` with its float state arrays of `min_size` or more values stored in 8 bits.

    Args:
      tx: any optax transformation (e.g. `optax.adamw(...)`).
      block: values per scale, about, along each array's trailing axes (`block_layout`: a row
        is cut into a power of two of equal blocks where it can, so FSDP's shards hold whole
        blocks; else its last block is padded).
      min_size: smaller arrays (biases, norm scales) stay float32: they cost little and their
        moments are the least uniform.
      unsigned: field names of state arrays that are never negative (quantised without sign).
    """
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")

    def store(inner, count):
        del count  # round to nearest: no random stream

        def one(path, leaf):
            if isinstance(leaf, Quantized) or not _is_float(leaf):
                return leaf
            if math.prod(jnp.shape(leaf)) < min_size:
                return jnp.asarray(leaf, jnp.float32)
            signed = not (_field_names(path) & set(unsigned))
            return quantize(leaf, signed=signed, block=block)

        return jax.tree_util.tree_map_with_path(one, _load(inner))

    return _wrap(tx, store, _load)


class KahanState(NamedTuple):
    """The wrapped optimizer's state and, per param, what rounding it to 16 bits has lost so far
    (stored in the params' dtype)."""

    compensation: PyTree
    inner: PyTree


def kahan(
    tx: optax.GradientTransformation, param_dtype=jnp.bfloat16
) -> optax.GradientTransformation:
    """`tx` for params stored in `param_dtype`, with Kahan-compensated updates.

    The deterministic alternative to stochastic rounding: each step adds the compensation (what
    earlier roundings of the param lost) to the float32 update, rounds the param to nearest, and
    keeps what this rounding lost as the new compensation; 2 bytes more per param. The updates
    it returns land the params exactly on their rounded values, so the train step's own
    rounding (`param_rounding`, either mode) changes nothing: pass "nearest".

    Args:
      tx: any optax transformation; it sees float32 params and updates as without this wrapper.
      param_dtype: the dtype the train state stores every floating param in (as `jamp.wrap`
        stores them under a policy's params dtype): the step hands the optimizer their float32
        view, so a param kept in float32 would be rounded to `param_dtype` too. bfloat16: a
        float16 compensation underflows for small weights.
    """
    dtype = jnp.dtype(param_dtype)

    def init_fn(params):
        zeros = jax.tree.map(
            lambda p: jnp.zeros(jnp.shape(p), dtype) if _floating(p) else jnp.zeros((), jnp.int8),
            params,
        )
        return KahanState(compensation=zeros, inner=tx.init(params))

    tx = optax.with_extra_args_support(tx)

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("kahan needs the params: pass them to update (the train step does)")
        updates, inner = tx.update(updates, state.inner, params, **extra_args)

        def target(p, u, c):  # the float32 value the param would hold without rounding
            if not _floating(p):
                return u
            return jnp.asarray(p, jnp.float32) + (u.astype(jnp.float32) + c.astype(jnp.float32))

        def landed(p, t):  # ... rounded to nearest: where the param lands
            return t.astype(dtype).astype(jnp.float32) if _floating(p) else t

        targets = jax.tree.map(target, params, updates, state.compensation)
        rounded = jax.tree.map(landed, params, targets)
        new_updates = jax.tree.map(
            lambda p, r: r - jnp.asarray(p, jnp.float32) if _floating(p) else r, params, rounded
        )
        compensation = jax.tree.map(
            lambda p, t, r, c: (t - r).astype(dtype) if _floating(p) else c,
            params,
            targets,
            rounded,
            state.compensation,
        )
        return new_updates, KahanState(compensation=compensation, inner=inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _floating(leaf) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
