"""The masks and biases of a recognised attention as the fused call takes them (see
`jamp.engine._attention`): side arrays in its [B, N, T, S] layout, constant masks read as
cuDNN's causal mask type (with a sliding window where they are a band), the rest combined into
one boolean array."""

from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp
import numpy as np

from jamp.engine import _attention_forms as F
from jamp.engine import _attention_scope
from jamp.engine._attention_values import Attn


def to_bnts(x, roles_order, full_sizes, xp=jnp):
    """A side array in the first matmul's output layout -> [B | 1, N | 1, T, S].

    `roles_order` = (b0 axis or None, N-group axes, T axis, S axis); `full_sizes` the output
    shape of the first matmul."""
    b0, group, t, s = roles_order
    x = xp.asarray(x)
    order = ([b0] if b0 is not None else []) + group + [t, s]
    x = xp.transpose(x, order)
    if b0 is None:
        x = x[None]
    n_sizes = [full_sizes[a] for a in group]
    got = list(x.shape[1 : 1 + len(group)])
    if all(g == 1 for g in got):
        n = 1
    else:
        x = xp.broadcast_to(x, x.shape[:1] + tuple(n_sizes) + x.shape[1 + len(group) :])
        n = int(np.prod(n_sizes))
    return x.reshape((x.shape[0], n) + x.shape[-2:])


def masks(attn: Attn, roles_order, full_sizes):
    """(mask array or None, causal, window or None): constant masks that are lower-triangular
    become the causal mask type (with a window where they are a band), constant all-True ones
    vanish; the rest are combined into one boolean array.

    Where the masks and biases hide at least what a causal mask hides, whatever the program's
    inputs (`Attn.hidden`: Hugging Face's causal mask and the attention mask it is given, made
    one bias; a causal mask and a padding mask combined), the attention is causal as well: they
    stay, and the half of the scores that causal hides is not computed. (A query that every key
    is hidden from, a padding row, then averages the values of keys up to it, not of all keys.)

    Masks of long sequences known by their form (`_attention_forms.Split`) are read so, never
    as T x S arrays: causal, or causal with a sliding window (query i sees keys i - window .. i:
    cuDNN skips the scores outside it); others stay as the program computes them.
    """
    t_axis, s_axis = roles_order[2], roles_order[3]
    known, data, causal, window = _sorted(attn.masks, t_axis, s_axis)
    mask = None
    for m in data:
        m = to_bnts(m, roles_order, full_sizes)
        mask = m if mask is None else jnp.logical_and(mask, m)
    t, s = full_sizes[t_axis], full_sizes[s_axis]
    hidden = []
    for h in attn.hidden:
        if isinstance(h, F.Split):
            causal |= F.covers_upper(h.region, bool(h.yes), bool(h.no), t_axis, s_axis)
        else:
            hidden.append(to_bnts(h, roles_order, full_sizes, np))
    if known:
        combined, causal, window = _constant(known, roles_order, full_sizes, causal, window)
        if combined is not None:
            hidden.append(np.logical_not(combined))
            mask = jnp.asarray(combined) if mask is None else jnp.logical_and(mask, combined)
    if not causal and hidden:
        both = functools.reduce(np.logical_or, hidden)
        causal = _covers_upper(both, t, s)
    return mask, causal, window


def _sorted(masks: list, t_axis: int, s_axis: int):
    """`(known, data, causal, window)`: the constant masks, the masks of data (arrays), and
    the masks known by their form read together as the causal mask type (with a window) where
    they are one (else among the data)."""
    causal, window = False, None
    known: list = []
    data: list = []
    by_form: list = []
    planes: set[F.Affine] = set()
    for m, c in masks:
        if isinstance(c, F.Split):
            values = [bool(c.yes), bool(c.no)]
            if all(values):
                continue
            region = c.region
            if values == [False, True] and len(region) == 1:  # kept outside one half-plane
                region, values = (F.negated(region[0]),), [True, False]
            if values == [True, False]:
                planes.update(region)
                by_form.append(m)
                continue
            c = None  # a region no mask type is: the mask as the program computes it
        if c is None:
            data.append(m)
        else:
            known.append(c)
    if planes:
        ordered = tuple(sorted(planes, key=lambda h: (h.coef, h.offset)))
        read = F.causal_window(ordered, t_axis, s_axis)
        if read is None:  # (together, no mask type either)
            data += by_form
        else:
            causal, window = read
    return known, data, causal, window


def _constant(known: list, roles_order, full_sizes, causal: bool, window):
    """`(combined, causal, window)`: the constant masks `known` as one [B | 1, N | 1, T, S]
    array, or None where they hide nothing or are read as the causal mask type (with a window
    where they are a band)."""
    t, s = full_sizes[roles_order[2]], full_sizes[roles_order[3]]
    # (pairwise, not `np.logical_and.reduce`: numpy 2.5's stubs read as Python 3.11 match no
    # overload of reduce for any array, and 2.4's match it)
    both = functools.reduce(np.logical_and, known)
    # Constants come compressed (size 1 along the axes they are constant on; see
    # `_attention_scope.Scope`), and the mask stays so: [1, 1, T, S] for a batch of them.
    combined = to_bnts(both, roles_order, full_sizes, np)
    if (combined == combined[:1, :1]).all():
        first = combined[0, 0]
        if first.all():
            combined = None
        elif not causal and _lower_triangular(first, t, s):
            causal, combined = True, None
        elif not causal and window is None:
            window = _band(first, t, s)
            if window is not None:
                causal, combined = True, None
    return combined, causal, window


def _lower_triangular(x: np.ndarray, t: int, s: int) -> bool:
    """Whether compressed bools `x` ([T | 1, S | 1]) are the causal mask `i >= j`."""
    if x.shape != (t, s):  # constant along queries or keys (and not all True): not causal
        return False
    return bool((x == np.tri(t, s, dtype=bool)).all())


def _band(x: np.ndarray, t: int, s: int) -> Optional[int]:
    """`window` where compressed bools `x` are a causal mask with a sliding window (query i sees
    keys i - window .. i), else None."""
    if x.shape != (t, s) or t < 2:
        return None
    window = int(x[t - 1].sum()) - 1  # the last query's keys: itself and `window` before it
    if window < 0 or window >= t - 1:
        return None
    band = np.tri(t, s, dtype=bool) & ~np.tri(t, s, -window - 1, dtype=bool)
    return window if bool((x == band).all()) else None


def _covers_upper(hidden: np.ndarray, t: int, s: int) -> bool:
    """Whether compressed bools `hidden` ([B | 1, N | 1, T | 1, S | 1]) hold wherever `j > i`."""
    if hidden.all():
        return True
    if hidden.shape[-2:] != (t, s) and t * s > _attention_scope._MAX_CONCRETE:
        return False  # (a long sequence's, constant along queries or keys: read as not)
    return bool(np.logical_or(hidden, np.tri(t, s, dtype=bool)).all())
