import mlx.core as mx
import mlx.nn as nn
import pytest

import nuvec_mlx as nv
from tests.helpers import assert_close


def test_pytree_args_kwargs_static_and_int():
    x = mx.random.normal((3, 4)); w = mx.random.normal((4, 4))
    idx = mx.array([0, 2])

    def f(x, p, idx, scale=2.0, mode="tanh"):
        h = getattr(mx, mode)(x @ p["w"][0]) * scale
        return {"h": (h[idx],)}

    g = nv.checkpoint(f)
    L = lambda fn: (lambda x, w: fn(x, {"w": [w]}, idx, scale=3.0)["h"][0].sum())
    assert_close(mx.grad(L(g), argnums=[0, 1])(x, w), mx.grad(L(f), argnums=[0, 1])(x, w), 1e-5)


def test_decorator_and_captured_module_gets_gradients():
    lin = nn.Linear(4, 4)

    @nv.checkpoint
    def f(x):
        return mx.tanh(lin(x))

    x = mx.random.normal((2, 4))
    loss = lambda m, x: f(x).sum()
    ref = lambda m, x: mx.tanh(lin(x)).sum()
    g = nn.value_and_grad(lin, loss)(lin, x)[1]
    g0 = nn.value_and_grad(lin, ref)(lin, x)[1]
    assert_close(g["weight"], g0["weight"], 1e-5)
    assert mx.abs(g["weight"]).max().item() > 0


def test_captured_array_raises():
    w = mx.ones((4,))
    with pytest.raises(ValueError, match="captures floating-point"):
        nv.checkpoint(lambda x: x * w)


def test_allow_captured_makes_a_captured_array_a_constant():
    x, w = mx.array([1.0, -2.0, 3.0]), mx.array([0.5, 4.0, -1.0])

    def loss(x, w, checkpointed):
        f = lambda x: mx.sin(x * w)
        f = nv.checkpoint(f, allow_captured=True) if checkpointed else f
        return f(x).sum()

    assert_close(nv.checkpoint(lambda x: mx.sin(x * w), allow_captured=True)(x), mx.sin(x * w))
    gx, gw = mx.grad(loss, argnums=[0, 1])(x, w, True)
    assert_close(gx, mx.grad(loss)(x, w, False))  # the argument is differentiated
    assert mx.array_equal(gw, mx.zeros_like(w)).item()  # the captured array is a constant
    assert not mx.array_equal(mx.grad(loss, argnums=1)(x, w, False), mx.zeros_like(w)).item()


def test_errors():
    with pytest.raises(TypeError, match="fn must be callable"):
        nv.checkpoint(3)
    with pytest.raises(TypeError, match="must return arrays"):
        nv.checkpoint(lambda x: [x, "a"])(mx.ones(2))


def test_dropout_masks_identical_eager_and_compiled(compiled):
    drop = nn.Dropout(0.5)
    seen = []

    def f(x):
        y = drop(x)
        seen.append(y)
        return y * 2

    g = nv.checkpoint(f)
    x = mx.ones((64,))
    grad = mx.grad(lambda x: g(x).sum())(x)
    mx.eval(grad, seen)
    fwd, rec = seen[-2], seen[-1]
    assert mx.array_equal(fwd, rec).item()
    assert_close(grad, (fwd != 0) * 4.0)

    # Under compile: out = 4 * mask(forward), grad = 4 * mask(recompute).
    state = [mx.random.state]

    def both(x):
        out, vjp = mx.vjp(lambda x: g(x), [x], [mx.ones_like(x)])
        return out[0], vjp[0]

    cstep = mx.compile(both, inputs=state, outputs=state)
    out1, grad1 = cstep(x)
    out2, grad2 = cstep(x)
    mx.eval(out1, grad1, out2, grad2)
    assert mx.array_equal(out1, grad1).item()
    assert mx.array_equal(out2, grad2).item()
    assert not mx.array_equal(out1, out2).item()  # the random state advanced
