"""The README's library example runs as written and does what the README says.

The other examples live in docs/ and run in tests/test_docs.py, which also finds this one (a
runnable block: `<!-- runnable -->` before its fence) and leaves it to this test.
"""

import re

import pytest
from test_docs import ROOT, blocks_with, run_block

README = ROOT / "README.md"
pytestmark = pytest.mark.program


def test_readme_library_example_trains_in_fp16_on_several_devices(tmp_path):
    [example] = blocks_with("p_train_step", [README])
    stdout = run_block(example, tmp_path, devices=4)
    match = re.search(
        r"loss ([\d.]+)  accuracy ([\d.]+)  loss scale (\d+)  skipped steps (\d+)", stdout
    )
    assert match, stdout
    loss, accuracy, scale, skipped = map(float, match.groups())
    assert accuracy >= 0.95 and loss < 0.2
    # 100 finite steps: no skip, and no growth before the 2000-step interval.
    assert skipped == 0 and scale == 2**16


def test_readme_example_is_the_getting_started_example():
    """Getting started shows the README's example; this test runs the README's copy only."""
    [readme] = blocks_with("p_train_step", [README])
    [docs] = blocks_with("p_train_step", [ROOT / "docs" / "getting_started.md"])
    assert readme.code == docs.code
