"""jamp's DynamicLossScale driven through jmp's and Flax's interfaces, step for step against them.

Each schedule runs the same finite/overflow sequence through the other library's own class and
through jamp's, built by the same constructor call (jmp) or by `DynamicLossScale.from_flax`
(Flax), and compares every field the other library exposes after every step.
"""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from flax.training.dynamic_scale import DynamicScale

import jamp
from jamp import DynamicLossScale, all_finite

FP32_MAX = float(np.finfo(np.float32).max)


def finite_flags(num_steps, period, seed, burst=6):
    """Finite runs of 0 to 3 periods (so the scale grows, and a run also ends just short of a
    period) between bursts of 1 to `burst` overflows (so the scale backs off to its bound)."""
    rng = np.random.default_rng(seed)
    flags = []
    while len(flags) < num_steps:
        flags += [True] * int(rng.integers(0, 3 * period + 1))
        flags += [False] * int(rng.integers(1, burst + 1))
    return np.array(flags[:num_steps])


def fields(ls):
    return {
        "loss_scale": float(ls.loss_scale),
        "counter": int(ls.counter),
        "period": int(ls.period),
        "factor": float(ls.factor),
        "min_loss_scale": float(ls.min_loss_scale),
    }


def drive_eagerly(ls, flags):
    """Every step's fields; jmp runs eagerly, since its pytree drops min_loss_scale (0.0.4)."""
    seen = []
    for finite in flags:
        ls = ls.adjust(jnp.asarray(finite))
        seen.append(fields(ls))
    return seen


# jmp's constructor calls, each as jmp code writes it (its docstring's, positional, keyword).
JMP_CALLS = {
    "docstring": lambda m: m.DynamicLossScale(jnp.asarray(2.0**15)),
    "period_factor": lambda m: m.DynamicLossScale(jnp.asarray(2.0**15), period=10, factor=2),
    "positional": lambda m: m.DynamicLossScale(
        jnp.float32(2.0**12), np.zeros([], np.int32), 5, 4, np.ones([], np.float32) * 16
    ),
    "keywords_factor_3": lambda m: m.DynamicLossScale(
        loss_scale=jnp.asarray(2.0**15),
        counter=jnp.asarray(3, jnp.int32),
        period=8,
        factor=3,
        min_loss_scale=jnp.asarray(2.0, jnp.float32),
    ),
}


@pytest.mark.parametrize("call", list(JMP_CALLS), ids=list(JMP_CALLS))
def test_jmp_constructor_calls_build_jmps_schedule_step_for_step(call):
    theirs, ours = JMP_CALLS[call](jmp), JMP_CALLS[call](jamp)
    assert fields(ours) == fields(theirs)
    period = theirs.period if theirs.period < 2000 else 20
    flags = finite_flags(400, period, seed=len(call))
    expected, got = drive_eagerly(theirs, flags), drive_eagerly(ours, flags)
    for t, (e, g) in enumerate(zip(expected, got)):
        assert g == e, f"step {t}: jmp {e}, jamp {g}"
    # The sequence did what it is for: growths, backoffs, and the lower bound reached.
    scales = np.array([e["loss_scale"] for e in expected])
    assert (np.diff(scales) < 0).sum() >= 10 and (scales == expected[0]["min_loss_scale"]).any()
    if call != "docstring":  # a 2000-step period grows in the scan test below
        assert (np.diff(scales) > 0).sum() >= 3


def test_jmp_default_period_schedule_under_scan_step_for_step():
    """jmp's documented schedule (2**15, period 2000, factor 2) over 9000 steps, in one scan."""
    flags = finite_flags(9000, 2000, seed=7, burst=3)

    def run(ls):
        def body(ls, finite):
            ls = ls.adjust(finite)
            return ls, (ls.loss_scale, ls.counter)

        return jax.lax.scan(body, ls, jnp.asarray(flags))[1]

    theirs = jax.jit(run)(jmp.DynamicLossScale(jnp.asarray(2.0**15)))
    ours = jax.jit(run)(DynamicLossScale(jnp.asarray(2.0**15)))
    np.testing.assert_array_equal(np.asarray(ours[0]), np.asarray(theirs[0]))
    np.testing.assert_array_equal(np.asarray(ours[1]), np.asarray(theirs[1]))
    assert (np.diff(np.asarray(theirs[0])) > 0).sum() >= 2  # it grew, at the 2000th step


def test_jmp_fields_read_back_and_state_restores():
    ls = DynamicLossScale(2.0**10, period=50, factor=4)
    assert (ls.period, ls.factor) == (50, 4.0)
    assert (ls.growth_interval, ls.growth_factor, ls.backoff_factor) == (50, 4.0, 0.25)
    # jmp's second positional argument is the counter: a step count to resume from.
    resumed = DynamicLossScale(2.0**10, jnp.int32(49), 50, 4)
    assert int(resumed.counter) == 49 and float(resumed.adjust(jnp.array(True)).loss_scale) == 2**12


def test_jmp_unbounded_growth_needs_max_loss_scale():
    """jmp has no upper bound; jamp stops at max_loss_scale (2**24 by default), and with
    fp32's largest number as the bound follows jmp past it."""
    flags = np.ones(60, bool)
    theirs = drive_eagerly(jmp.DynamicLossScale(jnp.asarray(2.0**15), period=2), flags)
    capped = drive_eagerly(DynamicLossScale(jnp.asarray(2.0**15), period=2), flags)
    unbounded = drive_eagerly(
        DynamicLossScale(jnp.asarray(2.0**15), period=2, max_loss_scale=FP32_MAX), flags
    )
    assert theirs[-1]["loss_scale"] == 2.0**45
    assert capped[-1]["loss_scale"] == 2.0**24
    assert unbounded == theirs
    # A jmp call starting above 2**24 is accepted: the default bound is then the initial scale.
    assert float(DynamicLossScale(jnp.asarray(2.0**30)).max_loss_scale) == 2.0**30


# Flax: DynamicScale(...) and the jamp scale from_flax makes of it.
FLAX_CASES = {
    "defaults_short_interval": dict(growth_interval=10),
    "factors": dict(growth_interval=4, growth_factor=4.0, backoff_factor=0.25, scale=2.0**12),
    "minimum": dict(growth_interval=6, minimum_scale=2.0**10, scale=2.0**14),
    "no_minimum": dict(growth_interval=3, minimum_scale=None, scale=8.0),
}


@pytest.mark.parametrize("case", list(FLAX_CASES), ids=list(FLAX_CASES))
def test_flax_dynamic_scale_maps_one_to_one_step_for_step(case):
    ds = DynamicScale(**FLAX_CASES[case])
    ls = DynamicLossScale.from_flax(ds)
    assert ls.growth_interval == ds.growth_interval + 1  # Flax grows one step later

    def loss_fn(p, finite):
        return jnp.sum(p**2) * jnp.where(finite, 1.0, jnp.inf)

    @jax.jit
    def flax_step(ds, p, finite):
        ds, is_finite, loss, grad = ds.value_and_grad(loss_fn)(p, finite)
        return ds, is_finite, loss, grad

    @jax.jit
    def jamp_step(ls, p, finite):
        loss, grad = jax.value_and_grad(lambda p: ls.scale(loss_fn(p, finite)))(p)
        grad = ls.unscale(grad)
        is_finite = all_finite(grad)
        return ls.adjust(is_finite), is_finite, ls.unscale(loss), grad

    p = jnp.array([0.5, -1.5, 3.0], jnp.float32)
    flags = finite_flags(300, ds.growth_interval + 1, seed=len(case), burst=8)
    grown = backed_off = 0
    for t, finite in enumerate(flags):
        before = float(ds.scale)
        ds, flax_finite, flax_loss, flax_grad = flax_step(ds, p, finite)
        ls, our_finite, our_loss, our_grad = jamp_step(ls, p, finite)
        where = f"step {t} ({'finite' if finite else 'overflow'})"
        assert bool(our_finite) == bool(flax_finite) == bool(finite), where
        assert float(ls.loss_scale) == float(ds.scale), where
        assert int(ls.counter) == int(ds.fin_steps), where
        if finite:
            np.testing.assert_array_equal(np.asarray(our_grad), np.asarray(flax_grad), where)
            assert float(our_loss) == float(flax_loss), where
        grown += float(ds.scale) > before
        backed_off += float(ds.scale) < before
    assert grown >= 3 and backed_off >= 10


@pytest.mark.parametrize("period", [5.0, np.int32(5), np.float64(5.0), jnp.asarray(5)])
def test_jmp_whole_number_periods_are_taken_as_jmp_takes_them(period):
    ls = DynamicLossScale(jnp.asarray(2.0**15), jnp.zeros((), jnp.int32), period, 2.0, 1.0)
    assert ls.period == 5 and isinstance(ls.growth_interval, int)
    theirs = jmp.DynamicLossScale(jnp.asarray(2.0**15), jnp.zeros((), jnp.int32), period, 2.0)
    flags = [True] * 12
    mine, jmps = drive_eagerly(ls, flags), drive_eagerly(theirs, flags)
    assert [m["loss_scale"] for m in mine] == [j["loss_scale"] for j in jmps]


@pytest.mark.parametrize("period", [5.5, 0.0, True, float("inf")])
def test_a_period_that_is_no_whole_number_gets_one_line(period):
    with pytest.raises(ValueError, match="growth_interval must be an int >= 1"):
        DynamicLossScale(jnp.asarray(2.0**15), period=period)


def test_jmp_min_loss_scale_zero_is_no_floor_that_never_reaches_zero():
    """jmp's tests pass `min_loss_scale=0.0` for "no floor" (it was refused: "need 0 <
    min_loss_scale"). jamp takes it: the same schedule as jmp's while jmp's scale is a normal
    number, then stops at fp32's smallest normal number, where jmp's goes on to 0 (and would
    zero every gradient)."""
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**15), min_loss_scale=jnp.float32(0.0))
    ours = jamp.DynamicLossScale(jnp.float32(2.0**15), min_loss_scale=0.0)
    assert ours.min_loss_scale == float(np.finfo(np.float32).tiny)
    flags = np.array([True] * 5 + [False] * 200)
    expected, got = drive_eagerly(theirs, flags), drive_eagerly(ours, flags)
    tiny = float(np.finfo(np.float32).tiny)
    for e, g in zip(expected, got):
        if e["loss_scale"] >= tiny:
            assert g["loss_scale"] == e["loss_scale"] and g["counter"] == e["counter"]
        else:
            assert g["loss_scale"] == tiny
    assert expected[-1]["loss_scale"] == 0.0 and got[-1]["loss_scale"] == tiny
    with pytest.raises(ValueError, match="min_loss_scale=0 means no floor"):
        jamp.DynamicLossScale(2.0**15, min_loss_scale=-1.0)
