"""nv.largest_fit: the largest batch or sequence length that fits, within its tolerance of the measured largest."""

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB
from nuvec_mlx.planner import _trial
from nuvec_mlx.planner.fit import REACH, at_reach, solve
from nuvec_mlx_bench import testing
from tests.helpers import held_while_unobserved, tiny_llama


def test_solve_extrapolates_a_parabola_and_a_line():
    assert solve([(1, 110), (2, 120), (4, 140)], budget=200, multiple=1) == 10  # a line: 100 + 10 s
    assert solve([(16, 110), (32, 130), (64, 190)], budget=400, multiple=8) == 128  # curving up
    assert solve([(10, 100), (20, 300)], budget=250, multiple=1) == 17  # above the largest measured size: below it


def test_solve_goes_no_further_than_its_reach_and_says_where_it_stopped_there():
    """A flat fit says little about far sizes: past REACH x the largest size measured the answer is a lower
    bound, and at_reach tells it from an answer the curve itself gave."""
    line = [(1, 110), (2, 120), (4, 140)]  # 100 + 10 s: 200 at 10, a million at 99,990
    assert solve(line, budget=10**6, multiple=1) == REACH * 4 - 1 and at_reach(REACH * 4 - 1, 4, 1)
    assert solve(line, budget=10**6, multiple=8) == 8 and at_reach(8, 4, 8)  # 15 rounded down to a multiple
    assert solve(line, budget=200, multiple=1) == 10 and not at_reach(10, 4, 1)


def test_solve_reads_every_point_so_noise_between_close_sizes_cannot_bend_the_curve():
    """Seen under load: 936 tokens peaked below 920; a parabola through the three sizes nearest the
    budget then fitted up to 3736 tokens, and the search spent its tries walking down from there."""
    budget = 24 << 20
    points = [(64, 3481952), (128, 5087000), (256, 8325116), (896, 24521308), (920, 25008812), (936, 25001194)]
    assert 920 <= solve(points, budget, multiple=8) <= 952
    assert solve(points[:3], budget, multiple=8) == 896  # three points: the parabola through them


def peak(model, loss_fn, batch, optimizer):
    """The step's peak measured afresh, as a training loop runs it: every block checkpointed (what
    nv.largest_fit measures), a nv.TrainingStep, the higher of two steps after the first."""
    nv.checkpoint_layers(model, policy=nv.policies.save_nothing)
    step = nv.TrainingStep(model, loss_fn, optimizer)
    step(batch)
    peaks = []
    for _ in range(2):
        with nv.memory.measure() as m:
            step(batch)
        peaks.append(m.start + m.rise)
    nv.checkpoint_layers(model, enable=False)
    return max(peaks)


def close(fit, multiple: int, tolerance: float = 0.02) -> int:
    """How near the bracket closes as nv.largest_fit promises: ``tolerance`` x the fit, rounded down to
    the multiple, at least one multiple."""
    return max(multiple, math.floor(tolerance * fit.size / multiple) * multiple)


@pytest.mark.slow
def test_the_largest_sequence_is_within_the_tolerance_of_the_measured_largest(compiled):
    model = tiny_llama(layers=4)
    tokens = mx.random.randint(0, 256, (2, 2049), key=mx.random.key(1))
    loss_fn = lambda m, x: nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean()  # noqa: E731
    make = lambda t: tokens[:, : t + 1]  # noqa: E731
    opt = optim.Adam(1e-3)
    budget = 24 * MiB
    fit = nv.largest_fit(
        nv.TrainingStep(model, loss_fn, opt), make, budget, sizes=(64, 128, 256), multiple=8, progress=False
    )
    # What it promises: the answer measured to fit, the smallest size measured not to within the tolerance.
    assert fit.size > 256 and fit.size % 8 == 0 and all(p <= budget for s, p in fit.peaks if s == fit.size), str(fit)
    assert fit.below is not None and all(p > budget for s, p in fit.peaks if s == fit.below), str(fit)
    assert fit.below - fit.size <= close(fit, 8), str(fit)
    # Measured afresh, the two sides of the bracket are on their sides of the budget, give or take what a
    # step's peak varies by between runs: what MLX's evaluator runs ahead, at most the throttle.
    spread = nv.memory.current_throttle()
    assert peak(model, loss_fn, make(fit.size), opt) <= budget + spread, str(fit)
    assert peak(model, loss_fn, make(fit.below), opt) > budget - spread, str(fit)


@pytest.mark.slow
def test_the_largest_batch_of_the_benchmark_transformer(compiled):
    model, x = testing.blocks_model("transformer", batch=64, dim=64, blocks=4, seq=64)
    fit = nv.largest_fit(
        nv.TrainingStep(model, testing.blocks_loss), lambda b: x[:b], 16 * MiB, sizes=(2, 4, 8), progress=False
    )
    assert 8 < fit.size < 64 and fit.below is not None and fit.below - fit.size <= close(fit, 1)
    assert [s for s, _ in fit.peaks[:3]] == [2, 4, 8] and "largest size that fits 16.0 MiB" in str(fit)


@pytest.mark.parametrize(
    "sizes, error", [((4,), ValueError), ((4, 2), ValueError), ((1, 2.0), TypeError), ("12", TypeError)]
)
def test_sizes_must_be_two_increasing_ints(sizes, error):
    with pytest.raises(error, match="sizes"):
        nv.largest_fit(
            nv.TrainingStep(nn.Linear(2, 2), lambda m, x: m(x).sum()), lambda s: mx.ones((s, 2)), 1 << 20, sizes=sizes
        )


@pytest.mark.slow
def test_the_largest_fit_is_verified_as_its_step_runs_unobserved(monkeypatch, compiled):
    model, _ = testing.blocks_model("mlp", batch=64, dim=64, blocks=6)
    step = nv.TrainingStep(model, testing.blocks_loss)
    make = lambda n: mx.random.normal((n, 64), key=mx.random.key(n))  # noqa: E731
    first = nv.largest_fit(step, make, budget=16 << 20, sizes=(64, 128), progress=False)
    extra = 8 << 20
    held_while_unobserved(monkeypatch, extra)
    late = nv.largest_fit(step, make, budget=16 << 20, sizes=(64, 128), progress=False)
    assert all(b >= a + extra - (256 << 10) for (_, a), (_, b) in zip(first.peaks[:2], late.peaks[:2])), (first, late)


def test_the_largest_fit_runs_its_steps_as_a_loop_does_not_stage_by_stage(monkeypatch):
    """Only the step's peak counts here; a step read after every stage costs more (the cache cleared, the
    device waited for, stage by stage). As in a loop, only a size's first step starts from an empty cache."""
    cleared = []
    measure = nv.memory.measure

    def observed(*args, **kwargs):
        raise AssertionError("a step read stage by stage")

    def measured(clear_cache=True):
        cleared.append(clear_cache)
        return measure(clear_cache)

    monkeypatch.setattr(_trial.Session, "observe", observed)
    monkeypatch.setattr(_trial.memory, "measure", measured)
    model, _ = testing.blocks_model("mlp", batch=16, dim=32, blocks=3)
    step = nv.TrainingStep(model, testing.blocks_loss)
    make = lambda n: mx.random.normal((n, 32), key=mx.random.key(n))  # noqa: E731
    # Sizes far enough apart that their peaks differ by more than the CPU worker's run-ahead varies under load.
    fit = nv.largest_fit(step, make, budget=1 << 30, sizes=(64, 512), tries=0, progress=False)
    assert [s for s, _ in fit.peaks] == [64, 512] and fit.peaks[0][1] < fit.peaks[1][1] and fit.size == 512
    assert cleared == [True, False, True, False]
