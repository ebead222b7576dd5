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


def _value_and_grads(f, x, w):
    """The value of ``f(x, w)[0].sum()`` and its gradients for x and w."""
    return mx.value_and_grad(lambda x, w: f(x, w)[0].sum(), argnums=[0, 1])(x, w)


@pytest.mark.parametrize(
    "extra",
    [lambda h: None, lambda h: 3, lambda h: (h.shape[0], "cache", None), lambda h: {"offset": 0, "kv": None}],
    ids=["None", "int", "tuple of statics", "dict of statics"],
)
def test_non_array_outputs_pass_through_with_exact_gradients(extra):
    x, w = mx.random.normal((3, 4), key=mx.random.key(0)), mx.random.normal((4, 4), key=mx.random.key(1))

    def layer(x, w):
        h = mx.tanh(x @ w)
        return h, extra(h)

    out = nv.checkpoint(layer)(x, w)
    assert out[1] == extra(x)
    assert_close(out[0], layer(x, w)[0])
    value, grads = _value_and_grads(nv.checkpoint(layer), x, w)
    ref_value, ref_grads = _value_and_grads(layer, x, w)
    assert_close(value, ref_value)
    assert_close(grads, ref_grads)


def test_a_python_object_output_is_passed_through_as_the_same_object():
    cache = object()
    x = mx.ones((2,))
    out, same = nv.checkpoint(lambda x, c: (x * 2, c))(x, cache)
    assert same is cache
    grad = mx.grad(lambda x: nv.checkpoint(lambda x, c: (x * x, c))(x, cache)[0].sum())(x)
    assert_close(grad, 2 * x)


def test_a_function_returning_no_arrays_runs_once_and_returns_its_value():
    calls = []

    def count(x):
        calls.append(1)
        return len(calls)

    assert nv.checkpoint(count)(mx.ones((2,))) == 1
    assert nv.checkpoint_flat(lambda xs: [])([mx.ones((2,))]) == []


def test_non_array_outputs_that_change_on_recomputation_raise():
    calls = []

    def layer(x):
        calls.append(1)
        return x * 2, len(calls)

    with pytest.raises(ValueError, match="not arrays must be equal"):
        mx.grad(lambda x: nv.checkpoint(layer)(x)[0].sum())(mx.ones((2,)))


def test_a_module_passed_as_an_argument_reaches_fn_as_the_module_and_is_differentiated():
    lin = nn.Linear(4, 4)
    x = mx.random.normal((2, 4), key=mx.random.key(2))
    f = nv.checkpoint(lambda m, x: mx.tanh(m(x)))
    assert_close(f(lin, x), mx.tanh(lin(x)))
    loss = lambda model, x: f(model, x).sum()
    ref = lambda model, x: mx.tanh(model(x)).sum()
    grads = nn.value_and_grad(lin, loss)(lin, x)[1]
    ref_grads = nn.value_and_grad(lin, ref)(lin, x)[1]
    assert_close([grads["weight"], grads["bias"]], [ref_grads["weight"], ref_grads["bias"]])
    assert mx.abs(grads["weight"]).max().item() > 0
    # The module as a keyword argument, and the same module twice.
    g = nv.checkpoint(lambda x, *, m, again: again(m(x)))
    grads = nn.value_and_grad(lin, lambda model, x: g(x, m=model, again=model).sum())(lin, x)[1]
    ref_grads = nn.value_and_grad(lin, lambda model, x: model(model(x)).sum())(lin, x)[1]
    assert_close(grads["weight"], ref_grads["weight"], 1e-5)
