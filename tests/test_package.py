"""The package's face and layering: names resolve predictably, no private name crosses a module."""

import ast
import importlib
import importlib.util
import json
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import nuvec_mlx as nv

PACKAGE = Path(nv.__file__).parent
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
#: The public modules, and those of them whose ``__all__`` lists public names.
MODULE_FACES = ("nuvec_mlx.memory", "nuvec_mlx.policies", "nuvec_mlx.losses", "nuvec_mlx.chunking")
FACES = (
    "nuvec_mlx",
    "nuvec_mlx.planner",
    "nuvec_mlx.mlx_lm",
    "nuvec_mlx.memory",
    "nuvec_mlx.policies",
    "nuvec_mlx.chunking",
)
PUBLIC = [(face, name) for face in FACES for name in importlib.import_module(face).__all__]


def test_every_exported_name_exists_and_has_a_docstring():
    for name in nv.__all__:
        assert getattr(nv, name).__doc__, name


@pytest.mark.parametrize("face, name", PUBLIC, ids=[f"{f}.{n}" for f, n in PUBLIC])
def test_a_public_name_is_its_object_also_beside_a_module_of_that_name(face, name):
    """``nuvec_mlx.checkpoint``, ``nuvec_mlx.compile``, ``nuvec_mlx.planner.plan``: a public function whose
    module has its name is the function; the module is its home, and importing it changes nothing."""
    for info in pkgutil.walk_packages(nv.__path__, "nuvec_mlx."):  # every module imported: none rebinds a name
        importlib.import_module(info.name)
    package = importlib.import_module(face)
    public = getattr(package, name)
    if isinstance(public, types.ModuleType):  # nv.memory, nv.policies, nv.losses: a public module
        assert public.__name__ == f"{face}.{name}" and public.__name__ in MODULE_FACES, public.__name__
        return
    if not isinstance(public, (types.FunctionType, type)):  # a constant or an alias: DEFAULT_THROTTLE, Policy
        return
    home = sys.modules[public.__module__]
    assert public.__module__.startswith("nuvec_mlx.") and getattr(home, name) is public
    beside = f"{face}.{name}"
    if hasattr(package, "__path__") and importlib.util.find_spec(beside) is not None:
        module = importlib.import_module(beside)
        assert module is home and getattr(importlib.import_module(face), name) is public


def test_the_name_rule_covers_the_functions_that_share_a_name_with_their_module():
    packages = [(f, n) for f, n in PUBLIC if hasattr(importlib.import_module(f), "__path__")]
    shared = {f"{f}.{n}" for f, n in packages if importlib.util.find_spec(f"{f}.{n}")}
    assert {"nuvec_mlx.checkpoint", "nuvec_mlx.compile", "nuvec_mlx.planner.plan"} <= shared
    assert ("nuvec_mlx", "update") in PUBLIC and ("nuvec_mlx", "plan") in PUBLIC


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
    reached = [
        f"{n.value.id}.{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id in siblings
        and n.attr.startswith("_")
    ]
    assert not reached


#: Reads every process-wide setting of MLX a library could change, as JSON: the memory, cache and
#: wired limits (the two MLX has no getter for are read by setting them and putting them back), the
#: default device and its default stream, the random key, and the environment.
SETTINGS = """
import json, os, mlx.core as mx

def settings():
    cache = mx.set_cache_limit(0)
    mx.set_cache_limit(cache)
    wired = mx.set_wired_limit(0)
    mx.set_wired_limit(wired)
    device = mx.default_device()
    return {"memory limit": mx.get_memory_limit(), "cache limit": cache, "wired limit": wired,
            "device": str(device), "stream": str(mx.default_stream(device)),
            "random key": mx.random.state[0].tolist(), "environment": dict(os.environ)}
"""


@pytest.mark.parametrize("module", ["nuvec_mlx", pytest.param("nuvec_mlx.mlx_lm", marks=pytest.mark.slow)])
def test_importing_changes_no_process_wide_setting(module):
    code = f"{SETTINGS}\nbefore = settings()\nimport {module}\nprint(json.dumps([before, settings()]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = json.loads(out.stdout)
    assert after == before, f"importing {module} changed {[k for k in before if before[k] != after[k]]}"


def test_the_core_and_the_numeric_test_helpers_import_no_optional_dependency():
    """nuvec_mlx needs MLX and tqdm; mlx-lm, transformers and matplotlib are extras, and a core test
    (tests.helpers) needs none of them."""
    code = (
        "import sys, nuvec_mlx, tests.helpers; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx_lm', 'transformers', 'tokenizers', 'matplotlib'}))"
    )
    root = PACKAGE.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"
