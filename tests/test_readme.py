"""The README's library example runs as written and does what the README says."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from subproc import xla_flags

README = pathlib.Path(__file__).parents[1] / "README.md"
pytestmark = pytest.mark.program


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_library_example_trains_in_fp16_on_several_devices(tmp_path):
    example = next(block for block in _python_blocks() if "p_train_step" in block)
    script = tmp_path / "example.py"
    script.write_text(example)
    env = dict(os.environ, XLA_FLAGS=xla_flags(4))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(
        r"loss ([\d.]+)  accuracy ([\d.]+)  loss scale (\d+)  skipped steps (\d+)", out.stdout
    )
    assert match, out.stdout
    loss, accuracy, scale, skipped = map(float, match.groups())
    assert accuracy >= 0.95 and loss < 0.2
    # 100 finite steps: no skip, and no growth before the 2000-step interval.
    assert skipped == 0 and scale == 2**16


def test_readme_fp8_example_trains_with_a_delayed_scaling_state(tmp_path):
    example = next(block for block in _python_blocks() if "fp8.init_state" in block)
    script = tmp_path / "fp8_example.py"
    script.write_text(example)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(
        r"loss ([\d.]+)  fp8 sites (\d+)  x amax ([\d.]+)  x scale ([\d.]+)", out.stdout
    )
    assert match, out.stdout
    loss, sites, amax, scale = map(float, match.groups())
    assert loss < 0.05 and sites == 2  # two hidden layers; the head is bf16
    assert abs(scale - 448 / amax) / scale < 0.5  # the history's max is near this step's amax


def _run_block(tmp_path, marker, devices=None):
    example = next(block for block in _python_blocks() if marker in block)
    script = tmp_path / "example.py"
    script.write_text(example)
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices)) if devices else None
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_readme_nnx_example_trains_in_fp16_under_pmap_and_the_sharded_step(tmp_path):
    stdout = _run_block(tmp_path, "jamp.nnx.split", devices=4)
    match = re.search(
        r"pmap loss ([\d.]+)  sharded loss ([\d.]+)  eval accuracy ([\d.]+)  loss scale (\d+)",
        stdout,
    )
    assert match, stdout
    pmap_loss, sharded_loss, accuracy, scale = map(float, match.groups())
    assert pmap_loss < 0.2 and sharded_loss < 0.2 and accuracy >= 0.95
    assert scale == 2**16  # fp16: no overflow in 60 steps, no growth before 2000


def test_readme_autocast_example_trains_an_equinox_model_and_keeps_the_head_fp32(tmp_path):
    stdout = _run_block(tmp_path, "eqx.nn.MLP")
    match = re.search(r"loss ([\d.]+)  matmul operands (.*)", stdout)
    assert match, stdout
    assert float(match.group(1)) < 0.1
    assert match.group(2).split() == ["bfloat16", "float32"]  # the hidden layer, the head
