"""Compiled steps: :func:`mlx.core.compile`, carrying a step's stages out of the trace.

Checkpoints mark stages while a gradient is built (:mod:`nuvec_mlx._marks`).
Inside :func:`mlx.core.compile` they are built once, at trace time, so the
compiled function returns them as hidden extra outputs, and each call
registers its own with what it returns and with the state it updates: then
:func:`nuvec_mlx.eval` of the step's results evaluates the step block by
block. :func:`compile` takes what :func:`mlx.core.compile` takes;
:func:`compile_flat` is the form for flat functions (lists of arrays in and
out), with the random state as compile state.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from . import _ceiling, _marks, _pytree, _random, _registry, _state, _validate

FlatFn = Callable[[list[mx.array]], Sequence[mx.array]]


class _Trace:
    """The function MLX traces: ``fn``, its stages returned as hidden outputs, its traces counted,
    and the optimizers whose update it staged (:func:`nuvec_mlx.update`): their state is the step's."""

    def __init__(self, fn: Callable):
        self.fn, self.count = fn, 0
        self.optimizers: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, list[mx.array]]:
        self.count += 1
        with _marks.collecting() as stages:
            out = self.fn(*args, **kwargs)
            self.optimizers = _marks.optimizers()
        return out, list(stages)


class Compiled:
    """A function compiled with :func:`mlx.core.compile`, its stages carried out of the trace.

    Calls take and return what the function takes and returns. ``traces``
    counts how often the Python function was traced: it stays at 1 over
    repeated calls with the same shapes when compilation really happened, and
    grows with every call when MLX skipped compilation (on Linux CPU without
    ``g++`` on ``PATH``, or under :func:`mlx.core.disable_compile`).
    """

    def __init__(self, fn: Callable, inputs: Any = None, outputs: Any = None, shapeless: bool = False):
        _validate.check_callable(fn, "fn")
        _validate.check_bool(shapeless, "shapeless")
        functools.update_wrapper(self, fn)
        self._inputs, self._outputs = inputs, outputs
        # What MLX compiles must not refer back to self: a reference cycle
        # would keep the step (and what its function captures) alive until the
        # garbage collector runs, instead of until its last reference goes.
        self._trace = _Trace(fn)
        self._compile = functools.partial(mx.compile, inputs=inputs, outputs=outputs, shapeless=shapeless)
        self._compiled = self._compile(self._trace)
        self._signatures: set[tuple] = set()  # of the calls run since the trace (_pytree.signature)

    @property
    def traces(self) -> int:
        """How often the Python function was traced."""
        return self._trace.count

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A call that traces (the first, or one with new shapes) and raises leaves MLX's placeholders in
        # the state it reads: it puts the state back. Under a ceiling, an evaluation stopped part-way too;
        # outside one the state as it was is not handed on to the evaluation, where it would stay alive
        # beside the updated state until the step ends.
        signature = _pytree.signature((args, kwargs))
        fresh = signature not in self._signatures
        stoppable = _ceiling.current() is not None
        undo = self._snapshot() if fresh or stoppable else None
        try:
            out, stages = self.call_staged(*args, **kwargs)
        except BaseException:
            if undo is not None:
                undo()
            raise
        self._signatures.add(signature)
        results = _pytree.arrays([out, self._outputs])
        _registry.hand_on(results, stages, undo if stoppable else None)
        return out

    def call_staged(self, *args: Any, **kwargs: Any) -> tuple[Any, list[mx.array]]:
        """The call's results and its stages, registered nowhere: for a caller that evaluates
        the stages itself (:class:`nuvec_mlx.TrainingStep`)."""
        # A trace that raises leaves MLX's placeholder key behind.
        with _random.restored_on_error():
            return self._compiled(*args, **kwargs)

    def _snapshot(self) -> Callable[[], None]:
        """What puts the ``inputs`` and ``outputs`` state back as it is now, the state the step's staged updates
        create (an optimizer's first moments) removed and their optimizers set to fill it in again;
        the next call then traces afresh."""
        put_back, trace, me = _state.snapshot([self._inputs, self._outputs]), self._trace, weakref.ref(self)

        def undo() -> None:
            put_back()
            for optimizer in trace.optimizers:  # read after the call: its first trace finds them
                optimizer.state = optimizer.state  # uninitialised: the next update fills in what it lacks
            compiled = me()
            if compiled is not None:
                compiled._retrace()

        return undo

    def _retrace(self) -> None:
        """Trace again at the next call. MLX writes a call's ``outputs`` state back by position, in the
        order of the trace's: a trace made with state the put-back removed would write an optimizer's
        moments where other state now is (the random key), and MLX would reuse it, since the state put
        back has the shapes the trace began with."""
        count = self._trace.count
        self._trace = _Trace(self._trace.fn)
        self._trace.count = count
        self._compiled = self._compile(self._trace)  # MLX drops the old traces with the old function
        self._signatures.clear()


def compile(
    fun: Callable | None = None, *, inputs: Any = None, outputs: Any = None, shapeless: bool = False
) -> Callable:
    """:func:`mlx.core.compile`, with the stages of checkpoints inside kept for :func:`nuvec_mlx.eval`.

    Args:
        fun: the function to compile; omitted, ``compile`` returns a decorator.
        inputs, outputs, shapeless: as for :func:`mlx.core.compile`: state the
            function reads and updates (a model's and an optimizer's state,
            ``mx.random.state``), and whether to retrace on new shapes.

    Returns:
        A :class:`Compiled` function with the values of ``fun``. Evaluate what
        it returns, or the ``outputs`` state it updated, with
        :func:`nuvec_mlx.eval` to evaluate the step one checkpointed block at a
        time; :func:`mlx.core.eval` evaluates it in one go, as before.

    Example:
        >>> state = [model.state, optimizer.state, mx.random.state]
        >>> @nv.compile(inputs=state, outputs=state)
        ... def step(x, y):
        ...     loss, grads = nv.value_and_grad(model, loss_fn)(model, x, y)
        ...     nv.update(optimizer, model, grads)  # optimizer.update, staged per block
        ...     return loss
        >>> nv.eval(step(x, y), state)
    """
    _validate.check_bool(shapeless, "shapeless")
    if fun is None:
        return functools.partial(compile, inputs=inputs, outputs=outputs, shapeless=shapeless)
    _validate.check_callable(fun, "fun")
    return Compiled(fun, inputs=inputs, outputs=outputs, shapeless=shapeless)


class CompiledFlat(Compiled):
    """A flat function compiled with :func:`mlx.core.compile`: lists of arrays in and out.

    ``mx.random.state`` is part of the compiled state, so random draws inside
    the step advance it as they would uncompiled. ``traces`` is as for
    :class:`Compiled`.
    """

    def __init__(self, fn: FlatFn):
        def flat(*xs: mx.array) -> list[mx.array]:
            return _validate.check_outputs(fn(list(xs)), fn)

        functools.update_wrapper(flat, fn)
        state = [mx.random.state]
        super().__init__(flat, inputs=state, outputs=state)

    def __call__(self, xs: Sequence[mx.array]) -> list[mx.array]:
        return list(super().__call__(*_validate.check_array_list(xs, "xs")))


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
