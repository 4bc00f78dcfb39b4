"""Masks known by their form (`jamp.engine._attention_forms`), read by `Scope.symbolic`.

Each program is read with the largest constant evaluated whole cut to 4 elements, so that its
mask is known only by its form, as a long sequence's is; the form, spelled out on the grid, must
agree with the values the program computes wherever it says it knows them (for data of every
kind: all True, all False, random), and the masks built as models build them must have one.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp.engine import _attention_forms as F
from jamp.engine import _attention_scope
from jamp.engine._attention_scope import Scope

T, S = 6, 9
POS_Q, POS_K = (lambda: jnp.arange(T)), (lambda: jnp.arange(S))
MIN = jnp.finfo(jnp.float32).min


def _causal():  # top-left aligned: query i sees keys up to i
    return POS_Q()[:, None] >= POS_K()[None, :]


def _hf_bias(d, shift=2):
    """Hugging Face's Flax GPT-2: a causal mask sliced from a longer one (from row `shift`, a
    cache's index), combined with the attention mask it is given (data), made a bias of 0 and
    the most negative float."""
    long = nn.make_causal_mask(jnp.ones((1, S + 3), bool), dtype=bool)
    causal = jax.lax.dynamic_slice(long, (0, 0, shift, 0), (1, 1, T, S))[0, 0]
    mask = nn.combine_masks(d, causal)
    return jax.lax.select(mask > 0, jnp.zeros((T, S)), jnp.full((T, S), MIN))


# name -> (function of a data mask d: bool[T, S], whether a form must be found)
PROGRAMS = {
    "tril": (lambda d: jnp.tril(jnp.ones((T, S), bool)), True),
    "tril k=1": (lambda d: jnp.tril(jnp.ones((T, S), bool), k=1), True),
    "tril k=-1": (lambda d: jnp.tril(jnp.ones((T, S), bool), k=-1), True),
    "triu": (lambda d: jnp.triu(jnp.ones((T, S), bool)), True),
    "linen make_causal_mask": (
        lambda d: nn.make_causal_mask(jnp.ones((2, S)))[0, 0, :T].astype(bool),
        True,
    ),
    "ge": (lambda d: _causal(), True),
    "gt": (lambda d: POS_Q()[:, None] > POS_K()[None, :], True),
    "le": (lambda d: POS_Q()[:, None] <= POS_K()[None, :], True),
    "lt, float positions": (
        lambda d: POS_Q().astype(jnp.float32)[:, None] < POS_K().astype(jnp.float32)[None, :],
        True,
    ),
    "bottom-right (a cache's offset)": (
        lambda d: POS_Q()[:, None] + (S - T) >= POS_K()[None, :],
        True,
    ),
    "transposed": (lambda d: (POS_K()[:, None] >= POS_Q()[None, :]).T, True),
    "as float, != 0": (lambda d: _causal().astype(jnp.float32) != 0, True),
    "not": (lambda d: jnp.logical_not(_causal()), True),
    "strided slice": (
        lambda d: (jnp.arange(2 * T + 1)[:, None] >= POS_K()[None, :])[1::2],
        True,
    ),
    "dynamic slice past the end (clamped)": (
        lambda d: jax.lax.dynamic_slice(
            nn.make_causal_mask(jnp.ones((1, S + 3)), dtype=bool), (0, 0, 100, 0), (1, 1, T, S)
        ),
        True,
    ),
    "where(causal, 0, min)": (lambda d: jnp.where(_causal(), 0.0, MIN), True),
    "and data": (lambda d: jnp.logical_and(d, _causal()), True),
    "or data": (lambda d: jnp.logical_or(d, _causal()), True),
    "where(causal, data, False)": (lambda d: jnp.where(_causal(), d, False), True),
    "Hugging Face's bias": (_hf_bias, True),
    "a sliding window (two half-planes)": (
        lambda d: _causal() & (POS_Q()[:, None] - POS_K()[None, :] < 3),
        True,
    ),
    "data in a sliding window": (
        lambda d: d & _causal() & (POS_Q()[:, None] - POS_K()[None, :] <= 2),
        True,
    ),
    "jax.nn's window mask (constant positions)": (
        lambda d: (jnp.array(range(T))[:, None] <= jnp.array(range(S))[None, :] + 2) & _causal(),
        True,
    ),
    "data or a sliding window": (
        lambda d: d | (_causal() & (POS_Q()[:, None] - POS_K()[None, :] < 3)),
        True,
    ),
    # No form here carries these: read as unknown, never wrongly.
    "a union of two regions": (
        lambda d: _causal() | (POS_Q()[:, None] + 2 < POS_K()[None, :]),
        False,
    ),
    "eq": (lambda d: POS_Q()[:, None] == POS_K()[None, :], False),
    "positions scaled by 0.5": (
        lambda d: POS_Q()[:, None] * 0.5 >= POS_K()[None, :] * 0.5,
        False,
    ),
    "an iota in bfloat16 past its exact integers": (
        lambda d: (
            jax.lax.broadcasted_iota(jnp.bfloat16, (300, 300), 0)
            >= jax.lax.broadcasted_iota(jnp.bfloat16, (300, 300), 1)
        ),
        False,
    ),
    "positions in bfloat16 past its exact integers": (
        lambda d: (
            jnp.arange(300).astype(jnp.bfloat16)[:, None]
            >= jnp.arange(300).astype(jnp.bfloat16)[None, :]
        ),
        False,
    ),
}


def _spelled_out(form, shape):
    """(values, known) of a form over `shape`."""
    if isinstance(form, F.Split):
        where = np.ones(shape, bool)
        for h in form.region:
            where &= sum(c * i for c, i in zip(h.coef, np.indices(shape))) + h.offset >= 0
        known = np.where(where, form.yes is not F.UNKNOWN, form.no is not F.UNKNOWN)
        fill = lambda v: np.zeros(()) if v is F.UNKNOWN else v  # noqa: E731
        return np.where(where, fill(form.yes), fill(form.no)), known
    if isinstance(form, F.Affine):
        return sum(c * i for c, i in zip(form.coef, np.indices(shape))) + form.offset, True
    if form is F.UNKNOWN or form is None:
        return np.zeros(shape), np.zeros(shape, bool)
    return np.broadcast_to(form, shape), np.ones(shape, bool)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_form_agrees_with_the_values_wherever_it_says_it_knows_them(name, monkeypatch):
    monkeypatch.setattr(_attention_scope, "_MAX_CONCRETE", 4)  # every mask known by its form
    fn, has_form = PROGRAMS[name]
    data = jax.ShapeDtypeStruct((T, S), jnp.bool_)
    closed = jax.make_jaxpr(fn)(data)
    (out,) = closed.jaxpr.outvars
    form = Scope(closed.jaxpr, closed.consts).symbolic(out)
    assert isinstance(form, F.Split) == has_form, form
    values, known = _spelled_out(form, out.aval.shape)
    rng = np.random.default_rng(0)
    for d in (np.ones((T, S), bool), np.zeros((T, S), bool), rng.random((T, S)) < 0.5):
        got = np.asarray(fn(jnp.asarray(d)))
        np.testing.assert_array_equal(np.where(known, values, 0), np.where(known, got, 0))


def test_which_regions_are_causal_and_which_have_a_window():
    t, s = 1, 2  # over [B, T, S]
    lower = F.half_plane(F.Affine((0, 3, -3), 2), False)  # 3 i - 3 j + 2 >= 0: i >= j
    assert lower == F.lower(3, t, s) and F.causal_window((lower,), t, s) == (True, None)
    assert F.causal_window((lower,), s, t) is None  # queries and keys the other way round
    upper = F.half_plane(F.Affine((0, -1, 1), 0), True)  # j > i
    assert upper == F.negated(lower) and F.causal_window((upper,), t, s) is None
    window = F.half_plane(F.Affine((0, -1, 1), 4), False)  # j >= i - 4
    region = F.region_split([(lower, True), (window, True)], True, False).region
    assert F.causal_window(region, t, s) == (True, 4)
    assert F.causal_window((window,), t, s) is None  # a window alone is no mask type
    shifted = F.half_plane(F.Affine((0, 1, -1), 1), False)  # i + 1 >= j: one key further
    assert F.causal_window((shifted,), t, s) is None
    assert F.half_plane(F.Affine((0, 0, 0), 5), False) is None  # constant: no predicate
    # What hides at least what causal hides: outside the causal region, or the keys after.
    assert F.covers_upper((lower,), False, True, t, s)
    assert F.covers_upper(region, False, True, t, s)  # outside causal and window
    assert F.covers_upper((upper,), True, False, t, s)
    assert not F.covers_upper((lower,), True, False, t, s)
    assert not F.covers_upper((window,), False, True, t, s)


def test_the_few_values_a_bias_of_data_can_take():
    """`Scope.values`: Hugging Face's bias is 0 or the most negative float whatever the
    attention mask it is given (so it is that mask); a bias computed from the data is not."""

    def values(fn, *args):
        closed = jax.make_jaxpr(fn)(*args)
        return Scope(closed.jaxpr, closed.consts).values(closed.jaxpr.outvars[0])

    data = jax.ShapeDtypeStruct((T, S), jnp.bool_)
    np.testing.assert_array_equal(values(_hf_bias, data), np.array([MIN, 0.0], np.float32))
    shifted = values(lambda d: jnp.where(d, 1.0, -2.0).astype(jnp.bfloat16) * 3, data)
    np.testing.assert_array_equal(shifted.astype(np.float32), [-6.0, 3.0])
    assert values(lambda d: d.astype(jnp.float32) * jnp.arange(S), data) is None
    assert (
        values(lambda x: jnp.where(x > 0, x, MIN), jax.ShapeDtypeStruct((T, S), jnp.float32))
        is None
    )
