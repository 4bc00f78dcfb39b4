"""jmp's own test suites, run against jamp: the loss scales (jmp/_src/loss_scale_test.py, with
jamp's NoOpLossScale, StaticLossScale, DynamicLossScale, all_finite and select_tree in place of
jmp's) and the policies (jmp/_src/policy_test.py, with jamp.get_policy; `Policy`, `half_dtype`,
`cast_to_full` / `cast_to_half` are jmp's own, which jamp uses). Both ship in jmp's wheel.

Every test passes except those listed in DIFFERENT, each a documented deliberate difference
(docs/migration/jmp.md, "Where jamp differs, on purpose"); a new failure, or a listed test
that starts passing, fails here.
"""

import types
import unittest

import pytest

import jamp

lst = pytest.importorskip("jmp._src.loss_scale_test")
pt = pytest.importorskip("jmp._src.policy_test")

_CASE = "jmp._src.loss_scale_test.LossScaleTest."
DIFFERENT = {
    # The scale is float32 whatever it is given: an int scale or bound is converted, not warned.
    _CASE + "test_dynamic_loss_scale_raises_type_error_on_int_loss_scale": "the scale is fp32",
    _CASE + "test_dynamic_loss_scale_raises_type_error_on_int_min_loss_scale": "the scale is fp32",
    # Three leaves: hysteresis_left beside loss_scale and counter.
    _CASE + "test_dynamic_loss_scale_tree": "one more leaf",
    # StaticLossScale(0) is an error saying what is accepted (min_loss_scale=0 is jmp's "no
    # floor" and is accepted: the scale stops at float32's smallest normal instead).
    _CASE + "test_static_empty_trees_StaticLossScale": "bad settings are errors",
    # A non-scalar predicate is a ValueError saying what select_tree takes, not an assert.
    _CASE + "test_select_tree_rejects_non_scalar": "bad settings are errors",
}


def _run(case) -> set[str]:
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromTestCase(case).run(result)
    assert result.testsRun > 10
    return {test.id() for test, _ in result.failures + result.errors}


def test_jmps_loss_scale_tests_pass_on_jamps_loss_scales_but_the_documented_differences(
    monkeypatch,
):
    names = ("NoOpLossScale", "StaticLossScale", "DynamicLossScale", "all_finite", "select_tree")
    monkeypatch.setattr(lst, "jmp", types.SimpleNamespace(**{n: getattr(jamp, n) for n in names}))
    assert _run(lst.LossScaleTest) == set(DIFFERENT)


def test_jmps_policy_tests_pass_with_jamps_get_policy(monkeypatch):
    shim = types.SimpleNamespace(**vars(pt.jmp))
    shim.get_policy = jamp.get_policy
    monkeypatch.setattr(pt, "jmp", shim)
    assert _run(pt.PolicyTest) == set()


def test_the_differences_are_the_migration_guides():
    import pathlib

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "migration" / "jmp.md"
    text = guide.read_text().lower()
    for reason in set(DIFFERENT.values()):
        assert reason in text, reason
