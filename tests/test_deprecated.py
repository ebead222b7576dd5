"""Deprecated spellings: each still works as its new one does, and warns (FutureWarning) naming the new one.

One focused test per spelling; every other test uses the current API. To check that none does,
run the suite with deprecation warnings as errors (``pytest.warns`` here still catches them):

    python -m pytest -W error::FutureWarning
"""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from tests.helpers import Blocks, assert_close, lazy_arrays, mean_square, tiny_llama

MiB = 1 << 20


def deprecated(new: str):
    """``pytest.warns`` for a FutureWarning that names ``new``, the spelling to use instead."""
    return pytest.warns(FutureWarning, match=rf"is deprecated: use .*{new}")


def limits_seen(monkeypatch) -> list[int]:
    """The memory headroom (limit minus active memory) at each mx.eval from now on."""
    seen, real = [], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: seen.append(mx.get_memory_limit() - mx.get_active_memory()) or real(*a))
    return seen


def test_eval_budget_is_the_throttle(monkeypatch):
    seen = limits_seen(monkeypatch)
    with deprecated(r"nv.eval\(..., throttle=\)"):
        nv.eval(lazy_arrays(MiB), budget=MiB)
    assert seen == [MiB]
    with deprecated("throttle="), pytest.raises(ValueError, match=r"^throttle must be >= 0 bytes, got -1$"):
        nv.eval(mx.ones((2,)), budget=-1)


def test_memory_budget_is_the_throttle(monkeypatch):
    seen = limits_seen(monkeypatch)
    with deprecated("nv.memory.throttle"):
        context = nv.memory.budget(MiB)
    with context:
        assert nv.memory.current_throttle() == MiB
        nv.eval(lazy_arrays(MiB))
    assert seen == [MiB]
    with deprecated("nv.memory.throttle"), pytest.raises(ValueError, match=r"^nbytes must be >= 0 bytes, got -5$"):
        with nv.memory.budget(-5):
            pass


def test_memory_current_budget_is_the_current_throttle():
    with nv.memory.throttle(3 * MiB), deprecated("nv.memory.current_throttle"):
        assert nv.memory.current_budget() == 3 * MiB
    with deprecated("current_throttle"), pytest.raises(TypeError, match=r"^staged must be a bool, got int$"):
        nv.memory.current_budget(0)


@pytest.mark.parametrize("old, new", [("DEFAULT_BUDGET", "DEFAULT_THROTTLE"), ("Reading", "StageReading")])
def test_memory_renamed_names_are_the_new_ones(old, new):
    with deprecated(f"nv.memory.{new}"):
        assert getattr(nv.memory, old) is getattr(nv.memory, new)
    with pytest.raises(AttributeError):
        nv.memory.NoSuchName  # noqa: B018


def test_measurement_peak_is_its_rise():
    held = mx.ones((MiB,))
    mx.eval(held)  # at the start: in the peak, not in the rise
    with nv.memory.measure() as m:
        mx.eval(mx.ones((MiB,)))
    with deprecated("Measurement.rise"):
        assert m.peak == m.rise and 4 * MiB <= m.rise < m.start + m.rise


@pytest.mark.parametrize("form", ["checkpoint", "checkpoint_flat"])
def test_allow_captured_is_captured(form):
    x, w = mx.array([1.0, -2.0, 3.0]), mx.array([0.5, 4.0, -1.0])

    def loss(w, allow):
        if form == "checkpoint":
            return nv.checkpoint(lambda x: mx.sin(x * w), allow_captured=allow)(x).sum()
        return nv.checkpoint_flat(lambda xs: [mx.sin(xs[0] * w)], allow_captured=allow)([x])[0].sum()

    with deprecated('captured="constant"'):
        constant = mx.grad(loss)(w, True)
    with deprecated('captured="constant"'):
        differentiated = mx.grad(loss)(w, False)
    assert mx.array_equal(constant, mx.zeros_like(w)).item()
    assert_close(differentiated, mx.grad(lambda w: mx.sin(x * w).sum())(w))
    with deprecated("captured="), pytest.raises(TypeError, match=r"^allow_captured must be a bool, got str$"):
        getattr(nv, form)(lambda xs: xs, allow_captured="no")


@pytest.mark.parametrize(
    "spelling",
    [
        lambda: nv.checkpoint(mx.sin, allow_captured=True),
        lambda: nv.eval(mx.ones(2), budget=1),
        lambda: nv.plan(Blocks(2, 16), mean_square, (mx.ones((2, 16)),), 1 << 30, progress=False),
    ],
    ids=["checkpoint allow_captured", "eval budget", "plan of a model"],
)
def test_each_deprecation_warning_points_at_the_users_line(spelling):
    with pytest.warns(FutureWarning) as seen:
        spelling()
    assert (seen[0].filename, seen[0].lineno) == (__file__, spelling.__code__.co_firstlineno)


def small_model():
    mx.random.seed(0)
    model = Blocks(2, 16)
    mx.eval(model.parameters())
    return model, mx.random.normal((4, 16), key=mx.random.key(1))


@pytest.mark.slow
def test_plan_of_a_model_and_a_loss_is_the_plan_of_their_step_and_replans():
    model, x = small_model()
    opt = optim.SGD(0.1)
    with deprecated(r"nv.plan\(nv.TrainingStep\(model, loss_fn, optimizer\), ...\)"):
        old = nv.plan(model, mean_square, x, 1 << 40, optimizer=opt, compile=False, progress=False)
    new = nv.plan(nv.TrainingStep(model, mean_square, opt, compile=False), x, 1 << 40, progress=False)
    assert old.fits and new.fits and old.modes == new.modes == ["plain", "plain"]
    with deprecated(r"nv.Planner\(step, batch\).plan\(budget\)"):
        again = old.replan(old.smallest)
    assert again.budget == old.smallest and again.unchecked == old.unchecked  # from the same measurements
    with deprecated("nv.Planner"), pytest.raises(ValueError, match="keeps no measurements"):
        new.replan(new.smallest)
    with deprecated("nv.plan"), pytest.raises(TypeError, match=r"^loss_fn must be callable, got NoneType$"):
        nv.plan(model, None, x, 1 << 20)


def test_largest_fit_of_a_model_and_a_loss_is_that_of_their_step():
    model, _ = small_model()
    make = lambda n: mx.random.normal((n, 16), key=mx.random.key(n))  # noqa: E731
    options = dict(sizes=(2, 4), tries=1, progress=False)  # a budget of 1 byte: nothing fits, size 1 is tried
    with deprecated(r"nv.largest_fit\(nv.TrainingStep"):
        old = nv.largest_fit(model, mean_square, make, 1, compile=False, **options)
    new = nv.largest_fit(nv.TrainingStep(model, mean_square, compile=False), make, 1, **options)
    assert [s for s, _ in old.peaks] == [s for s, _ in new.peaks] == [2, 4, 1] and old.size == new.size == 0


def test_saved_activations_of_a_model_and_a_loss_are_those_of_their_step():
    model, x = small_model()
    with deprecated(r"nv.saved_activations\(nv.TrainingStep"):
        old = nv.saved_activations(model, mean_square, x)
    new = nv.saved_activations(nv.TrainingStep(model, mean_square), x)
    assert old.to_dict() == new.to_dict()
    with deprecated("nv.saved_activations"), pytest.raises(TypeError, match=r"^policy must be a function .*, got int$"):
        nv.saved_activations(model, mean_square, x, policy=2)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"optimizer": "adam"}, r"^optimizer must be an mlx.optimizers.Optimizer or None, got str$"),
        ({"compile": "yes"}, r"^compile must be a bool, got str$"),
    ],
)
def test_saved_activations_of_a_model_and_a_loss_names_a_bad_step_argument(options, match):
    model, x = small_model()
    with deprecated("nv.saved_activations"), pytest.raises(TypeError, match=match):
        nv.saved_activations(model, mean_square, x, **options)


def test_mlx_lm_training_step_is_the_training_step():
    nvlm = pytest.importorskip("nuvec_mlx.mlx_lm")
    default_loss = pytest.importorskip("mlx_lm.tuner.trainer").default_loss
    batch = (mx.random.randint(0, 256, (2, 17), key=mx.random.key(2)), mx.array([[0, 16], [0, 12]]))
    results = []
    for old in (True, False):
        model, optimizer = tiny_llama(layers=2), optim.SGD(0.1)
        nv.checkpoint_layers(model)
        if old:
            with deprecated(r"nuvec_mlx.TrainingStep\(model, loss, optimizer\)"):
                step, state = nvlm.training_step(model, optimizer)
            loss, tokens, _ = step(batch, None, True)
            nv.eval(state, loss, tokens)
        else:
            loss, tokens = nv.TrainingStep(model, default_loss, optimizer)(*batch)
        results.append([loss, tokens, *(v for _, v in tree_flatten(model.parameters()))])
    assert_close(results[0], results[1], 1e-6)
    with deprecated("TrainingStep"), pytest.raises(TypeError, match=r"^optimizer must be an mlx.optimizers.Optimizer"):
        nvlm.training_step(nn.Linear(2, 2), "adam")
    with deprecated("TrainingStep"), pytest.raises(TypeError, match=r"^model must be an mlx.nn.Module, got str$"):
        nvlm.training_step("model", optim.Adam(1e-3))
