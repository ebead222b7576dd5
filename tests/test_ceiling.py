"""nv.memory.ceiling: a staged evaluation stops at the first stage above it, and the step's state is put back."""

import gc
import re

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

import nuvec_mlx as nv

MiB = 1 << 20


class Blocks(nn.Module):
    def __init__(self, dim: int = 64, blocks: int = 6):
        super().__init__()
        self.layers = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.Tanh(), nn.Linear(4 * dim, dim)) for _ in range(blocks)]

    def __call__(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def training_step():
    gc.collect()  # an earlier test's compiled step (a reference cycle) must not be freed mid-test
    mx.random.seed(0)
    model = Blocks()
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


def test_a_step_above_the_ceiling_stops_at_its_first_stage_above_and_puts_the_state_back(compiled):
    model, opt, state, step = training_step()
    x = mx.random.normal((1024, 64))
    nv.eval(step(x), state)  # compile, and give AdamW its first step
    with nv.memory.timeline() as t:
        nv.eval(step(x), state)
    ceiling = int(mx.get_active_memory() + 0.5 * (t.peak().peak - mx.get_active_memory()))
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


def test_an_evaluation_below_the_ceiling_is_not_stopped(compiled):
    model, opt, state, step = training_step()
    with nv.memory.ceiling(mx.get_active_memory() + 256 * MiB):
        nv.eval(step(mx.random.normal((64, 64))), state)


@pytest.mark.parametrize("nbytes, error", [(-1, ValueError), (1.5, TypeError), ("1G", TypeError)])
def test_a_ceiling_that_is_not_bytes_raises(nbytes, error):
    with pytest.raises(error, match="nbytes"):
        with nv.memory.ceiling(nbytes):
            pass


def test_after_a_stop_the_same_ceiling_lets_a_smaller_step_run(compiled):
    model, opt, state, step = training_step()
    x = mx.random.normal((1024, 64))
    nv.eval(step(x), state)
    with nv.memory.timeline() as t:
        nv.eval(step(x), state)
    ceiling = int(mx.get_active_memory() + 0.5 * (t.peak().peak - mx.get_active_memory()))
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
    x = mx.random.normal((1024, 64))
    with nv.memory.timeline() as t:
        nv.eval(vg(model, x))
    ceiling = int(mx.get_active_memory() + 0.5 * (t.peak().peak - mx.get_active_memory()))
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
