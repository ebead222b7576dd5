"""Flat-function transforms: compile a step, differentiate a loss.

A *flat* function takes a list of arrays and returns a list of arrays (or, for a
loss, one scalar array). This is nuvec's calling convention: no pytrees to
flatten on the hot path, and positions (``argnums``) name what to differentiate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from . import _validate
from .checkpoint import _key_list, constant_inputs

FlatFn = Callable[[list[mx.array]], Sequence[mx.array]]
LossFn = Callable[[list[mx.array]], mx.array]


class CompiledFlat:
    """A flat function compiled with :func:`mlx.core.compile`.

    Calls take and return lists of arrays. ``mx.random.state`` is part of the
    compiled state, so random draws inside the step advance it as they would
    uncompiled. ``traces`` counts how often the Python function was traced:
    it stays at 1 over repeated calls with the same shapes when compilation
    really happened, and grows with every call when MLX skipped compilation
    (on Linux CPU without ``g++`` on ``PATH``, or under
    :func:`mlx.core.disable_compile`).
    """

    def __init__(self, fn: FlatFn):
        self._fn = fn
        self.traces = 0
        state = [mx.random.state]
        self._compiled = mx.compile(self._trace, inputs=state, outputs=state)

    def _trace(self, *xs: mx.array) -> tuple[mx.array, ...]:
        self.traces += 1
        return tuple(_validate.outputs(self._fn(list(xs)), self._fn))

    def __call__(self, xs: Sequence[mx.array]) -> list[mx.array]:
        xs = _validate.array_list(xs, "xs")
        # While tracing, mx.compile swaps the random key for a placeholder; if
        # the trace raises, MLX leaves the placeholder behind and every later
        # draw fails. Put the caller's key back.
        state = _key_list()
        saved = state[0]
        try:
            return list(self._compiled(*xs))
        except BaseException:
            state[0] = saved
            raise


def compile_flat(fn: FlatFn) -> CompiledFlat:
    """Compile a flat function.

    Args:
        fn: ``list[mx.array] -> list[mx.array]``.

    Returns:
        A callable ``step(xs) -> list[mx.array]`` with the values of ``fn``.

    Example:
        >>> step = nv.compile_flat(lambda xs: [xs[0] * 2 + xs[1]])
        >>> step([mx.array(1.0), mx.array(3.0)])
        [array(5, dtype=float32)]
    """
    _validate.callable_(fn, "fn")
    return CompiledFlat(fn)


def value_and_grad_flat(
    loss: LossFn, argnums: int | Sequence[int]
) -> Callable[[Sequence[mx.array]], tuple[mx.array, list[mx.array]]]:
    """Return a function computing a loss and its gradients for some inputs.

    Args:
        loss: ``list[mx.array] -> mx.array`` returning a scalar.
        argnums: the positions in ``xs`` to differentiate, an int or a sequence.

    Returns:
        ``vg(xs) -> (value, grads)`` with one gradient for each entry of
        ``argnums``, in that order. Inputs not in ``argnums`` are constants, and
        checkpoints inside ``loss`` compute no gradient for them.

    Example:
        >>> vg = nv.value_and_grad_flat(lambda xs: (xs[0] * xs[1]).sum(), [1])
        >>> vg([mx.array(2.0), mx.array(3.0)])
        (array(6, dtype=float32), [array(2, dtype=float32)])
    """
    _validate.callable_(loss, "loss")
    _validate.argnums(argnums, None)  # fail at construction, not at the first call

    def value_and_grad(xs: Sequence[mx.array]) -> tuple[mx.array, list[mx.array]]:
        xs = _validate.array_list(xs, "xs")
        idx = _validate.argnums(argnums, len(xs))
        for i in idx:
            if not _validate.is_differentiable(xs[i]):
                raise ValueError(
                    f"argnums selects xs[{i}] of dtype {xs[i].dtype}; "
                    "gradients need a floating-point input"
                )

        def selected_loss(*selected: mx.array) -> mx.array:
            full = list(xs)
            for i, x in zip(idx, selected):
                full[i] = x
            with constant_inputs([full[j] for j in range(len(full)) if j not in idx]):
                value = loss(full)
            return _validate.scalar(value, loss)

        vg = mx.value_and_grad(selected_loss, argnums=list(range(len(idx))))
        value, grads = vg(*(xs[i] for i in idx))
        # mx.value_and_grad returns a bare array for a single argnum.
        return value, [grads] if len(idx) == 1 else list(grads)

    return value_and_grad


def grad_flat(
    loss: LossFn, argnums: int | Sequence[int]
) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """Like :func:`value_and_grad_flat`, returning the gradients only.

    Example:
        >>> nv.grad_flat(lambda xs: (xs[0] ** 2).sum(), 0)([mx.array(3.0)])
        [array(6, dtype=float32)]
    """
    vg = value_and_grad_flat(loss, argnums)
    return lambda xs: vg(xs)[1]
