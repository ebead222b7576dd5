"""nv.memory: statistics (a peak is absolute), measurements (a rise is relative) and the throttle's context."""

import math

import mlx.core as mx
import pytest

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB


def test_stats_are_ints_consistent_with_mlx():
    s = nv.memory.stats()
    assert all(isinstance(v, int) for v in (s.active, s.peak, s.cache, s.limit))
    assert s.active == mx.get_active_memory() and s.limit == mx.get_memory_limit()


def test_after_reset_peak_the_peak_is_the_active_memory():
    """reset_peak resets "to the active memory" (its docstring), so a peak is never below what is active,
    though MLX's own counter goes to 0 and reads 0 until something is allocated."""
    held = mx.ones((MiB,))
    mx.eval(held)
    nv.memory.reset_peak()
    s = nv.memory.stats()
    assert s.peak >= s.active >= held.nbytes


def test_a_measurements_rise_is_above_entry_and_a_stats_peak_counts_everything_held():
    keep = mx.ones((4 * MiB,))  # 16 MiB, alive before and after: not in the rise, in the peak
    mx.eval(keep)
    with nv.memory.measure() as m:
        a = mx.ones((2 * MiB,))  # 8 MiB
        b = a + 1  # 8 MiB more while a is alive
        mx.eval(b)
        del a, b
        inside = nv.memory.stats()
    assert 16 * MiB <= m.rise <= 16 * MiB + MiB
    assert m.end == m.start and m.start >= keep.nbytes
    assert inside.peak == m.start + m.rise >= keep.nbytes + 16 * MiB


def test_reset_peak_drops_earlier_peaks():
    x = mx.ones((4 * MiB,))
    mx.eval(x)
    del x
    nv.memory.reset_peak()
    assert nv.memory.stats().peak < mx.get_active_memory() + 4 * MiB


def test_throttle_context_sets_and_restores():
    before = nv.memory.current_throttle()
    with nv.memory.throttle(5 * MiB):
        assert nv.memory.current_throttle() == 5 * MiB
        with nv.memory.throttle(math.inf):
            assert nv.memory.current_throttle() == math.inf
        assert nv.memory.current_throttle() == 5 * MiB
    assert nv.memory.current_throttle() == before


def test_throttle_restored_after_an_exception():
    before = nv.memory.current_throttle()
    with pytest.raises(RuntimeError):
        with nv.memory.throttle(0):
            raise RuntimeError("boom")
    assert nv.memory.current_throttle() == before


@pytest.mark.parametrize("nbytes, error", [(-1, ValueError), (1.5, TypeError), ("1M", TypeError), (True, TypeError)])
def test_bad_throttle_raises(nbytes, error):
    with pytest.raises(error, match="nbytes"):
        with nv.memory.throttle(nbytes):
            pass


def test_measure_clear_cache_must_be_bool():
    with pytest.raises(TypeError, match="clear_cache must be a bool"):
        with nv.memory.measure(clear_cache="yes"):
            pass
