"""`python -m jamp.train --compile_for=<target>`: a recipe's step compiled for GPUs, reported.

The runs compile for an H200 target on this CPU (JAX's CUDA plugin, no GPU); they skip, saying
so, where the plugin is absent. The batch search is checked on its own against known peaks.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from jamp.train import plan

GIB = 1 << 30


def _affine(fixed, per_example, wobble=0):
    calls = []

    def peak(batch):
        calls.append(batch)
        return int(fixed + per_example * batch + wobble * (batch % 7))

    return peak, calls


def test_search_batch_finds_the_largest_fitting_multiple_within_its_resolution():
    peak, calls = _affine(5e9, 1.3e7, wobble=1e6)
    usable = 105 * GIB  # true answer: (usable - 5e9) / 1.3e7 = 8288.x
    found = plan.search_batch(peak, 8, 8, usable, known={8: peak(8)})
    assert found.complete and found.batch % 8 == 0 and found.above % 8 == 0
    assert found.batch <= 8288 < found.above and found.above - found.batch <= found.batch // 32
    assert peak(found.batch) <= usable < peak(found.above)
    assert len(calls) <= 7  # the known start and at most 6 compiles


def test_search_batch_from_above_and_when_nothing_fits():
    peak, _ = _affine(5e9, 1.3e7)
    found = plan.search_batch(peak, 20000, 8, 105 * GIB)
    assert found.complete and found.batch <= 8288 < found.above
    nothing = plan.search_batch(lambda b: 200 * GIB, 8, 8, 105 * GIB)
    assert nothing.batch is None and nothing.above == 8 and nothing.complete


def test_search_batch_stops_at_its_compile_budget_and_says_so():
    peak, calls = _affine(1e9, 1e3)  # a tiny model: millions of examples would fit
    found = plan.search_batch(peak, 8, 8, 105 * GIB, max_compiles=3, known={8: peak(8)})
    assert not found.complete and found.above is None and len(calls) == 4
    line = plan._search_line(found, 105 * GIB, 0.75)
    assert "or more: the search stopped" in line and f"{found.batch}" in line


def _run(args, tmp_path, **env):
    environ = dict(os.environ, TFDS_DATA_DIR=str(tmp_path / "data"), **env)
    return subprocess.run(
        [sys.executable, "-m", "jamp.train", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environ,
        timeout=900,
    )


@pytest.mark.program
def test_compile_for_a_bad_target_is_one_line(tmp_path):
    out = _run(["--config=lm_pydoc:smoke", "--compile_for=a100"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: --compile_for: unknown target 'a100'; targets: h100, h200, b200, each with xN "
        "for N GPUs in a host (h200x8) and Mx in front for M hosts (2x h200x8)"
    ]
    assert not (tmp_path / "runs").exists()


@pytest.mark.program
@pytest.mark.gpu_compile
def test_compile_for_a_batch_that_does_not_split_over_the_target_is_one_line(tmp_path):
    out = _run(["--config=lm_pydoc:smoke", "--compile_for=h200x3"], tmp_path)  # batch 8 over 3
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: batch_size 8 does not divide evenly over the h200x3 step's 3 batch devices x 1 "
        "accumulation steps: use a multiple of 3"
    ]


@pytest.mark.program
@pytest.mark.gpu_compile
def test_compile_for_reports_a_sharded_recipe_on_8_h200s_and_searches_its_batch(tmp_path):
    """The smoke LM on 8 H200s (data=2, fsdp=4), without reading data; JAX's pool set so small
    (~0.29 MiB) that its batch of 8 fits and 16 (the next multiple of 8 devices) does not."""
    out = _run(
        [
            "--config=lm_pydoc:smoke",
            "--compile_for=h200x8",
            "--config.parallelism=sharded",
            "--config.mesh=data=2,fsdp=4",
            f"--workdir={tmp_path / 'plan'}",
        ],
        tmp_path,
        XLA_PYTHON_CLIENT_MEM_FRACTION="2.0165e-6",
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "sharded jit, mesh data=2, fsdp=4, global batch 8" in text
    assert "compiled for h200x8 (8 x NVIDIA H200" in text and "mesh data=2, fsdp=4" in text
    assert "activations: compute (16-bit between matmuls)" in text
    assert "float32 GEMMs: none" in text
    assert "all-gather         bf16      over fsdp" in text
    report = json.loads((tmp_path / "plan" / "compile_for_h200x8.json").read_text())
    assert report["mesh"] == {"data": 2, "fsdp": 4} and report["fp32_gemms"] == []
    assert report["memory"]["peak"] > 0 and report["fits"] is True
    # The search, in multiples of the 8 devices the batch is split over: the batch it names fits
    # the pool, the next one it compiled does not (XLA's plan decides which they are: with this
    # pool, 8 and 16 when written).
    (found,) = [ln for ln in text.splitlines() if ln.startswith(("largest global", "no global"))]
    assert found.startswith("largest global batch that fits in 0.29 MiB"), found
    batch, above = (int(x) for x in re.search(r": (\d+) \((\d+) does not\)", found).groups())
    peaks = {int(b): float(p) for b, p in re.findall(r"(\d+): ([\d.]+) MiB", found)}
    usable = float(re.search(r"fits in ([\d.]+) MiB", found).group(1))
    assert batch % 8 == 0 and above % 8 == 0 and set(peaks) >= {batch, above}
    assert peaks[batch] <= usable < peaks[above]
    # Nothing read: the data directory was never even created. No traceback, no warning of
    # jamp's (XLA's own C++ log lines, "W1202 ...", would be allowed).
    assert not (tmp_path / "data").exists()
    assert not [ln for ln in out.stderr.splitlines() if not re.match(r"^[IWE]\d{4} ", ln)]
