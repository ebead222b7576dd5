"""nv.memory.ceiling: a staged evaluation stops at the first stage above it, and the step's state is put back."""

import gc
import re
import weakref

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB
from tests.helpers import WideBlocks, readme_step, unstaged_on_purpose


def training_step():
    gc.collect()  # an earlier test's compiled step (a reference cycle) must not be freed mid-test
    mx.random.seed(0)
    model = WideBlocks()
    nv.checkpoint_layers(model)
    opt = optim.AdamW(1e-2)
    opt.init(model.trainable_parameters())
    mx.eval(model.parameters(), opt.state)
    state = [model.state, opt.state, mx.random.state]

    @nv.compile(inputs=state, outputs=state)
    def step(x):
        loss, grads = nv.value_and_grad(model, lambda m, x: (m(nn.Dropout(0.1)(x)) ** 2).mean())(model, x)
        opt.update(model, grads)
        return loss

    return model, opt, state, step


def values(tree):
    return [(k, v.tolist()) for k, v in tree_flatten(tree) if isinstance(v, mx.array)]


@unstaged_on_purpose
def test_a_step_above_the_ceiling_stops_at_its_first_stage_above_and_puts_the_state_back(compiled):
    model, opt, state, step = training_step()
    x = mx.random.normal((1024, 64), key=mx.random.key(1))
    nv.eval(step(x), state)  # compile, and give AdamW its first step
    with nv.memory.timeline() as t:
        nv.eval(step(x), state)
    ceiling = int(active() + 0.5 * (t.peak().peak - active()))
    first_above = next(r for r in t.readings if max(r.active, r.peak) > ceiling)
    before, key = values([model.parameters(), opt.state]), mx.random.state[0].tolist()
    with nv.memory.ceiling(ceiling):
        with pytest.raises(MemoryError, match="above the ceiling") as info:
            nv.eval(step(x), state)
    stage = int(re.search(r"stage (\d+) of", str(info.value)).group(1))
    # Within one stage of where the same step, timed alone, first went above.
    assert abs(stage - (first_above.index + 1)) <= 1, (stage, first_above)
    assert values([model.parameters(), opt.state]) == before
    assert mx.random.state[0].tolist() == key
    del info  # its traceback holds the stopped step's arrays
    with nv.memory.ceiling(ceiling):
        nv.eval(step(x[:64]), state)  # a smaller batch fits
    assert values(model.parameters()) != before[: len(values(model.parameters()))]


@unstaged_on_purpose
def test_an_evaluation_below_the_ceiling_is_not_stopped(compiled):
    model, opt, state, step = training_step()
    with nv.memory.ceiling(active() + 256 * MiB):
        nv.eval(step(mx.random.normal((64, 64))), state)


@pytest.mark.parametrize("nbytes, error", [(-1, ValueError), (1.5, TypeError), ("1G", TypeError)])
def test_a_ceiling_that_is_not_bytes_raises(nbytes, error):
    with pytest.raises(error, match="nbytes"):
        with nv.memory.ceiling(nbytes):
            pass


@unstaged_on_purpose
def test_after_a_stop_the_same_ceiling_lets_a_smaller_step_run(compiled):
    model, opt, state, step = training_step()
    x = mx.random.normal((1024, 64), key=mx.random.key(1))
    nv.eval(step(x), state)
    with nv.memory.timeline() as t:
        nv.eval(step(x), state)
    ceiling = int(active() + 0.5 * (t.peak().peak - active()))
    with nv.memory.ceiling(ceiling):
        for batch in (1024, 64):  # a training loop that halves its batch on MemoryError, say
            try:
                nv.eval(step(x[:batch]), state)
            except MemoryError:
                assert batch == 1024
                continue
            assert batch == 64


def test_an_eager_step_evaluated_within_the_ceiling_before_its_update_leaves_the_state(compiled):
    model, opt, state, _ = training_step()
    vg = nv.value_and_grad(model, lambda m, x: (m(x) ** 2).mean())
    x = mx.random.normal((1024, 64), key=mx.random.key(1))
    with nv.memory.timeline() as t:
        nv.eval(vg(model, x))
    ceiling = int(active() + 0.5 * (t.peak().peak - active()))
    before = values([model.parameters(), opt.state])
    with nv.memory.ceiling(ceiling):
        loss, grads = vg(model, x)
        with pytest.raises(MemoryError, match="above the ceiling"):
            nv.eval(loss, grads)  # the update comes after, so nothing was changed
        assert values([model.parameters(), opt.state]) == before
        del loss, grads
        loss, grads = vg(model, x[:64])
        nv.eval(loss, grads)
        opt.update(model, grads)
        nv.eval(model.parameters(), opt.state)
    assert values([model.parameters(), opt.state]) != before


# --- the ceiling's promise in every case: stops cleanly, puts everything back, holds nothing after ---------


def loss_fn(model, x):
    return (model(nn.Dropout(0.1)(x)) ** 2).mean()


def a_step(kind: str):
    """A checkpointed model, AdamW with no opt.init (its first update makes its state: the README's
    loop) and a step updating them with nv.update: nv.compile'd (``"compile"``) or nv.TrainingStep."""
    gc.collect()
    mx.random.seed(0)
    model = WideBlocks()
    nv.checkpoint_layers(model)
    opt = optim.AdamW(1e-2)
    mx.eval(model.parameters())
    if kind == "TrainingStep":
        return model, opt, nv.TrainingStep(model, loss_fn, opt)
    return model, opt, readme_step(model, loss_fn, opt)[1]


def everything(model, opt):
    """The model's parameters, the optimizer's state (its keys too) and the random key, as lists."""
    return values(model.parameters()), values(opt.state), mx.random.state[0].tolist()


STEPS = ["compile", "TrainingStep"]


@pytest.mark.parametrize("kind", STEPS)
def test_a_stop_puts_back_the_state_the_step_creates_and_the_next_step_runs(compiled, kind):
    """nv.compile's first update makes the optimizer's state, nv.TrainingStep makes it (as opt.init does)
    before its first step: stopped, neither leaves it behind."""
    model, opt, run = a_step(kind)
    x = mx.random.normal((256, 64), key=mx.random.key(1))
    mx.eval(x)
    before, state_dict = everything(model, opt), opt.state
    with nv.memory.ceiling(0):
        with pytest.raises(MemoryError, match=r"stopped after forward stage 1 of \d+: MLX memory reached"):
            run(x)
    assert everything(model, opt) == before  # no moments added, nothing of the step's key in them
    assert opt.state is state_dict
    run(x)  # the next step runs, and is the step that would have run without the stop
    reference, ref_opt, ref_run = a_step(kind)
    ref_run(x)
    assert everything(model, opt) == everything(reference, ref_opt)


def active() -> int:
    mx.synchronize()
    return mx.get_active_memory()


def peak_of_a_step(run, x) -> tuple[int, int]:
    """Active memory before the step and its peak (measured outside any ceiling)."""
    run(x)
    with nv.memory.measure() as m:
        run(x)
    return m.start, m.start + m.rise


def only_a_peak_crosses(run, x) -> int:
    """A ceiling above the memory left after every stage of the step, below the highest peak of a stage:
    only a reading of each stage's peak sees the step cross it."""
    run(x)
    with nv.memory.timeline() as t:
        run(x)
    left = max(r.active for r in t.readings)
    assert left < t.peak().peak - 64 * 1024, (left, t.peak())
    return (left + t.peak().peak) // 2


@pytest.mark.parametrize("kind", STEPS)
def test_a_step_above_the_ceiling_stops_after_an_earlier_evaluation_that_peaked_higher(compiled, kind):
    model, opt, run = a_step(kind)
    x = mx.random.normal((1024, 64), key=mx.random.key(1))
    start, peak = peak_of_a_step(run, x)
    limit = only_a_peak_crosses(run, x)
    higher = mx.zeros((2 * (peak - start) // 4,))  # an evaluation peaking twice as far above the start
    mx.eval(higher)
    del higher
    before = everything(model, opt)
    with nv.memory.ceiling(limit):
        with pytest.raises(MemoryError, match="above the ceiling"):
            run(x)
        assert everything(model, opt) == before
        higher = mx.zeros((2 * (peak - start) // 4,))  # the same inside the ceiling, evaluated unwatched
        mx.eval(higher)
        del higher
        with pytest.raises(MemoryError, match="above the ceiling"):
            run(x)
    assert everything(model, opt) == before


@pytest.mark.parametrize("kind", STEPS)
def test_an_evaluation_inside_the_ceiling_is_judged_by_its_own_peak_not_by_an_earlier_one(compiled, kind):
    model, opt, run = a_step(kind)
    x = mx.random.normal((64, 64), key=mx.random.key(1))
    start, peak = peak_of_a_step(run, x)
    with nv.memory.ceiling(peak + 8 * MiB):
        higher = mx.zeros((4 * MiB,))  # 16 MiB, above the ceiling, with mx.eval: not watched
        mx.eval(higher)
        del higher
        for _ in range(3):
            run(x)


@pytest.mark.parametrize("kind", STEPS)
def test_a_ceiling_inside_a_timeline_or_a_measure_sees_each_stage_s_peak(compiled, kind):
    model, opt, run = a_step(kind)
    x = mx.random.normal((1024, 64), key=mx.random.key(1))
    limit = only_a_peak_crosses(run, x)
    before = everything(model, opt)
    with nv.memory.timeline() as outer, nv.memory.measure() as m, nv.memory.ceiling(limit):
        with pytest.raises(MemoryError, match="above the ceiling"):
            run(x)
    assert everything(model, opt) == before
    assert outer.peak().peak > limit and m.start + m.rise > limit  # and they saw it too


@pytest.mark.parametrize("kind", STEPS)
def test_a_stopped_step_leaves_no_memory_behind(compiled, kind):
    gc.disable()  # what a stop leaves must go when its last reference does, not when the collector runs
    try:
        model, opt, run = a_step(kind)
        x = mx.random.normal((1024, 64), key=mx.random.key(1))
        start, peak = peak_of_a_step(run, x)
        with nv.memory.ceiling(start + (peak - start) // 2):
            for _ in range(2):
                try:
                    run(x)
                except MemoryError:
                    pass
                else:
                    raise AssertionError("the step was not stopped")
                # The step's state is MiBs, its smallest arrays (a bias's moments) 1 KiB.
                assert active() <= start + 1024
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", STEPS)
def test_steps_inside_a_ceiling_hold_no_state_after_them(compiled, kind):
    gc.disable()
    try:
        model, opt, run = a_step(kind)
        x = mx.random.normal((256, 64), key=mx.random.key(1))
        start, peak = peak_of_a_step(run, x)
        with nv.memory.ceiling(1 << 40):
            for _ in range(3):
                old = [
                    weakref.ref(a)
                    for _, a in tree_flatten([model.trainable_parameters(), opt.state])
                    if isinstance(a, mx.array) and a.size > 1
                ]  # weights and moments (not step counters)
                run(x)
                assert [r for r in old if r() is not None] == []
                assert active() <= start + 1024
    finally:
        gc.enable()


def held_by_the_undo(model, opt) -> int:
    """What a step's undo keeps from before the step: its trainable parameters and the optimizer's state."""
    return sum(a.nbytes for _, a in tree_flatten([model.trainable_parameters(), opt.state]) if isinstance(a, mx.array))


@pytest.mark.parametrize("kind", STEPS)
def test_a_step_inside_a_ceiling_peaks_at_most_what_its_undo_holds_above_the_same_step_outside(compiled, kind):
    model, opt, run = a_step(kind)
    x = mx.random.normal((256, 64), key=mx.random.key(1))
    _, outside = peak_of_a_step(run, x)
    held = held_by_the_undo(model, opt)
    for _ in range(3):
        with nv.memory.ceiling(1 << 40), nv.memory.measure() as m:
            run(x)
        assert m.start + m.rise <= outside + held, (m.start + m.rise - outside, held)
    # A ceiling just above that peaks lets the step run again and again.
    with nv.memory.ceiling(outside + held):
        for _ in range(3):
            run(x)
