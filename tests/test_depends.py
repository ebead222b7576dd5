"""Dependencies that every transform understands (nuvec_mlx._depends)."""

import mlx.core as mx

from nuvec_mlx import _depends
from tests.helpers import assert_close, assert_evaluated, lazy_arrays

KiB = 1 << 10


def test_the_outputs_are_the_inputs_and_evaluating_them_evaluates_the_dependencies():
    (x,), deps = lazy_arrays(KiB), lazy_arrays(64 * KiB, 2)
    mx.synchronize()
    before = mx.get_active_memory()
    (y,) = _depends.depends([x], deps)
    mx.eval(y)
    assert_evaluated(before, KiB + 2 * 64 * KiB)
    assert_close(y, x)


def test_nothing_to_depend_on_returns_the_inputs():
    x = mx.ones((2,))
    assert _depends.depends([x], [])[0] is x


def _f(x, d):
    return (mx.sin(_depends.depends([x * x], [d])[0]) * d.sum()).sum()


def _plain(x, d):
    return (mx.sin(x * x) * d.sum()).sum()


def test_gradients_jvps_vmaps_and_their_compositions_equal_those_without_the_dependency():
    x, d = mx.array([0.3, -1.2, 2.0]), mx.array([1.5, 0.5])
    v = mx.array([1.0, 2.0, -1.0])
    batch = mx.stack([x, 2 * x, -x])

    def transformed(f):
        return [
            *mx.grad(f, argnums=[0, 1])(x, d),
            mx.jvp(lambda x: f(x, d), [x], [v])[1][0],
            mx.vmap(f, in_axes=(0, None))(batch, d),
            mx.vmap(mx.grad(f), in_axes=(0, None))(batch, d),
            mx.jvp(lambda x: mx.grad(f)(x, d), [x], [v])[1][0],
        ]

    assert_close(transformed(_f), transformed(_plain))


def test_an_unbatched_input_comes_out_of_vmap_usable_by_every_op():
    """MLX 0.32's expand_dims misreads an unbatched array that a custom vmap rule returned: the rules here
    return it broadcast along the batch."""
    x, ids = mx.random.normal((3, 2, 4)), mx.arange(2)

    def f(x):
        x, ids_ = _depends.depends([x, ids], [x])
        return x * ids_[..., None]

    got = mx.vmap(f)(x)
    assert_close(got, x * ids[..., None], 0)
    also = mx.vmap(lambda x: _depends.also_into([x, ids], [x])[1][..., None] + x.sum())(x)
    assert also.shape == (3, 2, 1)
