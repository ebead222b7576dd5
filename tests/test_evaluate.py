import math

import mlx.core as mx
import pytest

import nuvec_mlx as nv
from tests.helpers import assert_close, assert_evaluated, lazy_arrays

MiB = 1 << 20


@pytest.mark.parametrize("budget", [None, 0, math.inf], ids=["default", "0", "inf"])
def test_eval_computes_every_array_of_nested_containers_and_several_arguments(budget):
    x, y, z, w = lazy_arrays(MiB, 4)
    before = mx.get_active_memory()
    nv.eval(x, [y, {"z": (z,)}], {"w": w, "note": "text", "none": None}, budget=budget)
    assert_evaluated(before, 4 * MiB)
    assert_close(w, mx.full((MiB // 4,), 5.0))


def test_eval_takes_what_mx_eval_takes():
    import mlx.nn as nn

    layer = nn.Linear(4, 4)
    (layer.weight,) = lazy_arrays(MiB)
    mx.random.uniform(shape=(2,))  # the random state now holds an unevaluated key
    before = mx.get_active_memory()
    nv.eval(layer.state, mx.random.state, 3.0, None, "s", [1, (2,)], budget=0)
    nv.eval()
    assert_evaluated(before, MiB)


@pytest.mark.parametrize("budget", [0, MiB, math.inf])
def test_eval_restores_the_memory_limit(budget):
    before = mx.get_memory_limit()
    nv.eval([mx.ones((MiB,)) * 3], budget=budget)
    assert mx.get_memory_limit() == before


def test_eval_restores_the_memory_limit_when_evaluation_raises(monkeypatch):
    before = mx.get_memory_limit()
    seen = []

    def failing_eval(*args):
        seen.append(mx.get_memory_limit())
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(mx, "eval", failing_eval)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        nv.eval(mx.ones((4,)), budget=MiB)
    assert seen and seen[0] < before  # the throttle was on ...
    assert mx.get_memory_limit() == before  # ... and is off again


def test_eval_never_loosens_a_tighter_user_limit(monkeypatch):
    seen = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (seen.append(mx.get_memory_limit()), real_eval(*a)))
    tight = mx.get_active_memory() + 100 * MiB
    previous = mx.set_memory_limit(tight)
    try:
        nv.eval(mx.ones((4,)), budget=10**15)
        assert seen == [tight]
    finally:
        mx.set_memory_limit(previous)


def test_eval_within_budget_lowers_the_peak_of_what_runs_ahead(compiled):
    from nuvec_mlx_bench import measure, rounds, workloads
    from nuvec_mlx_bench.workload import Workload

    # A plain step has no stages: only the budget can hold MLX's evaluator back.
    sc = workloads.build("none", Workload("mlp", batch=256, dim=128, blocks=6))
    unlimited = rounds.peak(lambda: sc.step(sc.inputs), lambda o: nv.eval(o, budget=math.inf), measure.MlxProbe())
    throttled = rounds.peak(lambda: sc.step(sc.inputs), lambda o: nv.eval(o, budget=MiB), measure.MlxProbe())
    assert throttled < unlimited


@pytest.mark.parametrize("budget, error", [(-5, ValueError), ("big", TypeError)])
def test_eval_bad_budget_raises(budget, error):
    with pytest.raises(error, match="budget"):
        nv.eval(mx.ones(2), budget=budget)
