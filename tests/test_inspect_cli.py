"""End-to-end tests of `python -m jamp.inspect`: the real command line, in a subprocess, offline."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from subproc import cli_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.program


def _inspect(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "jamp.inspect", *args],
        cwd=ROOT,
        env=cli_env(1),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


def test_inspect_cli_default_recipe_prints_report_and_ranges_and_writes_the_workdir(
    tmp_path, data_dir
):
    workdir = tmp_path / "inspect"
    out = _inspect(f"--config.data_dir={data_dir}", f"--workdir={workdir}")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "seed_cnn on digits" in text and "compute=float16" in text
    assert "precision report: compute float16" in text
    for module in ("Conv_0", "Conv_1", "Dense_0", "Dense_1"):
        assert f"\n{module} " in text
    assert "float16 ranges" in text and "loss scale S = 65536" in text
    assert (workdir / "ranges.png").read_bytes()[:4] == b"\x89PNG"
    assert "Conv_0" in (workdir / "precision_report.txt").read_text()
    assert "headroom" in (workdir / "ranges.txt").read_text()


def test_inspect_cli_lm_pydoc_under_a_policy_override_is_all_16bit_matmuls(data_dir):
    out = _inspect(
        "--config=configs/lm_pydoc.py",
        "--config.policy=mixed_float16",
        f"--config.data_dir={data_dir}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "transformer_lm on pydoc" in out.stdout and "compute float16" in out.stdout
    assert "100.0% with 16-bit operands" in out.stdout
    assert "DecoderBlock_1/MultiHeadDotProductAttention_0/query" in out.stdout
    assert "normalization" in out.stdout  # the LayerNorms' rule


def test_inspect_cli_bad_policy_is_one_line_and_exit_status_2(data_dir):
    out = _inspect("--config.policy=mixed_bfloat17", f"--config.data_dir={data_dir}")
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "mixed_bfloat17" in lines[0]
    assert "Traceback" not in out.stderr and not out.stdout


def test_inspect_cli_nnx_recipe_reports_precision_by_module(data_dir):
    out = _inspect("--config=configs/digits_nnx.py", f"--config.data_dir={data_dir}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "seed_cnn_nnx on digits" in out.stdout
    assert "100.0% with 16-bit operands" in out.stdout
    # One row per submodule and pass, by the attribute names of the NNX model (SeedCNN).
    rows = {tuple(line.split()[:2]) for line in out.stdout.splitlines() if line[:1].isalpha()}
    for module in ("conv1", "conv2", "dense1", "dense2"):
        assert {(module, "fwd"), (module, "bwd")} <= rows, out.stdout
    # The fp16 range table of a real batch, by the same paths (jamp.nnx.capturing_outputs).
    ranges = out.stdout.split("float16 ranges", 1)[1]
    rows = [line.split()[0] for line in ranges.splitlines()[3:8]]
    assert rows == ["(root)", "conv1", "conv2", "dense1", "dense2"], ranges
    assert "no overflow" in ranges
