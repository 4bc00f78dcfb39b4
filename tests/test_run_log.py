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
