"""The planner's choice: the cheapest modes whose predicted peak fits, against brute force."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from nuvec_mlx.planner._choose import Option, choose, smallest


def predicted(options, modes, outputs):
    """The predicted peak of one choice, written out as the model says."""
    kept, peak = 0, outputs
    for block, mode in zip(options, modes):
        o = next(o for o in block if o.mode == mode)
        peak = max(peak, kept + o.forward, kept + (o.backward or 0))
        kept += o.keeps
    return peak


def every_choice(options, outputs):
    for combo in itertools.product(*options):
        modes = tuple(o.mode for o in combo)
        yield modes, predicted(options, modes, outputs), sum(o.cost for o in combo)


option = st.builds(
    lambda keeps, forward, backward, cost, has_backward: (keeps, forward, backward if has_backward else None, cost),
    st.integers(0, 300),
    st.integers(0, 300),
    st.integers(0, 600),
    st.integers(0, 20),
    st.booleans(),
)
instance = st.lists(st.lists(option, min_size=1, max_size=3), min_size=1, max_size=5)


def build(raw):
    return [
        [Option(f"m{k}", keeps, fwd, bwd, float(cost)) for k, (keeps, fwd, bwd, cost) in enumerate(block)]
        for block in raw
    ]


@settings(max_examples=200)
@given(instance, st.integers(0, 100), st.integers(0, 4000))
def test_the_choice_is_the_cheapest_that_fits_and_its_peak_is_the_models(raw, outputs, limit):
    options = build(raw)
    fitting = [(cost, peak, modes) for modes, peak, cost in every_choice(options, outputs) if peak <= limit]
    found = choose(options, limit, outputs)
    if not fitting:
        assert found is None
        return
    assert found is not None and found.cost == min(cost for cost, _, _ in fitting)
    assert found.peak == predicted(options, found.modes, outputs) <= limit


@settings(max_examples=100)
@given(instance, st.integers(0, 100))
def test_the_smallest_choice_has_the_smallest_predicted_peak(raw, outputs):
    options = build(raw)
    least = min(peak for _, peak, _ in every_choice(options, outputs))
    assert smallest(options, outputs).peak == least


def test_the_stage_that_peaks_is_named():
    keep, full = Option("keep", 10, 2, 12, 0.0), Option("full", 1, 2, 14, 1.0)
    assert choose([[keep, full]] * 2, limit=22, outputs=5).modes == ("keep", "keep")
    choice = choose([[keep, full]] * 2, limit=21, outputs=5)
    assert choice.modes == ("full", "keep") and choice.peak == 14 and choice.at == (0, "backward")
    assert choose([[keep, full]] * 2, limit=25, outputs=30) is None
