"""The code style CI checks: ruff's lint and format, and mypy on the package (configured in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m tool args`` from the repository root, skipped where the tool is not installed."""
    pytest.importorskip(tool)
    return subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )


def test_the_code_passes_ruff_check():
    result = run("ruff", "check", ".")
    assert result.returncode == 0, f"ruff check .\n{result.stdout}{result.stderr}"


def test_the_code_is_ruff_formatted():
    result = run("ruff", "format", "--check", ".")
    assert result.returncode == 0, f"ruff format --check . (run ruff format . to fix)\n{result.stdout}{result.stderr}"


@pytest.mark.slow
def test_the_package_type_checks_with_mypy():
    result = run("mypy")
    assert result.returncode == 0, f"mypy (files from pyproject.toml)\n{result.stdout}{result.stderr}"
