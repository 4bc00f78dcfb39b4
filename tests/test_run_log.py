"""jamp.train.run_log: the lines the training program prints about its policy."""

import pytest

import jamp
from jamp.train import run_log


@pytest.mark.parametrize("spec, params", [("bf16", "bfloat16"), ("bfloat16", "bfloat16")])
def test_bare_16_bit_dtype_policy_gets_one_line_naming_the_mixed_preset(spec, params):
    note = run_log.bare_dtype_note(spec, jamp.get_policy(spec))
    assert "\n" not in note and f"params in {params}" in note
    assert f"'mixed_{params}'" in note


@pytest.mark.parametrize("spec", ["mixed_bfloat16", "float32", "f32", "p=bf16,c=bf16,o=f32"])
def test_presets_float32_and_explicit_policies_get_no_note(spec):
    assert run_log.bare_dtype_note(spec, jamp.get_policy(spec)) == ""


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_window_leaves_compiles_and_hooks_out_of_its_time_and_keeps_run_totals(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(run_log.time, "perf_counter", clock)
    window = run_log.Window()
    window.leave_out(clock())  # before the first step: nothing to leave out of
    assert window.start is None
    window.restart()
    window.pending += ["m1", "m2"]
    clock.now += 3.0  # two steps
    since = clock()
    clock.now += 10.0  # a compilation or an evaluation
    window.leave_out(since)
    clock.now += 1.0
    assert window.close() == pytest.approx(4.0)
    assert (window.steps_timed, window.time_timed) == (2, pytest.approx(4.0))
    window.restart()
    assert window.pending == [] and window.wait == 0.0
    window.pending.append("m3")
    clock.now += 2.0
    window.close()
    assert (window.steps_timed, window.time_timed) == (3, pytest.approx(6.0))
