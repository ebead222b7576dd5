import math

import mlx.core as mx
import pytest

import nuvec_mlx as nv
from tests.helpers import assert_close

MiB = 1 << 20


def test_eval_evaluates_nested_containers_and_single_arrays():
    a, b, c = mx.ones((3,)) * 2, mx.zeros((2,)) + 1, mx.arange(3)
    nv.eval([a, [b, {"c": c}]])
    nv.eval(a)
    assert_close(a, mx.full((3,), 2.0))


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


def test_eval_within_budget_lowers_a_checkpointed_peak(compiled):
    from nuvec_mlx_bench import measure, rounds, workloads
    from nuvec_mlx_bench.workload import Workload

    sc = workloads.build("nuvec", Workload("mlp", batch=256, dim=128, blocks=6))
    unlimited = rounds.peak(lambda: sc.step(sc.inputs), lambda o: nv.eval(o, budget=math.inf), measure.MlxProbe())
    throttled = rounds.peak(lambda: sc.step(sc.inputs), lambda o: nv.eval(o, budget=MiB), measure.MlxProbe())
    assert throttled < unlimited


@pytest.mark.parametrize(
    "arrays, match",
    [(3.0, "arrays must be an mlx.core.array"), ([mx.ones(2), "x"], r"arrays\[.*\] must be an mlx.core.array")],
    ids=["float", "str element"],
)
def test_eval_bad_arrays_raise(arrays, match):
    with pytest.raises(TypeError, match=match):
        nv.eval(arrays)


@pytest.mark.parametrize("budget, error", [(-5, ValueError), ("big", TypeError)])
def test_eval_bad_budget_raises(budget, error):
    with pytest.raises(error, match="budget"):
        nv.eval(mx.ones(2), budget=budget)
