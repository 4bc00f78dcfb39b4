"""The fp8 matmul: E4M3 operands forward, E5M2 gradients backward, fp32 accumulation, its
operands scaled by the active scope's state (delayed) or their own amax (current)."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp import jax_compat, mixed_ops
from jamp.fp8.formats import _F32, _FMAX, E4M3, E5M2, _amax, _max_last, quantize, scale_for
from jamp.fp8.scope import _ACTIVE, _Scope
from jamp.fp8.state import Site, _new_site, _roll_in


def _dot(lhs, rhs, dims):
    return lax.dot_general(lhs, rhs, dims, preferred_element_type=_F32)


def _observed_site(site: Site, amaxes) -> Site:
    """The derivative handed back for `site`: this use's amaxes in the newest history column.

    Placed by selects over the array's indices, not stacked: a stack of the three is a
    concatenate, which XLA:GPU makes a kernel per site wherever it is read alone."""
    row = lax.broadcasted_iota(jnp.int32, site.scale.shape, 0)
    ax, aw, ag = (jnp.asarray(a, _F32) for a in amaxes)
    newest = jnp.where(row == 0, ax, jnp.where(row == 1, aw, ag))
    history = _roll_in(jnp.zeros_like(site.amax_history), newest)
    return Site(history, jnp.zeros_like(site.scale))


def _placed(q, placed: Optional[mixed_ops.Placed]):
    """A quantised sharded operand, on its own shards and then where the matmul reads it: the
    gather moves fp8 (one byte per value), as `mixed_ops.Placed` describes for 16 bits."""
    if placed is None:
        return q
    q = lax.with_sharding_constraint(q, placed.sharding)
    return q if placed.gathered is None else lax.with_sharding_constraint(q, placed.gathered)


def _grad_to(d, like_dtype, placed: Optional[mixed_ops.Placed]):
    """A gradient in its operand's dtype; a sharded operand's is summed across devices in the
    reduce dtype, onto the operand's own shards."""
    if placed is None:
        return d.astype(like_dtype)
    d = lax.with_sharding_constraint(d.astype(placed.reduce_dtype), placed.sharding)
    return d.astype(like_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _f8_dot(lhs, rhs, site, ax, sx, dims, out_dtype, mode, margin, placed, keep):
    return _f8_fwd(lhs, rhs, site, ax, sx, dims, out_dtype, mode, margin, placed, keep)[0]


#: How an fp8 matmul scales its operands: the tensor's own amax; the state's scale; the state's
#: scale where that operand has a recorded amax, else its own (`scaling(own_when_unmeasured)`).
_CURRENT, _DELAYED, _DELAYED_OR_OWN = "current", "delayed", "delayed_or_own"


def _scale(site: Site, row: int, amax, mode: str, margin: float):
    """The scale of one operand, by `mode` (`_CURRENT`, `_DELAYED`, `_DELAYED_OR_OWN`).

    Delayed, nothing of this step's amax reaches the quantisation, so XLA computes the amax
    recorded for the next step in the kernel that quantises (one pass over the tensor); a
    fallback to the tensor's own amax, even behind a `lax.cond`, becomes a select that waits for
    the full reduction (four kernels per operand instead of two on the H200 program)."""
    if mode == _DELAYED:
        return site.scale[row]
    own = scale_for(amax(), _FMAX[row], margin)
    if mode == _CURRENT:
        return own
    return jnp.where(_max_last(site.amax_history[row]) > 0, site.scale[row], own)


def _x_scale(scope: Optional[_Scope], lhs, entry: Site, shared: bool, mode, margin):
    """The activation's amax and scale, outside the matmul's derivative (both are constants to
    it): once per activation in a trace when `shared`, for every site that reads it.

    q, k and v read one normalised input, gate and up another. Each such site records the same
    amax of it, so their activation histories and scales are equal, and the first reader's serve
    them all: the quantisations become one computation, which XLA merges into one fp8 copy kept
    for the backward pass (one per site before: three for q, k, v), and, under sharding, one
    all-reduce of the amax instead of one per site (XLA cannot merge collectives).
    """
    if shared:
        assert scope is not None  # shared only with a scope's state
        held = scope.first_reader.get(id(lhs))
        if held is not None and held[0] is lhs:
            return held[1:]
    x = lax.stop_gradient(lhs)
    ax = _amax(x)
    sx = _scale(jax.tree.map(lax.stop_gradient, entry), 0, lambda: _amax(x), mode, margin)
    if shared:
        assert scope is not None
        scope.first_reader[id(lhs)] = (lhs, ax, sx)
    return ax, sx


def _f8_fwd(lhs, rhs, site, ax, sx, dims, out_dtype, mode, margin, placed, keep):
    aw = _amax(rhs)
    sw = _scale(site, 1, lambda: _amax(rhs), mode, margin)
    xq = _placed(quantize(lhs, sx, E4M3), placed[0])
    wq = _placed(quantize(rhs, sw, E4M3), placed[1])
    out = (_dot(xq, wq, dims) * (1.0 / (sx * sw))).astype(out_dtype)
    like = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    # The backward's activation operand: its fp8 copy, or (`keep`) the 16-bit activation itself
    return out, (lhs if keep else xq, wq, sx, sw, ax, aw, site, like)


def _f8_bwd(dims, out_dtype, mode, margin, placed, keep, residuals, g):
    del out_dtype
    xq, wq, sx, sw, ax, aw, site, (lhs_like, rhs_like) = residuals
    if keep:
        # Quantised again, to the forward's very values. The barrier keeps XLA from merging this
        # with the forward's quantisation, which would keep that fp8 copy until here after all,
        # and, holding `g`, from quantising before this gradient exists (with the scale from the
        # state, XLA scheduled every layer's copy at once: 12 x 6 MiB more at GPT-2 small's peak).
        # (The scale stays out: a barrier's operand is a buffer, a kernel per layer to slice.)
        x, g = lax.optimization_barrier((xq, g))
        xq = quantize(x, sx, E4M3)
    ag = _amax(g)
    sg = _scale(site, 2, lambda: _amax(g), mode, margin)
    gq = quantize(g, sg, E5M2)
    (l_dims, l_perm), (r_dims, r_perm) = mixed_ops.backward_dims(dims, xq.ndim, wq.ndim, g.ndim)
    d_lhs = lax.transpose(_dot(gq, wq, l_dims) * (1.0 / (sg * sw)), l_perm)
    d_rhs = lax.transpose(_dot(xq, gq, r_dims) * (1.0 / (sx * sg)), r_perm)
    return (
        _grad_to(d_lhs, lhs_like.dtype, placed[0]),
        _grad_to(d_rhs, rhs_like.dtype, placed[1]),
        _observed_site(site, (ax, aw, ag)),
        jnp.zeros_like(ax),
        jnp.zeros_like(sx),
    )


_f8_dot.defvjp(_f8_fwd, _f8_bwd)


def dot_general(
    lhs,
    rhs,
    dimension_numbers,
    out_dtype,
    site: Optional[str] = None,
    placed=(None, None),
    *,
    keep_lhs: bool = False,
):
    """`lax.dot_general` with E4M3 operands forward, E5M2 gradients backward, fp32 accumulation.

    Args:
      lhs, rhs: floating arrays of any dtype (the activation and the weight).
      dimension_numbers: as for `lax.dot_general`.
      out_dtype: dtype of the result.
      site: this matmul's site name, or None (a matmul no state can describe). Under `scaling`,
        a site the state holds is scaled by the state's recipe and reports its amaxes; any other
        uses current scaling. Under `init_state`, the name is collected.
      placed: per operand, a `jamp.mixed_ops.Placed` (a sharded parameter: quantised on its
        shards, gathered in fp8, its gradient reduced in the reduce dtype) or None.
      keep_lhs: `lhs` is a 16-bit value that the backward pass keeps anyway (a fused attention's
        output, which cuDNN's backward reads): keep it rather than a second, fp8 copy of it, and
        quantise it again in the backward pass (to the same values). Ignored for a float32 or
        sharded `lhs`, whose fp8 copy is the smaller one to keep.

    Returns:
      The product, in `out_dtype`; gradients come back in `lhs.dtype` and `rhs.dtype`.
    """
    dims = tuple(tuple(tuple(int(d) for d in axes) for axes in pair) for pair in dimension_numbers)
    scope = _ACTIVE.get()
    if jax_compat.is_batched(lhs) or jax_compat.is_batched(rhs):
        # Under vmap (a model applied per example) one site runs once per example: amaxes would
        # add up in the state, so it scales each example by its own amax, statelessly.
        site = None
    if scope is not None and scope.found is not None and site is not None:
        scope.found.append(site)
    state = scope.state if scope is not None else None
    shared = False
    if state is not None and site in state.sites:
        assert scope is not None  # the state is the scope's
        scope.reached.add(site)
        mode, margin, entry = _CURRENT, state.margin, state.sites[site]
        if state.recipe == "delayed":
            mode = _DELAYED_OR_OWN if scope.own_when_unmeasured else _DELAYED
        shared = True
    else:
        mode, margin, entry = _CURRENT, 0.0 if state is None else state.margin, _new_site(1)
    ax, sx = _x_scale(scope, lhs, entry, shared, mode, float(margin))
    keep = bool(keep_lhs) and placed[0] is None and np.dtype(lhs.dtype).itemsize == 2
    return _f8_dot(
        lhs,
        rhs,
        entry,
        ax,
        sx,
        dims,
        np.dtype(out_dtype),
        mode,
        float(margin),
        tuple(placed),
        keep,
    )
