import math

import mlx.core as mx
import pytest

import nuvec_mlx as nv

MiB = 1 << 20


def test_stats_are_ints_consistent_with_mlx():
    s = nv.memory.stats()
    assert all(isinstance(v, int) for v in (s.active, s.peak, s.cache, s.limit))
    assert s.active == mx.get_active_memory() and s.limit == mx.get_memory_limit()
    assert s.peak >= s.active


def test_measure_reports_the_peak_above_entry():
    keep = mx.ones((MiB,))  # 4 MiB, alive before and after: not counted
    mx.eval(keep)
    with nv.memory.measure() as m:
        a = mx.ones((2 * MiB,))  # 8 MiB
        b = a + 1  # 8 MiB more while a is alive
        mx.eval(b)
        del a, b
    assert 16 * MiB <= m.peak <= 16 * MiB + MiB
    assert m.end == m.start


def test_reset_peak_drops_earlier_peaks():
    x = mx.ones((4 * MiB,))
    mx.eval(x)
    del x
    nv.memory.reset_peak()
    assert nv.memory.stats().peak < mx.get_active_memory() + 4 * MiB


def test_budget_context_sets_and_restores():
    before = nv.memory.current_budget()
    with nv.memory.budget(5 * MiB):
        assert nv.memory.current_budget() == 5 * MiB
        with nv.memory.budget(math.inf):
            assert nv.memory.current_budget() == math.inf
        assert nv.memory.current_budget() == 5 * MiB
    assert nv.memory.current_budget() == before


def test_budget_restored_after_an_exception():
    before = nv.memory.current_budget()
    with pytest.raises(RuntimeError):
        with nv.memory.budget(0):
            raise RuntimeError("boom")
    assert nv.memory.current_budget() == before


@pytest.mark.parametrize(
    "nbytes, error", [(-1, ValueError), (1.5, TypeError), ("1M", TypeError), (True, TypeError)]
)
def test_bad_budget_raises(nbytes, error):
    with pytest.raises(error, match="nbytes"):
        with nv.memory.budget(nbytes):
            pass


def test_measure_clear_cache_must_be_bool():
    with pytest.raises(TypeError, match="clear_cache must be a bool"):
        with nv.memory.measure(clear_cache="yes"):
            pass
