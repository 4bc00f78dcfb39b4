"""The engine's pass order (jamp.engine._core.PASSES): each pass declares the phase of an
equation's walk it acts at, the order is checked against the phases, and it is load-bearing where
the phases say it is."""

import itertools
import warnings

import jax
import jax.numpy as jnp
import pytest

import jamp
from jamp.engine import _attention_pass, _core, _passes, _recompute, _recompute_pass
from jamp.engine._interpreter import Pass, Phase
from jamp.models import get_model


def _pass(start):
    return start.__self__


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_passes_run_in_phase_order_with_one_evaluator():
    phases = [_pass(start).phase for start in _core.PASSES]
    assert phases == sorted(phases)
    assert phases.count(Phase.EVALUATE) == 1
    # Every pass the engine defines is registered, and declares its phase.
    registered = {_pass(start) for start in _core.PASSES}
    assert set(_subclasses(Pass)) == registered
    assert all(isinstance(p.phase, Phase) for p in registered)


def test_an_order_against_the_phases_is_refused():
    order = list(_core.PASSES)
    refused = 0
    for i, j in itertools.combinations(range(len(order)), 2):
        swapped = order.copy()
        swapped[i], swapped[j] = swapped[j], swapped[i]
        first, second = _pass(order[i]), _pass(order[j])
        if first.phase == second.phase:
            assert _core.in_phase_order(swapped) == tuple(swapped)  # free within a phase
            continue
        with pytest.raises(ValueError, match=r"engine pass \w+ \(\w+\) runs after \w+"):
            _core.in_phase_order(swapped)
        refused += 1
    assert refused == 18  # 21 pairs, of which three share a phase (those of the NOTE passes)
    with pytest.raises(ValueError, match="one engine pass evaluates each equation"):
        _core.in_phase_order([s for s in order if _pass(s) is not _passes.DtypeRules])


def _lm_gradient_jaxpr():
    model = get_model("transformer_lm", 64)
    x = jnp.ones((2, 16), jnp.int32)
    params = model.init(jax.random.key(0), x)

    def loss(p):
        return jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.RecognitionWarning)  # every recogniser holds
        return jax.make_jaxpr(jax.grad(jamp.autocast(loss, "mixed_bfloat16")))(params)


def test_the_phase_order_is_load_bearing(monkeypatch):
    """A GELU region recomputed in the backward and a fused attention in one program: both
    passes act on it; with the attention pass first (against the phases) the walk breaks."""
    monkeypatch.setattr(_recompute, "MIN_ELEMENTS", 16)
    text = str(_lm_gradient_jaxpr())
    assert "remat" in text or "checkpoint" in text  # the region was recomputed
    regions, fuse = _recompute_pass.RecomputeRegions.start, _attention_pass.FuseAttention.start
    assert _core.PASSES[:2] == (regions, fuse)
    monkeypatch.setattr(_core, "PASSES", (fuse, regions, *_core.PASSES[2:]))
    with pytest.raises(KeyError):  # the attention took an equation the region holds
        _lm_gradient_jaxpr()
