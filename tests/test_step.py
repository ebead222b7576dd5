"""nv.TrainingStep: the four parts of a staged step (nuvec's gradient, compile, update, evaluation) in one
object, with the values of the step written by hand, and the settings it is given."""

import warnings

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_unflatten

import nuvec_mlx as nv
from nuvec_mlx import evaluate


class Blocks(nn.Module):
    def __init__(self, blocks: int = 3, dim: int = 16):
        super().__init__()
        self.layers = [
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)) for _ in range(blocks)
        ]

    def __call__(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def case(seed: int = 0):
    mx.random.seed(seed)
    model = Blocks()
    x, y = mx.random.normal((8, 16)), mx.random.normal((8, 16))
    mx.eval(model.parameters(), x, y)
    return model, x, y


def parameters(model):
    return [v for _, v in tree_flatten(model.parameters())]


def by_hand(model, optimizer):
    """The step written with the building blocks, as the README's custom loop writes it: a function that
    runs one step on ``x, y`` and returns its loss, evaluated with the state."""
    state = [model.state, optimizer.state, mx.random.state]

    @nv.compile(inputs=state, outputs=state)
    def step(x, y):
        loss, grads = nv.value_and_grad(model, loss_fn)(model, x, y)
        nv.update(optimizer, model, grads)
        return loss

    def run(x, y):
        loss = step(x, y)
        nv.eval(loss, state)
        return loss

    return run


@pytest.mark.parametrize("compiled_step", [True, False], ids=["compiled", "eager"])
def test_the_step_is_the_one_written_by_hand(compiled_step, compiled):
    model, x, y = case()
    nv.checkpoint_layers(model)
    reference = case()[0]
    nv.checkpoint_layers(reference)
    step = by_hand(reference, optim.Adam(1e-2))
    expected = [step(x, y) for _ in range(3)]
    step = nv.TrainingStep(model, loss_fn, optim.Adam(1e-2), compile=compiled_step)
    losses = [step(x, y) for _ in range(3)]
    assert [v.item() for v in losses] == [v.item() for v in expected]
    assert all(mx.array_equal(a, b).item() for a, b in zip(parameters(model), parameters(reference), strict=True))
    assert step.calls == 3 and step.dispatch_seconds > 0 and step.evaluation_seconds > 0


def test_accumulation_updates_every_nth_call_with_the_mean_gradient():
    model, x, y = case()
    step = nv.TrainingStep(model, loss_fn, optim.SGD(0.5), accumulate=2)
    before = parameters(model)
    step(x, y)
    assert all(mx.array_equal(a, b).item() for a, b in zip(parameters(model), before, strict=True))  # summed only
    step(x * 2, y)
    reference = case()[0]
    grads = [nn.value_and_grad(reference, loss_fn)(reference, xs, y)[1] for xs in (x, x * 2)]
    mean = [(a + b) / 2 for (_, a), (_, b) in zip(tree_flatten(grads[0]), tree_flatten(grads[1]), strict=True)]
    expected = [p - 0.5 * g for p, g in zip(before, mean, strict=True)]
    for a, b in zip(parameters(model), expected, strict=True):
        assert mx.allclose(a, b, atol=1e-6).item()


def test_without_an_optimizer_it_returns_the_loss_and_the_gradients():
    model, x, y = case()
    value, grads = nv.TrainingStep(model, loss_fn)(x, y)
    expected_value, expected = nn.value_and_grad(model, loss_fn)(model, x, y)
    assert mx.array_equal(value, expected_value).item()
    assert all(
        mx.array_equal(a, b).item() for (_, a), (_, b) in zip(tree_flatten(grads), tree_flatten(expected), strict=True)
    )


def test_it_traces_again_when_a_block_s_checkpointing_changes(compiled):
    model, x, y = case()
    step = nv.TrainingStep(model, loss_fn, optim.SGD(0.1))
    kinds = []
    for wrap in (False, True, False):
        nv.checkpoint_layers(model, enable=wrap)
        with nv.memory.timeline() as t:
            step(x, y)
        kinds.append([r.kind for r in t.readings])
    assert kinds[0] == kinds[2] == ["outputs"]  # nothing checkpointed: one evaluation
    assert kinds[1] == ["forward"] * 3 + ["backward", "update"] * 3 + ["outputs"]


def test_its_steps_leave_nothing_for_nv_eval_to_find_and_warn_of_nothing():
    model, x, y = case()
    nv.checkpoint_layers(model)
    step = nv.TrainingStep(model, loss_fn, optim.Adam(1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NotStagedWarning would raise
        for _ in range(20):  # more steps than the registry remembers
            step(x, y)
        del step
        import gc

        gc.collect()


def test_it_evaluates_with_its_own_settings(monkeypatch):
    model, x, y = case()
    nv.checkpoint_layers(model)
    seen, real = [], evaluate.staged
    monkeypatch.setattr(
        evaluate,
        "staged",
        lambda *a, **kw: seen.append((kw["throttle"], kw["ahead"], kw["synchronize"])) or real(*a, **kw),
    )
    step = nv.TrainingStep(model, loss_fn, optim.SGD(0.1), ahead=2, synchronize=True, throttle=1 << 20)
    step(x, y)
    lowest = step.replace(ahead=0)
    lowest(x, y)
    assert seen == [(1 << 20, 2, True), (1 << 20, 0, True)]
    assert lowest.model is model and lowest.optimizer is step.optimizer and step.ahead == 2


def test_a_snapshot_taken_before_the_optimizer_has_state_puts_it_back_every_time():
    """The put-back removes the moments the step made; MLX would reuse a trace begun without them and write
    its outputs back by position (on the third round, a moment into the random key)."""
    model, x, y = case()
    nv.checkpoint_layers(model, policy=None)
    step = nv.TrainingStep(model, lambda m, x, y: loss_fn(m, nn.Dropout(0.5)(x), y), optim.Adam(1e-2))
    undo, key = step.snapshot(), mx.random.state[0]
    losses = []
    for _ in range(3):
        losses.append(step(x, y).item())
        assert "layers" in step.optimizer.state and mx.random.state[0].shape == key.shape  # moments where they go
        undo()
        assert set(step.optimizer.state) == {"step", "learning_rate"}
        assert mx.random.state[0].shape == key.shape and mx.array_equal(mx.random.state[0], key).item()
    assert losses == [losses[0]] * 3


def test_a_snapshot_puts_the_model_optimizer_and_random_key_back():
    model, x, y = case()
    nv.checkpoint_layers(model, policy=None)
    step = nv.TrainingStep(model, lambda m, x, y: loss_fn(m, nn.Dropout(0.5)(x), y), optim.Adam(1e-2))
    step(x, y)
    undo = step.snapshot()
    before = parameters(model), [v for _, v in tree_flatten(step.optimizer.state)], mx.random.state[0]
    first = step(x, y)
    undo()
    assert all(a is b for a, b in zip(parameters(model), before[0], strict=True))
    assert all(a is b for a, b in zip([v for _, v in tree_flatten(step.optimizer.state)], before[1], strict=True))
    assert step(x, y).item() == first.item()  # the same draws, from the same weights and moments


def _saved(tree):
    """Copies of ``tree``'s arrays by path, as a run saves them (``mx.save_safetensors`` and back)."""
    flat = tree_flatten(tree)
    mx.eval([v for _, v in flat])
    return [(k, mx.array(v)) for k, v in flat]


@pytest.mark.parametrize("multi", [False, True], ids=["Adam", "MultiOptimizer"])
@pytest.mark.parametrize("compiled_step", [True, False], ids=["compiled", "eager"])
def test_a_run_resumed_the_mlx_way_trains_as_the_uninterrupted_run_bitwise(compiled, compiled_step, multi):
    """Weights put back with model.update and the optimizer's state with its setter (as mlx-lm resumes), the
    same step goes on from them: before, a compiled step kept the state it was built with."""

    def run(resume_after: int | None):
        model, x, y = case()
        nv.checkpoint_layers(model, policy=None)
        if multi:
            optimizer = optim.MultiOptimizer([optim.Adam(1e-2), optim.SGD(1e-2)], [lambda path, _: "bias" in path])
        else:
            optimizer = optim.Adam(1e-2)
        step = nv.TrainingStep(model, loss_fn, optimizer, compile=compiled_step)
        losses = [step(x, y).item() for _ in range(2)]
        if resume_after is not None:
            weights, state = _saved(model.parameters()), _saved(optimizer.state)
            for _ in range(resume_after):  # the run goes on, then stops; the saved one is resumed
                step(x, y)
            model.update(tree_unflatten(weights))
            optimizer.state = tree_unflatten(state)
        losses += [step(x, y).item() for _ in range(3)]
        return losses, parameters(model), [v for _, v in tree_flatten(optimizer.state)]

    expected, resumed = run(None), run(2)
    assert resumed[0] == expected[0]
    for a, b in zip(resumed[1] + resumed[2], expected[1] + expected[2], strict=True):
        assert mx.array_equal(a, b).item()


def _wrong_type_batch(model, x, y):
    return loss_fn(model, x, "not an array")


def _raising(model, x, y):
    raise RuntimeError("the loss failed")


def _not_a_scalar(model, x, y):
    return (model(x) - y) ** 2


@pytest.mark.parametrize("loss", [_raising, _wrong_type_batch, _not_a_scalar], ids=lambda f: f.__name__)
@pytest.mark.parametrize("compiled_step", [True, False], ids=["compiled", "eager"])
def test_a_first_call_that_raises_leaves_the_model_optimizer_and_random_key_as_they_were(compiled, compiled_step, loss):
    """A trace that raises inside mx.compile left MLX's placeholders in the model (an array without a
    primitive: any later use raised), and the optimizer's first moments made."""
    model, x, y = case()
    nv.checkpoint_layers(model, policy=None)
    optimizer = optim.Adam(1e-2)
    before, key = parameters(model), mx.random.state[0]
    step = nv.TrainingStep(model, loss, optimizer, compile=compiled_step)
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        step(x, y)
    assert all(a is b for a, b in zip(parameters(model), before, strict=True))
    mx.eval(parameters(model))  # placeholders would raise here
    assert set(optimizer.state) == {"step", "learning_rate"}
    assert mx.random.state[0] is key
    assert nv.TrainingStep(model, loss_fn, optimizer, compile=compiled_step)(x, y).item() > 0  # trains on


@pytest.mark.parametrize("way", ["compiled", "eager", "nv.compile"])
def test_a_first_step_peaks_no_higher_than_the_steps_after_it(compiled, way):
    """The state as it was before a first call, kept to put back a trace that raises, was held through the
    call's evaluation too: the old weights and moments stayed alive beside the new ones until the step ended,
    and a resumed run's first step rose by about all of them more than the steps after it."""
    mx.random.seed(0)
    model, x, y = Blocks(blocks=6, dim=256), mx.random.normal((8, 256)), mx.random.normal((8, 256))
    optimizer = optim.Adam(1e-3)
    optimizer.init(model.trainable_parameters())  # as a resumed run sets it
    mx.eval(model.parameters(), optimizer.state, x, y)
    nv.checkpoint_layers(model)
    state = sum(v.nbytes for v in parameters(model)) + sum(v.nbytes for _, v in tree_flatten(optimizer.state))
    if way == "nv.compile":
        step = by_hand(model, optimizer)
    else:
        step = nv.TrainingStep(model, loss_fn, optimizer, compile=way == "compiled")
    rises = []
    for _ in range(4):
        with nv.memory.measure() as m:
            step(x, y)
        rises.append(m.rise)
    assert rises[0] <= max(rises[1:]) + state / 4, (rises, state)


def test_a_loss_that_is_not_a_scalar_says_so():
    model, x, y = case()
    step = nv.TrainingStep(model, _not_a_scalar, optim.SGD(1e-2))
    with pytest.raises(ValueError, match=r"loss \(_not_a_scalar\) must return a scalar"):
        step(x, y)
