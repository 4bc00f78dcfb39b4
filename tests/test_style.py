"""The checkout's style and types, as CI checks them: ruff's lint and format, and mypy on jamp/.

Each tool runs as a process from the repository root with its configuration in pyproject.toml
([tool.ruff], [tool.mypy]); a failure shows the tool's own report.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.program


def _run(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    report = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, f"python -m {' '.join(args)} exited {done.returncode}:\n{report}"


def test_ruff_check_passes():
    _run("ruff", "check", ".")


def test_ruff_format_check_passes():
    _run("ruff", "format", "--check", ".")


def test_mypy_passes():
    _run("mypy")  # files and settings: pyproject.toml's [tool.mypy]
