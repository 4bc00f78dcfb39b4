"""The loss's label picks (`jnp.take_along_axis` of the labels' logits) in a recomputed tail:
the gather itself forward, a select where the index hits backward (see `jamp.engine._tail`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp.engine import _values as V


def _size(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def pick_form(eqn, operand) -> str | None:
    """How a gather picks elements along its operand's last axis: "batched" (every other axis a
    batching axis, one or more picks per row: `jnp.take_along_axis(x, idx, axis=-1)`), "rows"
    (one pick per row, the operand's axes of size 1 taken as offsets, as `take_along_axis` does
    for them: a batch of one sequence), or None for any other gather."""
    if eqn.primitive.name != "gather":
        return None
    dn = eqn.params["dimension_numbers"]
    nd = np.ndim(operand)
    if (
        nd < 1
        or tuple(dn.collapsed_slice_dims) != (nd - 1,)
        or tuple(dn.start_index_map) != (nd - 1,)
        or any(s != 1 for s in eqn.params["slice_sizes"])
        or eqn.invars[1].aval.shape[-1] != 1
    ):
        return None
    on = tuple(getattr(dn, "operand_batching_dims", ()))
    among = tuple(getattr(dn, "start_indices_batching_dims", ()))
    batch = tuple(range(nd - 1))
    if tuple(dn.offset_dims) == () and on == batch and among == batch:
        return "batched"
    shape = np.shape(operand)
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if (
        all(shape[d] == 1 for d in batch if d not in on)
        and list(on) == sorted(on)
        and list(among) == sorted(among)
        and _size(eqn.outvars[0].aval) == rows
    ):  # the axes that are not batching axes have size 1: picks and rows in the same order
        return "rows"
    return None


def pick(eqn, form: str, x, indices):
    """The gather `eqn`, of elements along `x`'s last axis (`form`: see `pick_form`): the gather
    itself forward (it reads one element per pick), and as its transpose a select of the
    cotangent where the index hits (fused into the backward's elementwise kernel), not a scatter
    into zeros."""
    vocab = x.shape[-1]
    mode = eqn.params.get("mode")
    clipped = "CLIP" in str(mode) or "PROMISE" in str(mode)

    @jax.custom_vjp
    def gathered(x, indices):
        return V.bind(eqn, [x, indices], eqn.params)[0]

    def forward(x, indices):
        return gathered(x, indices), indices

    def backward(indices, g):
        if form == "rows":  # one pick per row, in the rows' order
            indices, g = indices.reshape(x.shape[:-1] + (1,)), g.reshape(x.shape[:-1])
        idx = indices[..., 0]  # [*batch, *extra]
        extra = idx.ndim - (x.ndim - 1)
        if clipped:
            idx = jnp.clip(idx, 0, vocab - 1)  # out of range outside `clip`: no element is hit
        hit = lax.broadcasted_iota(idx.dtype, idx.shape + (vocab,), idx.ndim) == idx[..., None]
        spread = jnp.where(hit, g[..., None].astype(x.dtype), jnp.zeros((), x.dtype))
        axes = tuple(range(x.ndim - 1, x.ndim - 1 + extra))
        return (jnp.sum(spread, axis=axes) if axes else spread), None

    gathered.defvjp(forward, backward)
    return gathered(x, indices)


def bind(eqn, invals, keep_below: int) -> list:
    """`eqn` on `invals`; a single-element gather of a large value as a pick."""
    if invals and (form := pick_form(eqn, invals[0])) and np.size(invals[0]) >= keep_below:
        return [pick(eqn, form, *invals)]
    return V.bind(eqn, invals, eqn.params)
