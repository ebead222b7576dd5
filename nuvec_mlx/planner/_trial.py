"""Trial steps: the user's training step run to be measured, and everything put back after.

The planner, :func:`~nuvec_mlx.largest_fit` and the saved-activations report
measure the step a user runs: a :class:`nuvec_mlx.TrainingStep`, with its own
compile and evaluation settings (every trial step updates: ``accumulate`` is
1). A trial leaves no trace: the model's parameters, the optimizer's state (the
same dicts, which steps compiled before hold), MLX's random key, and the
checkpointing of the blocks are put back as they were, also when a step
raises. Its readings are those of the user's step: the originals kept to put
back are counted out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .. import _state, _validate, memory
from .. import nn as nv_nn
from ..memory import StageReading
from ..step import TrainingStep

#: A block that is not wrapped at all (every other mode is a checkpoint policy).
PLAIN = "plain"


def set_modes(blocks: Sequence[nn.Module], modes: Sequence[Any]) -> None:
    """Wrap each block as its mode says: :data:`PLAIN` (not wrapped), or checkpointed with that policy."""
    for block, mode in zip(blocks, modes, strict=True):
        plain = isinstance(mode, str) and mode == PLAIN
        nv_nn.checkpoint_module(block, enable=not plain, policy=None if plain else mode)


@dataclasses.dataclass(frozen=True)
class StepReading:
    """One measured step: the memory after each stage, and its time."""

    start: int  # active memory when the evaluation began (weights, optimizer state, batch)
    peak: int  # the highest active memory during it
    seconds: float  # from the step's call to the end of its evaluation
    stages: list[StageReading]
    free: float = float("inf")  # the throttle: how far above the start the evaluator ran ahead freely


def as_batch(batch: Any) -> tuple:
    """The positional arguments a batch stands for: an array alone, or a tuple or list of them."""
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    return (batch,)


def check_batch(batch: object, name: str = "batch", verb: str = "be ") -> None:
    """``TypeError`` unless ``batch`` is an array or a tuple of the loss's arguments holding one (``name``
    must ``verb`` one)."""
    if not any(isinstance(a, mx.array) for a in as_batch(batch)):
        raise TypeError(
            f"{name} must {verb}an mlx.core.array or a tuple of the loss's arguments holding arrays, "
            f"got {type(batch).__name__}"
        )


def as_step(
    step: object, args: tuple, kwargs: dict, name: str, impl: Callable[..., Any]
) -> tuple[TrainingStep, tuple, dict]:
    """The :class:`TrainingStep` a planning function measures, its other arguments, and its options,
    checked against ``impl``, the function that takes them (a wrong argument's error names ``name``).

    Planning functions take the step first. Their form before
    :class:`TrainingStep`, ``name(model, loss_fn, ..., optimizer=, compile=,
    synchronize=)``, still works, with a ``FutureWarning``.
    """
    step, args, kwargs = _step_of(step, args, kwargs, name)
    try:
        inspect.signature(impl).bind(step, *args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{name}(): {e}") from None
    return step, args, kwargs


def _step_of(step: object, args: tuple, kwargs: dict, name: str) -> tuple[TrainingStep, tuple, dict]:
    if isinstance(step, TrainingStep):
        return step, args, kwargs
    if not isinstance(step, nn.Module):
        raise TypeError(f"step must be an nv.TrainingStep, got {type(step).__name__}")
    if not args:
        raise TypeError(f"{name}(model, loss_fn, ...) needs loss_fn: pass nv.TrainingStep(model, loss_fn, optimizer)")
    _validate.deprecated(
        f"{name}(model, loss_fn, ..., optimizer=...)",
        f"{name}(nv.TrainingStep(model, loss_fn, optimizer), ...)",
    )
    legacy = {k: kwargs.pop(k) for k in ("optimizer", "compile", "synchronize") if k in kwargs}
    return TrainingStep(step, args[0], legacy.pop("optimizer", None), **legacy), args[1:], kwargs


class Trial:
    """Runs and measures the user's step; :meth:`restoring` puts everything back.

    Args:
        step: the user's step (its model, loss, optimizer and settings).
        blocks: the modules the modes apply to.
    """

    def __init__(self, step: TrainingStep, blocks: Sequence[nn.Module]):
        self.step, self.blocks = step.replace(accumulate=1), list(blocks)
        self.model, self.optimizer = step.model, step.optimizer

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """Inside, steps may run; after, the model, optimizer, random key and block wrapping are as before."""
        undo = self.step.snapshot()
        try:
            with nv_nn.restoring(self.blocks):
                if self.optimizer is not None:
                    self.optimizer.init(self.model.trainable_parameters())
                    mx.eval(self.optimizer.state)
                yield
        finally:
            undo()
            gc.collect()

    def set_modes(self, modes: Sequence[Any]) -> None:
        """Wrap each block as its mode says: :data:`PLAIN`, or checkpointed with that policy."""
        set_modes(self.blocks, modes)

    def measure(self, batch: Any, steps: int = 2, as_run: bool = False) -> list[StepReading]:
        """Run ``steps`` steps on ``batch`` (a fresh trace: the modes may have changed); their readings.

        Every step starts from the same parameters, optimizer state and random
        key, and they are put back after the last. The first step also traces
        the step and compiles its kernels: its memory counts, its time does not.

        Each step is read after every stage, and a reading calls
        :func:`mlx.core.synchronize`, which on CUDA also waits for MLX's worker
        to free the stage's buffers; the user's step goes on to the next stage
        without that wait (unless it synchronizes), so an observed step can
        peak lower than the step as it runs. With ``as_run``, one more step
        runs unobserved, with the step's own settings, and every reading's peak
        is at least that step's.
        """
        readings, free = [], self.step.throttle
        free = memory.current_throttle() if free is None else free
        with self._fresh(batch) as (run, undo):
            for _ in range(steps):
                held = self._copies()
                with memory.measure() as m, memory.timeline() as t:
                    begin = time.perf_counter()
                    run()
                    mx.synchronize()
                    seconds = time.perf_counter() - begin
                undo()
                stages = [dataclasses.replace(r, active=r.active - held, peak=r.peak - held) for r in t.readings]
                readings.append(StepReading(m.start - held, max(r.peak for r in stages), seconds, stages, free))
            if as_run:
                held = self._copies()
                with memory.measure() as m:
                    run()
                undo()
                readings = [dataclasses.replace(r, peak=max(r.peak, m.start - held + m.rise)) for r in readings]
        return readings

    def time(self, batch: Any, steps: int = 3) -> float:
        """The median seconds of ``steps`` steps on ``batch``, run as a training loop runs them.

        After one step that traces and compiles, each step is timed from its
        call to the end of its evaluation and :func:`mlx.core.synchronize`,
        unobserved and with MLX's buffer cache kept (as between a loop's
        steps), and put back after. :meth:`measure`'s steps clear the cache and
        synchronize after every stage, which costs each step in proportion to
        the memory and stages it has: fine for peaks, not for comparing times.
        """
        seconds = []
        with self._fresh(batch) as (run, undo):
            for _ in range(steps + 1):
                self._copies()
                begin = time.perf_counter()
                run()
                mx.synchronize()
                seconds.append(time.perf_counter() - begin)
                undo()
        return statistics.median(seconds[1:])

    @contextlib.contextmanager
    def _fresh(self, batch: Any) -> Iterator[tuple[Callable[[], Any], Callable[[], None]]]:
        """A fresh step on ``batch`` (a call of no arguments; traced at its first call), and what puts
        its state back as it was here; it is put back on leaving, also on an error."""
        gc.collect()  # arrays held only by reference cycles (of earlier steps, of the caller) go first
        step, args = self.step.replace(), as_batch(batch)
        undo = step.snapshot()
        try:
            yield (lambda: step(*args)), undo
        finally:
            undo()

    def _copies(self) -> int:
        """Give the model and the optimizer copies of what a step replaces; the bytes the originals hold.

        A step consumes what it updates: with :func:`nuvec_mlx.update` each
        block's old weights and moments go once its update stage is done. The
        trial keeps the originals to undo the step, so the step consumes
        copies, as the user's consumes the originals, and the readings count
        the originals out: they are the user's step's, shifted by a constant.
        """
        if self.optimizer is None:  # the step returns its gradients and replaces nothing
            return 0
        nbytes = _state.copy_arrays(self.optimizer.state)
        parameters = self.model.trainable_parameters()
        nbytes += _state.copy_arrays(parameters)
        self.model.update(parameters)
        return nbytes
