import mlx.core as mx
import pytest

import nuvec_mlx as nv
from tests.helpers import assert_close


def loss(xs):
    a, b, c = xs
    return (mx.sin(a) * b + c**2).sum()


XS = [mx.array([0.5, 1.0]), mx.array([2.0, -1.0]), mx.array([3.0, 4.0])]


@pytest.mark.parametrize("argnums", [0, [2], [0, 1, 2], [2, 0], [-1]], ids=str)
def test_value_and_grad_flat_matches_mx_value_and_grad(argnums):
    value, grads = nv.value_and_grad_flat(loss, argnums)(XS)
    idx = [argnums] if isinstance(argnums, int) else [a % 3 for a in argnums]
    ref_value = loss(XS)
    # One argnum at a time: the gradients come back in the order argnums names them.
    ref = [mx.grad(lambda *a: loss(list(a)), argnums=i)(*XS) for i in idx]
    assert_close(value, ref_value)
    assert_close(grads, list(ref))
    assert_close(nv.grad_flat(loss, argnums)(XS), list(ref))


def test_value_and_grad_flat_under_compile(compiled):
    vg = nv.value_and_grad_flat(loss, [1, 0])
    step = nv.compile_flat(lambda xs: [vg(xs)[0], *vg(xs)[1]])
    ref_value, ref = vg(XS)
    assert_close(step(XS), [ref_value, *ref])


@pytest.mark.parametrize(
    "argnums, error, match",
    [
        (3, ValueError, "out of range"),
        ([0, 0], ValueError, "more than once"),
        ([0, -3], ValueError, "more than once"),
        ([], ValueError, "at least one"),
        (1.0, TypeError, "argnums must be an int or a sequence"),
        (["a"], TypeError, "argnums must hold ints"),
    ],
    ids=["out of range", "repeated", "repeated negative", "empty", "float", "str"],
)
def test_bad_argnums_raise(argnums, error, match):
    with pytest.raises(error, match=match):
        nv.value_and_grad_flat(loss, argnums)(XS)


def test_gradient_of_an_integer_input_raises():
    with pytest.raises(ValueError, match=r"argnums selects xs\[0\] of dtype .*int"):
        nv.grad_flat(lambda xs: xs[1].sum(), 0)([mx.array([1, 2]), mx.ones((2,))])


def test_non_scalar_loss_raises():
    with pytest.raises(ValueError, match=r"must return a scalar \(shape \(\)\).*\(2,\)"):
        nv.grad_flat(lambda xs: xs[0] * 2, 0)([mx.ones((2,))])
    with pytest.raises(TypeError, match="must return a scalar mlx.core.array, got float"):
        nv.grad_flat(lambda xs: 1.0, 0)([mx.ones((2,))])


def test_non_array_inputs_raise():
    with pytest.raises(TypeError, match=r"xs\[1\] must be an mlx.core.array, got float"):
        nv.grad_flat(loss, 0)([mx.ones((2,)), 2.0, mx.ones((2,))])


def test_non_callable_loss_raises():
    with pytest.raises(TypeError, match="loss must be callable"):
        nv.value_and_grad_flat("loss", 0)


def test_an_eager_step_that_updates_a_model_is_staged_through_its_loss():
    import mlx.nn as nn
    import mlx.optimizers as optim

    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    model.layers = list(model.layers)
    nv.checkpoint_layers(model)
    opt = optim.SGD(0.1)
    x = mx.ones((4, 16))
    loss, grads = nv.value_and_grad(model, lambda m, x: (m(x) ** 2).sum())(model, x)
    opt.update(model, grads)
    del grads  # the optimizer consumed them: only the loss and the model's new state are left
    with nv.memory.timeline() as t:
        nv.eval(loss, model.parameters())
    assert [r.kind for r in t.readings] == ["forward"] * 3 + ["backward"] * 3 + ["outputs"]
