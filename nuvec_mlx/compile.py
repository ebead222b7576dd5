"""Compiled steps: :func:`mlx.core.compile` for flat functions.

A *flat* function takes a list of arrays and returns a list of arrays. This is
nuvec's calling convention: no pytrees to flatten on the hot path, and
positions name what to differentiate (:mod:`nuvec_mlx.grad`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from . import _random, _stages, _validate

FlatFn = Callable[[list[mx.array]], Sequence[mx.array]]


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

    def _trace(self, *xs: mx.array) -> tuple[list[mx.array], list[mx.array]]:
        self.traces += 1
        with _stages.collecting() as stages:
            out = _validate.check_outputs(self._fn(list(xs)), self._fn)
        return out, list(stages)  # the stages come out as hidden outputs

    def __call__(self, xs: Sequence[mx.array]) -> list[mx.array]:
        xs = _validate.check_array_list(xs, "xs")
        # A trace that raises leaves MLX's placeholder key behind.
        with _random.restored_on_error():
            out, stages = self._compiled(*xs)
        _stages.hand_on(out, stages)
        return list(out)


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
    _validate.check_callable(fn, "fn")
    return CompiledFlat(fn)
