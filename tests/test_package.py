"""The package's face and layering: names resolve predictably, no private name crosses a module."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import nuvec_mlx as nv

PACKAGE = Path(nv.__file__).parent
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def test_every_exported_name_exists_and_has_a_docstring():
    for name in nv.__all__:
        assert getattr(nv, name).__doc__, name


@pytest.mark.parametrize("name", ["checkpoint", "compile"])
def test_a_name_shared_by_a_function_and_its_module_is_the_function(name):
    module = sys.modules[f"nuvec_mlx.{name}"]
    function = getattr(nv, name)
    assert callable(function) and function.__module__ == module.__name__
    assert getattr(module, name) is function
    assert importlib.import_module(f"nuvec_mlx.{name}") is module
    alias = importlib.import_module("nuvec_mlx")
    assert getattr(alias, name) is function  # what `import nuvec_mlx.<name> as m` binds


def _imports(module: str) -> tuple[list[str], set[str]]:
    """Relative imports of private names, and the sibling modules ``module`` imports."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    private, siblings = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                if node.module is None:
                    siblings.add(alias.asname or alias.name)
                elif alias.name.startswith("_"):
                    private.append(f"from .{node.module} import {alias.name}")
    return private, siblings


@pytest.mark.parametrize("module", MODULES)
def test_no_private_name_is_imported_from_another_module(module):
    private, siblings = _imports(module)
    assert not private
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    reached = [f"{n.value.id}.{n.attr}" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id in siblings and n.attr.startswith("_")]
    assert not reached


def test_importing_changes_no_process_wide_setting():
    code = "import os; before = dict(os.environ); import nuvec_mlx; print(dict(os.environ) == before)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", "importing nuvec_mlx changed the environment"
