"""Stage marks, collectors and the per-thread registry (nuvec_mlx._marks, nuvec_mlx._registry), and the
NotStagedWarning of a checkpointed step that runs unstaged."""

import contextlib
import gc
import inspect
import warnings

import mlx.core as mx
import mlx.optimizers as optim
import pytest

import nuvec_mlx as nv
from nuvec_mlx import _marks, _registry
from tests.helpers import Blocks, assert_evaluated, lazy_arrays, mean_square, unstaged_on_purpose

KiB = 1 << 10


def test_marks_inside_a_collector_come_out_in_order_each_ending_after_its_arrays():
    arrays = lazy_arrays(64 * KiB, 3)
    with _marks.collecting() as stages:
        for a in arrays:
            _marks.mark([a], _marks.FORWARD)
    assert len(stages) == 3
    mx.synchronize()
    before = mx.get_active_memory()
    for i, stage in enumerate(stages, 1):
        mx.eval(stage)
        assert_evaluated(before, i * 64 * KiB)  # the stage computed its own array, no other (synchronized)
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
    mx.synchronize()
    before = mx.get_active_memory()
    (a,) = lazy_arrays(256 * KiB)
    with _marks.collecting() as stages:
        (b,) = _marks.mark([a], _marks.FORWARD)
    mx.eval(b * 2)  # a plain evaluation, not the stage
    del a, b
    gc.collect()
    mx.synchronize()
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
    mx.synchronize()
    before = mx.get_active_memory()
    arrays, stages = lazy_arrays(KiB, 2), lazy_arrays(256 * KiB)
    mx.eval(stages)  # the registry now holds 256 KiB
    _registry.register(arrays, stages)
    with pytest.warns(nv.NotStagedWarning):  # never taken: the step ran unstaged
        del arrays, stages
        gc.collect()
    mx.synchronize()
    assert mx.get_active_memory() - before < 4096, "a forgotten step's stages are still held"


@unstaged_on_purpose
def test_the_registry_remembers_a_bounded_number_of_steps():
    kept = [lazy_arrays(KiB) for _ in range(_registry.REMEMBERED + 5)]
    with pytest.warns(nv.NotStagedWarning):  # the oldest, forgotten, ran unstaged
        for arrays in kept:
            _registry.register(arrays, lazy_arrays(KiB))
    assert _registry.take(kept[0]).stages == []  # forgotten: the oldest went first
    assert len(_registry.take(kept[-1]).stages) == 1


@contextlib.contextmanager
def not_staged_warnings(action="always"):
    """The NotStagedWarnings given inside, each kept (``always``) or each kind once (``default``, as a
    script sees them); collected after the arrays of the steps inside are gone."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter(action)
        found = []
        yield found
        gc.collect()
    found += [str(w.message) for w in seen if issubclass(w.category, nv.NotStagedWarning)]


def compiled_flat_step():
    """A compiled gradient step of two checkpointed blocks, its inputs, and its first call made."""
    block = nv.checkpoint_flat(lambda xs: [xs[0] + mx.tanh(xs[0] @ xs[1])])
    vg = nv.value_and_grad_flat(lambda xs: block(block(xs) + xs[1:])[0].sum(), [0, 1])
    step = nv.compile_flat(lambda xs: (lambda value, grads: [value, *grads])(*vg(xs)))
    xs = [mx.ones((64, 64)) * 0.5, mx.eye(64) * 0.1]
    nv.eval(step(xs))
    return step, xs


def test_a_step_evaluated_by_mx_eval_and_dropped_says_once_that_it_ran_unstaged(compiled):
    step, xs = compiled_flat_step()
    with not_staged_warnings() as each:
        out = step(xs)
        mx.eval(out)  # its stages never taken by nv.eval
        del out
    assert len(each) == 1 and "nv.eval" in each[0]  # one for the step (of 4 stages), naming what to call
    with not_staged_warnings("default") as shown:
        for _ in range(3):
            mx.eval(step(xs))
    assert len(shown) == 1  # three steps unstaged: a script sees it once


def test_a_step_evaluated_by_nv_eval_says_nothing(compiled):
    step, xs = compiled_flat_step()
    with not_staged_warnings() as each:
        for _ in range(3):
            nv.eval(step(xs))
    assert each == []


@pytest.mark.xfail(
    strict=True,
    reason="library: once every array a step returned is freed before nv.eval took its stages, the registry "
    "warns NotStagedWarning ('the step ran unstaged') whether anything evaluated them or not; a step dropped "
    "unevaluated is not told from one evaluated by mx.eval",
)
def test_a_step_dropped_unevaluated_says_nothing(compiled):
    """Nothing ran, so nothing ran unstaged (a step built and then abandoned, say after an exception).
    The registry cannot tell it from a step evaluated by mx.eval: both are forgotten once their arrays
    are gone."""
    step, xs = compiled_flat_step()
    with not_staged_warnings() as each:
        out = step(xs)
        del out
    assert each == []


def checkpointed_training(update):
    """A model of checkpointed blocks, its SGD, a batch, and its step compiled with nv.compile, which
    updates them with ``update(optimizer, model, grads)``."""
    mx.random.seed(0)
    model = Blocks(3, 32)
    nv.checkpoint_layers(model)
    optimizer = optim.SGD(0.1)
    optimizer.init(model.trainable_parameters())
    x = mx.random.normal((4, 32))
    state = [model.state, optimizer.state]
    mx.eval(state, x)

    @nv.compile(inputs=state, outputs=state)
    def step():
        loss, grads = nv.value_and_grad(model, mean_square)(model, x)
        update(optimizer, model, grads)
        return loss

    return model, optimizer, state, step


def test_optimizer_update_inside_nv_compile_on_checkpointed_blocks_says_once_to_call_nv_update(compiled):
    *_, state, step = checkpointed_training(lambda optimizer, model, grads: optimizer.update(model, grads))
    with not_staged_warnings() as each:
        for _ in range(3):
            nv.eval(step(), state)
    assert len(each) == 1 and "nv.update(optimizer, model, grads)" in each[0]  # when traced, once


def test_the_unstaged_update_warning_points_at_the_users_call_of_the_step(compiled):
    *_, state, step = checkpointed_training(lambda optimizer, model, grads: optimizer.update(model, grads))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        out = step()
    nv.eval(out, state)
    [w] = [w for w in seen if issubclass(w.category, nv.NotStagedWarning)]
    assert (w.filename, w.lineno) == (__file__, line)


def test_nv_update_inside_nv_compile_evaluated_by_nv_eval_says_nothing(compiled):
    *_, state, step = checkpointed_training(nv.update)
    with not_staged_warnings() as each:
        for _ in range(3):
            nv.eval(step(), state)
    assert each == []


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_a_training_step_says_nothing(compile, compiled):
    model, optimizer, *_ = checkpointed_training(nv.update)
    step = nv.TrainingStep(model, mean_square, optimizer, compile=compile)
    x = mx.random.normal((4, 32))
    with not_staged_warnings() as each:
        for _ in range(3):
            step(x)
        del step
    assert each == []
