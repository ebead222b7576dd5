"""Stage marks, collectors and the per-thread registry (nuvec_mlx._stages)."""

import gc

import mlx.core as mx

from nuvec_mlx import _marks, _registry
from tests.helpers import assert_evaluated, lazy_arrays

KiB = 1 << 10


def test_marks_inside_a_collector_come_out_in_order_each_ending_after_its_arrays():
    arrays = lazy_arrays(64 * KiB, 3)
    with _marks.collecting() as stages:
        for a in arrays:
            _marks.mark([a], _marks.FORWARD)
    assert len(stages) == 3
    before = mx.get_active_memory()
    for i, stage in enumerate(stages, 1):
        mx.eval(stage)
        assert_evaluated(before, i * 64 * KiB)  # the stage computed its own array, no other
        assert mx.get_active_memory() - before < (i + 1) * 64 * KiB - 4096


def test_a_mark_outside_a_collector_changes_nothing():
    arrays = lazy_arrays(KiB, 2)
    assert all(a is b for a, b in zip(_marks.mark(arrays, _marks.FORWARD), arrays))


def test_a_collector_starts_empty_and_hands_its_stages_to_the_enclosing_one():
    with _marks.collecting() as outer:
        _marks.mark(lazy_arrays(KiB), _marks.BACKWARD)
        with _marks.collecting() as inner:
            _marks.mark(lazy_arrays(KiB), _marks.BACKWARD)
            _marks.mark(lazy_arrays(KiB), _marks.BACKWARD)
        assert len(inner) == 2 and len(outer) == 1
        _registry.hand_on([], inner)
    assert outer[1:] == inner and len(outer) == 3


def test_what_reads_a_marked_array_evaluates_its_mark_and_lets_it_go():
    gc.collect()
    before = mx.get_active_memory()
    (a,) = lazy_arrays(256 * KiB)
    with _marks.collecting() as stages:
        (b,) = _marks.mark([a], _marks.FORWARD)
    mx.eval(b * 2)  # a plain evaluation, not the stage
    del a, b
    gc.collect()
    # An unevaluated mark would still hold its array's buffer.
    assert mx.get_active_memory() - before < 4096, "the mark kept its array alive"
    assert len(stages) == 1


def test_registered_stages_are_taken_once_by_any_of_their_arrays():
    arrays, stages, other = lazy_arrays(KiB, 2), lazy_arrays(KiB, 2), lazy_arrays(KiB)
    _registry.register(arrays, stages)
    assert _registry.take([other]).stages == []
    taken = _registry.take([{"nested": [arrays[1]]}, "not an array"]).stages
    assert len(taken) == 2 and all(t is s for t, s in zip(taken, stages))
    assert _registry.take(arrays).stages == []


def test_steps_are_taken_oldest_first_and_only_those_asked_for():
    first, second, third = (lazy_arrays(KiB) for _ in range(3))
    stages = [lazy_arrays(KiB) for _ in range(3)]
    for arrays, s in zip((first, second, third), stages):
        _registry.register(arrays, s)
    taken = _registry.take([third, first]).stages
    assert taken[0] is stages[0][0] and taken[1] is stages[2][0]
    assert _registry.take(second).stages[0] is stages[1][0]


def test_an_entry_lets_its_stages_go_once_its_arrays_are_gone():
    gc.collect()
    before = mx.get_active_memory()
    arrays, stages = lazy_arrays(KiB, 2), lazy_arrays(256 * KiB)
    mx.eval(stages)  # the registry now holds 256 KiB
    _registry.register(arrays, stages)
    del arrays, stages
    gc.collect()
    assert mx.get_active_memory() - before < 4096, "a forgotten step's stages are still held"


def test_the_registry_remembers_a_bounded_number_of_steps():
    kept = [lazy_arrays(KiB) for _ in range(_registry.REMEMBERED + 5)]
    for arrays in kept:
        _registry.register(arrays, lazy_arrays(KiB))
    assert _registry.take(kept[0]).stages == []  # forgotten: the oldest went first
    assert len(_registry.take(kept[-1]).stages) == 1
