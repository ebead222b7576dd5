"""Shared fixtures and settings of the test suite.

Two loops:

- ``python -m pytest`` runs everything (CI, the README's command);
- ``python -m pytest -m "not slow"`` is the developer loop: it leaves out the tests marked ``slow``
  (over about 3 s each on a 2-core CPU: the seed test, the planner's and largest_fit's sweeps, the
  mlx-lm trainer against mlx_lm.lora), and runs in under two minutes there.
"""

import os

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, settings

import nuvec_mlx as nv

# Hypothesis profiles, chosen by HYPOTHESIS_PROFILE (default "ci"). "ci" runs
# 240 eager and 60 compiled graph examples in tests/test_properties.py, the
# same ones every run; "dev" runs 1500 + 375 fresh random ones.
settings.register_profile(
    "ci",
    max_examples=240,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def compiled():
    """Fail, rather than pass vacuously, where mx.compile would silently not compile."""
    step = nv.compile_flat(lambda xs: [xs[0] * 2 + 1])
    for _ in range(3):
        mx.eval(step([mx.ones((4,))]))
    assert step.traces == 1, (
        "mx.compile retraced on every call: it is not compiling here (on Linux CPU, g++ must be on PATH)"
    )
    return True


@pytest.fixture
def eager():
    """mx.compile off for the test: steps run uncompiled, with no g++ kernel builds (about 30 s
    per architecture on a cold kernel cache), where what is checked does not depend on compiling."""
    mx.disable_compile()
    yield
    mx.enable_compile()


@pytest.fixture
def unloaded(monkeypatch):
    """Loading a model fails the test: what the commands check must be said before anything is loaded."""
    from mlx_lm import lora, utils

    def fails(*args, **kwargs):
        raise AssertionError("the model was loaded before the command said what was wrong")

    monkeypatch.setattr(lora, "load", fails)  # mlx_lm.lora's run (nuvec-mlx-lora)
    monkeypatch.setattr(utils, "load", fails)  # nuvec-mlx-plan's
