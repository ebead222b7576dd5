"""The examples import only what exists: they run against the package as it is (running them takes
minutes, so the test reads their imports instead)."""

import ast
import importlib
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def imported_names(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for each ``from module import name``, (module, None) for each ``import module``."""
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            found += [(node.module, alias.name) for alias in node.names]
    return found


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_imports_names_that_exist(path):
    for module, name in imported_names(path):
        imported = importlib.import_module(module)
        if name is not None and not hasattr(imported, name):
            importlib.import_module(f"{module}.{name}")  # a submodule, or ModuleNotFoundError naming it
