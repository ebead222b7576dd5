import mlx.core as mx
import mlx.nn as nn
import pytest

import nuvec_mlx as nv
from tests.helpers import assert_close


def test_compile_flat_traces_once_for_repeated_shapes(compiled):
    step = nv.compile_flat(lambda xs: [xs[0] + xs[1], xs[0] * xs[1]])
    for _ in range(3):
        out = step([mx.ones((3,)), mx.full((3,), 2.0)])
    assert step.traces == 1
    assert isinstance(out, list)
    assert_close(out, [mx.full((3,), 3.0), mx.full((3,), 2.0)])


def test_compile_flat_advances_the_random_state_like_eager(compiled):
    step = nv.compile_flat(lambda xs: [xs[0] + mx.random.uniform(shape=(3,))])
    mx.random.seed(5)
    first, second = step([mx.zeros((3,))])[0], step([mx.zeros((3,))])[0]
    mx.random.seed(5)
    assert_close(first, mx.random.uniform(shape=(3,)))
    assert_close(second, mx.random.uniform(shape=(3,)))


def test_non_array_inputs_raise():
    with pytest.raises(TypeError, match="xs must be a list or tuple"):
        nv.compile_flat(lambda xs: xs)(mx.ones((2,)))


def test_compiled_fn_returning_non_arrays_raises():
    with pytest.raises(TypeError, match="returned by fn"):
        nv.compile_flat(lambda xs: xs[0])([mx.ones((2,))])


def test_non_callables_raise():
    with pytest.raises(TypeError, match="fn must be callable"):
        nv.compile_flat(None)


def test_a_compiled_step_and_what_its_function_captures_go_with_its_last_reference(compiled):
    import gc

    gc.collect()
    gc.disable()  # freed by reference counting alone, not by a collection that happens to run
    try:
        before = nv.memory.stats().active

        def run():
            """A compiled step and the 4 MiB its function captures, made here: gone when this returns."""
            big = mx.ones((1 << 20,))
            mx.eval(big)
            step = nv.compile(lambda x: x + big)
            mx.eval(step(mx.ones((1 << 20,))))
            return step.traces

        assert run() == 1
        assert nv.memory.stats().active - before < 4096, "the step and its capture outlived their last reference"
    finally:
        gc.enable()


def test_a_first_call_that_raises_puts_the_state_it_reads_back(compiled):
    """mx.compile leaves its placeholders in the state of a trace that raises: any later use of the model
    raised 'Attempting to eval an array without a primitive'."""
    model = nn.Linear(4, 4)
    mx.eval(model.parameters())
    before = model.weight
    state = [model.state]

    @nv.compile(inputs=state, outputs=state)
    def step(x):
        if x.ndim != 2:
            raise ValueError("a batch of rows")
        return model(x).sum()

    with pytest.raises(ValueError, match="a batch of rows"):
        step(mx.ones((4,)))
    assert model.weight is before
    assert step(mx.ones((2, 4))).item() == model(mx.ones((2, 4))).sum().item()
