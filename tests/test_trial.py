"""What the planner, nv.largest_fit and nv.saved_activations measure is put back in place: the user's
optimizer (a MultiOptimizer too), model and state dicts are the same objects after, and steps compiled
before keep updating them."""

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from tests.helpers import WideBlocks, readme_step


def loss_fn(model, x):
    return (model(x) ** 2).mean()


def multi_optimizer() -> optim.MultiOptimizer:
    """Adam for the weights, SGD with momentum for the biases."""
    return optim.MultiOptimizer([optim.Adam(1e-3), optim.SGD(1e-2, momentum=0.9)], [lambda name, _: "weight" in name])


MEASURES = {
    "plan": lambda step, x: nv.plan(
        step, x, 1 << 40, policies=[nv.policies.save_nothing], corrections=0, progress=False
    ),
    "largest_fit": lambda step, x: nv.largest_fit(
        step, lambda n: x[:n], 1 << 40, sizes=(8, 16), tries=1, progress=False
    ),
    "saved_activations": lambda step, x: nv.saved_activations(step, x, measure=True),
}


def dicts(tree: dict) -> list[int]:
    """The identities of ``tree`` and of the dicts nested in it."""
    return [id(tree), *(i for v in tree.values() if isinstance(v, dict) for i in dicts(v))]


def containers(opt: optim.MultiOptimizer) -> list[int]:
    """The identities of the optimizer's state dicts (its ``state`` property builds a new dict around them)."""
    return [i for o in opt.optimizers for i in dicts(o.state)]


@pytest.mark.parametrize("measure", MEASURES)
def test_a_step_compiled_before_keeps_updating_a_multi_optimizer_s_state_and_retraces(compiled, measure):
    mx.random.seed(0)
    model = WideBlocks(dim=32, hidden=64, blocks=3)
    nv.checkpoint_layers(model)
    opt = multi_optimizer()
    opt.init(model.trainable_parameters())
    mx.eval(model.parameters(), opt.state)
    _, run = readme_step(model, loss_fn, opt)

    x = mx.random.normal((64, 32), key=mx.random.key(1))
    before = containers(opt)
    parameters = [(k, v.tolist()) for k, v in tree_flatten(model.parameters())]
    MEASURES[measure](nv.TrainingStep(model, loss_fn, opt), x)
    assert containers(opt) == before  # the same dicts, which the compiled step holds
    assert [(k, v.tolist()) for k, v in tree_flatten(model.parameters())] == parameters
    for _ in range(2):
        run(x)
    assert opt.optimizers[0].state["step"].item() == 2 and opt.optimizers[1].state["step"].item() == 2
    run(x[:32])  # another shape: traced again, with the state it holds
    assert opt.optimizers[0].state["step"].item() == 3
