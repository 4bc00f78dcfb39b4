"""The documentation site builds without a warning, and every example it marks runnable runs.

A Python block of README.md or docs/**/*.md is runnable when the line right before its
```` ```python ```` fence is the MyST comment `% runnable` (MyST leaves `%` lines out of the page)
or, in README.md, which a code host renders as plain Markdown, the HTML comment
`<!-- runnable -->`. Each runs as a script in a fresh interpreter. Blocks whose output the tests
check further are claimed by a test of their own (`CLAIMED`) and run there, once.
"""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest
from subproc import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
pytestmark = pytest.mark.program

RUNNABLE = ("% runnable", "<!-- runnable -->")
# A marker string of each block that a test below (or tests/test_readme.py) runs and checks.
CLAIMED = ("p_train_step", "fp8.init_state", "jamp.nnx.split", "eqx.nn.MLP")


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # of the ```python fence, 1-based
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[pathlib.Path]:
    pages = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
    return [ROOT / "README.md", *pages]


def runnable_blocks(paths=None) -> list[Block]:
    """Every runnable Python block of `paths` (README.md and the docs' pages by default)."""
    blocks = []
    for path in paths or markdown_files():
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python" and i and lines[i - 1].strip() in RUNNABLE:
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                blocks.append(Block(path, i + 1, "\n".join(lines[i + 1 : end]) + "\n"))
                i = end
            i += 1
    return blocks


def blocks_with(marker: str, paths=None) -> list[Block]:
    """The runnable blocks that contain `marker`, one per distinct code (copies run once)."""
    found: dict[str, Block] = {}
    for block in runnable_blocks(paths):
        if marker in block.code:
            found.setdefault(block.code, block)
    assert found, f"no runnable block contains {marker!r}"
    return list(found.values())


def run_block(block: Block, tmp_path, devices=None) -> str:
    """Runs the block as a script; its stdout. `devices`: simulated CPU devices (XLA_FLAGS)."""
    script = tmp_path / "example.py"
    script.write_text(block.code)
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices)) if devices else None
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, f"{block.id} failed:\n{out.stderr[-3000:]}"
    return out.stdout


def test_docs_site_builds_with_no_warning(tmp_path):
    html = tmp_path / "html"
    build = ["-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(html)]
    out = subprocess.run(
        [sys.executable, *build],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-6000:]
    assert "WARNING" not in output and "ERROR" not in output, output[-6000:]
    # The benchmark plots render: the results page shows every plot experiments/results holds.
    results = (html / "results.html").read_text()
    for png in sorted((ROOT / "experiments" / "results").glob("*.png")):
        assert re.search(rf'<img [^>]*src="_images/{re.escape(png.name)}"', results), png.name
        assert (html / "_images" / png.name).is_file(), png.name
    # The API reference is generated from the docstrings: an entry for every public name.
    import jamp

    api = (html / "api" / "jamp.html").read_text()
    modules = {"adaptive", "fp8", "hardware", "losses", "lowbit", "nnx", "parallel", "rounding"}
    modules |= {"sharding", "target"}
    for name in sorted(set(jamp.__all__) - modules):
        assert f'id="jamp.{name}"' in api, name
    for module in sorted(modules):
        assert 'id="module-jamp.' + module + '"' in (html / "api" / f"{module}.html").read_text()


def test_docs_every_runnable_block_is_found():
    blocks = runnable_blocks()
    assert len({b.code for b in blocks}) >= 7, [b.id for b in blocks]
    for marker in CLAIMED:
        assert blocks_with(marker)


_UNCLAIMED = {}
for _block in runnable_blocks():
    if not any(marker in _block.code for marker in CLAIMED):
        _UNCLAIMED.setdefault(_block.code, _block)


@pytest.mark.parametrize("block", list(_UNCLAIMED.values()), ids=lambda b: b.id)
def test_docs_runnable_block_runs(block, tmp_path):
    run_block(block, tmp_path, devices=4)


def test_docs_fp8_example_trains_with_a_delayed_scaling_state(tmp_path):
    for block in blocks_with("fp8.init_state"):
        stdout = run_block(block, tmp_path)
        match = re.search(
            r"loss ([\d.]+)  fp8 sites (\d+)  x amax ([\d.]+)  x scale ([\d.]+)", stdout
        )
        assert match, stdout
        loss, sites, amax, scale = map(float, match.groups())
        assert loss < 0.05 and sites == 2  # two hidden layers; the head is bf16
        assert abs(scale - 448 / amax) / scale < 0.5  # the history's max is near this step's amax


def test_docs_nnx_example_trains_in_fp16_under_pmap_and_the_sharded_step(tmp_path):
    for block in blocks_with("jamp.nnx.split"):
        stdout = run_block(block, tmp_path, devices=4)
        match = re.search(
            r"pmap loss ([\d.]+)  sharded loss ([\d.]+)  eval accuracy ([\d.]+)  loss scale (\d+)",
            stdout,
        )
        assert match, stdout
        pmap_loss, sharded_loss, accuracy, scale = map(float, match.groups())
        assert pmap_loss < 0.2 and sharded_loss < 0.2 and accuracy >= 0.95
        assert scale == 2**16  # fp16: no overflow in 60 steps, no growth before 2000


def test_docs_autocast_example_trains_an_equinox_model_and_keeps_the_head_fp32(tmp_path):
    for block in blocks_with("eqx.nn.MLP"):
        stdout = run_block(block, tmp_path)
        match = re.search(r"loss ([\d.]+)  matmul operands (.*)", stdout)
        assert match, stdout
        assert float(match.group(1)) < 0.1
        assert match.group(2).split() == ["bfloat16", "float32"]  # the hidden layer, the head


def test_docs_equinox_example_trains_autocast_outside_the_loss_as_fp32_does(tmp_path):
    (block,) = blocks_with("eqx.nn.make_with_state")
    stdout = run_block(block, tmp_path)
    match = re.search(r"fp32 loss ([\d.]+)  bf16 loss ([\d.]+)  weights (\w+)", stdout)
    assert match, stdout
    fp32, bf16 = float(match.group(1)), float(match.group(2))
    assert fp32 < 0.3 and abs(bf16 - fp32) < 0.1 and match.group(3) == "float32"
