"""After an exception raised on purpose, MLX's settings and nuvec's throttle are back."""

import mlx.core as mx
import pytest

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB
from tests.helpers import unstaged_on_purpose


def snapshot():
    device = mx.default_device()
    return {
        "limit": mx.get_memory_limit(),
        "throttle": nv.memory.current_throttle(),
        "device": device,
        "stream": mx.default_stream(device),
        "key": mx.random.state[0].tolist(),  # fails if the key is a dangling tracer
    }


class Boom(Exception):
    pass


def test_exception_inside_eval_restores_settings(monkeypatch):
    mx.random.seed(1)
    before = snapshot()
    real_eval = mx.eval

    def eval_then_raise(*args):
        real_eval(*args)
        raise Boom("during evaluation")

    monkeypatch.setattr(mx, "eval", eval_then_raise)
    with pytest.raises(Boom):
        nv.eval([mx.ones((64,)) * 2], throttle=0)
    assert snapshot() == before


def test_exception_inside_throttle_context_restores_settings():
    before = snapshot()
    with pytest.raises(Boom):
        with nv.memory.throttle(7):
            assert nv.memory.current_throttle() == 7
            nv.eval(mx.ones((8,)))
            raise Boom("inside the throttle")
    assert snapshot() == before


def raising_when_recomputed():
    calls = []

    def fn(xs):
        calls.append(1)
        if len(calls) > 1:
            raise Boom("only in the backward pass")
        return [mx.tanh(xs[0]) * mx.random.uniform(shape=xs[0].shape)]

    return nv.checkpoint_flat(fn)


def loss_of(block):
    return lambda xs: block(xs)[0].sum()


@unstaged_on_purpose
@pytest.mark.parametrize("compile_step", [False, True], ids=["eager", "compiled"])
def test_exception_while_recomputing_in_backward_restores_settings(compile_step, compiled):
    def run(block):
        vg = nv.grad_flat(loss_of(block), 0)
        step = nv.compile_flat(vg) if compile_step else vg
        with nv.memory.throttle(3 * MiB):
            return step([mx.ones((4,))])

    # Reference: the same forward pass, no exception: the key it leaves behind.
    mx.random.seed(5)
    run(nv.checkpoint_flat(lambda xs: [mx.tanh(xs[0]) * mx.random.uniform(shape=xs[0].shape)]))
    expected_key = mx.random.state[0].tolist()

    mx.random.seed(5)
    before = snapshot()
    with pytest.raises(Boom, match="backward"):
        run(raising_when_recomputed())
    after = snapshot()
    if compile_step:
        # A failed trace commits no random draws.
        assert after == before
    else:
        assert after == {**before, "key": expected_key}
    mx.random.uniform(shape=(2,)).tolist()  # random draws still work


def test_failed_compiled_trace_leaves_the_random_key_usable(compiled):
    mx.random.seed(2)
    before = snapshot()
    step = nv.compile_flat(lambda xs: [xs[0] + mx.random.uniform(shape=(2,)) + xs[0].reshape(3)])
    with pytest.raises(ValueError):
        step([mx.ones((2,))])
    assert snapshot() == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lazy_inputs", [False, True], ids=["evaluated inputs", "lazy inputs"])
def test_zero_throttle_completes_a_compiled_checkpointed_step(lazy_inputs, compiled):
    ck = nv.checkpoint_flat(lambda xs: [xs[0] + mx.tanh(xs[0] @ xs[1])])
    grad = nv.compile_flat(nv.grad_flat(lambda xs: ck(ck(xs) + xs[1:])[0].sum(), [0, 1]))
    k = mx.random.split(mx.random.key(3), 2)
    xs = [mx.random.normal((64, 32), key=k[0]), mx.random.normal((32, 32), key=k[1]) * 0.1]
    expected = grad(xs)
    nv.eval(expected)
    if not lazy_inputs:
        mx.eval(xs)
    else:
        xs = [x * 1 for x in xs]  # unevaluated: even the inputs exceed the throttle
    limit = mx.get_memory_limit()
    out = grad(xs)
    nv.eval(out, throttle=0)
    assert mx.get_memory_limit() == limit
    for a, e in zip(out, expected):
        assert mx.array_equal(a, e).item()
