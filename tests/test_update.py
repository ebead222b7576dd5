"""nv.update: an optimizer's update, each checkpointed block's part a stage right after its backward stage."""

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB
from tests.helpers import Blocks, mean_square


def training(update, blocks=4, dim=64, checkpointed=True, compiled=True, batch=8):
    """A model, its Adam, a batch, and a step that updates them with ``update(optimizer, model, grads)``.

    With the default batch each block's weights outweigh its activations; with
    ``batch=2048`` they are a small part of them, as LoRA's adapters are.
    """
    mx.random.seed(0)
    model = Blocks(blocks, dim)
    if checkpointed:
        nv.checkpoint_layers(model)
    optimizer = optim.Adam(1e-2)
    optimizer.init(model.trainable_parameters())
    x = mx.random.normal((batch, dim))
    state = [model.state, optimizer.state]
    mx.eval(state, x)

    def step():
        loss, grads = nv.value_and_grad(model, mean_square)(model, x)
        update(optimizer, model, grads)
        return loss

    return model, optimizer, state, nv.compile(step, inputs=state, outputs=state) if compiled else step


def optimizer_update(optimizer, model, grads):
    optimizer.update(model, grads)


def test_each_blocks_update_is_a_stage_right_after_its_backward_stage(compiled):
    *_, state, step = training(nv.update)
    nv.eval(step(), state)
    with nv.memory.timeline() as t:
        nv.eval(step(), state)
    backward_then_update = [(kind, b) for b in (4, 3, 2, 1) for kind in ("backward", "update")]
    assert [(r.kind, r.block) for r in t.readings] == [
        *(("forward", b) for b in (1, 2, 3, 4)),
        *backward_then_update,
        ("outputs", None),
    ]
    assert t.readings[5].name() == "update of block 4's parameters"


def test_an_update_small_beside_its_backward_stage_is_computed_in_the_stage_after(compiled):
    """The blocks' weights (17 KiB) are under 1/8 of their backward stages (512 KiB of gradient for the
    activations): no update stages; block 1's update, the last, is computed with the outputs."""
    *_, state, step = training(nv.update, batch=2048)
    nv.eval(step(), state)
    with nv.memory.timeline() as t:
        nv.eval(step(), state)
    assert [(r.kind, r.block) for r in t.readings] == [
        *(("forward", b) for b in (1, 2, 3, 4)),
        *(("backward", b) for b in (4, 3, 2, 1)),
        ("outputs", None),
    ]


# The reference, optimizer.update inside nv.compile, runs unstaged on purpose (and says so).
@pytest.mark.filterwarnings("ignore::nuvec_mlx.NotStagedWarning")
@pytest.mark.parametrize("batch", [8, 2048], ids=["update-stages", "folded"])
@pytest.mark.parametrize("checkpointed", [True, False], ids=["checkpointed", "unchecked"])
@pytest.mark.parametrize("is_compiled", [True, False], ids=["compiled", "eager"])
def test_parameters_and_optimizer_state_are_the_optimizers_update(batch, checkpointed, is_compiled, compiled):
    runs = []
    for update in (optimizer_update, nv.update):
        model, optimizer, state, step = training(update, checkpointed=checkpointed, compiled=is_compiled, batch=batch)
        losses = []
        for _ in range(3):
            losses.append(step())
            nv.eval(losses[-1], state)
        runs.append(([loss.item() for loss in losses], tree_flatten(model.parameters()), tree_flatten(optimizer.state)))
    (losses, params, moments), (our_losses, our_params, our_moments) = runs
    assert our_losses == losses
    for (name, a), (our_name, b) in zip(params + moments, our_params + our_moments):
        assert name == our_name and mx.array_equal(a, b).item(), name


def test_without_checkpoints_there_are_no_update_stages(compiled):
    *_, state, step = training(nv.update, checkpointed=False)
    with nv.memory.timeline() as t:
        nv.eval(step(), state)
    assert [r.kind for r in t.readings] == ["outputs"]


def step_peak(update) -> float:
    """The compiled step's peak above the memory held before it, in MiB (cache cleared, after a warm step)."""
    model, optimizer, state, step = training(update, blocks=16, dim=256)
    nv.eval(step(), state)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    nv.eval(step(), state)
    mx.synchronize()
    return (mx.get_peak_memory() - before) / MiB


@pytest.mark.filterwarnings("ignore::nuvec_mlx.NotStagedWarning")  # the unstaged step, on purpose
def test_a_block_at_a_time_the_step_keeps_a_fraction_of_the_gradients_alive(compiled):
    """Updated after the backward pass, every gradient (16 blocks of 0.25 MiB) is alive at once; a block
    at a time, about one block's gradients, new weights and moments (1 MiB). MLX's CUDA backend frees a
    stage's buffers on its completion worker, after ``nv.eval`` has gone on: 2.0 MiB on an H200 (1.1 on
    the CPU), where the unstaged step peaked at 17.6."""
    gradients = 17 * (256 * 256 + 256) * 4 / MiB  # the 16 blocks and the head
    unstaged, staged = step_peak(optimizer_update), step_peak(nv.update)
    assert unstaged >= 0.9 * gradients
    assert staged <= (0.6 if mx.default_device().type == mx.gpu else 0.4) * gradients, (staged, unstaged)


def test_bad_arguments_raise_and_leave_the_model_alone():
    model, optimizer, *_ = training(nv.update, compiled=False)
    before = tree_flatten(model.parameters())
    with pytest.raises(TypeError, match="optimizer must be an mlx.optimizers.Optimizer"):
        nv.update(object(), model, {})
    with pytest.raises(TypeError, match="model must be"):
        nv.update(optimizer, object(), {})
    assert all(a is b for (_, a), (_, b) in zip(before, tree_flatten(model.parameters())))
