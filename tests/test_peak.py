"""MLX's one peak counter shared: nv.memory.measure, timeline and ceiling nested in any order each see their peak."""

import mlx.core as mx

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB


def spike(mib: int) -> None:
    """Evaluate an array of ``mib`` MiB and free it: a peak that leaves nothing behind."""
    x = mx.zeros((mib * MiB // 4,))
    mx.eval(x)
    del x


def test_a_measure_keeps_the_peak_seen_before_an_inner_measure_reset_the_counter():
    with nv.memory.measure() as outer:
        spike(8)
        with nv.memory.measure() as inner:
            spike(1)
    assert 8 * MiB <= outer.rise < 9 * MiB
    assert MiB <= inner.rise < 2 * MiB


def test_a_measure_keeps_its_peak_across_reset_peak_and_a_timeline():
    with nv.memory.measure() as m:
        spike(8)
        nv.memory.reset_peak()
        with nv.memory.timeline() as t:
            nv.eval(mx.zeros((MiB // 4,)) + 1)  # a small evaluation the timeline reads (and resets after)
    assert 8 * MiB <= m.rise < 9 * MiB
    assert t.peak().peak - m.start < 2 * MiB  # the timeline sees its own evaluation only
    assert nv.memory.stats().peak - m.start < 2 * MiB  # MLX's counter itself was reset


def test_a_timeline_inside_a_ceiling_and_a_measure_reads_each_stage_s_own_peak():
    with nv.memory.measure() as m, nv.memory.ceiling(1 << 40), nv.memory.timeline() as t:
        spike(8)
        nv.eval(mx.zeros((MiB // 4,)) + 1)
    assert t.peak().peak - m.start < 2 * MiB
    assert 8 * MiB <= m.rise < 9 * MiB
