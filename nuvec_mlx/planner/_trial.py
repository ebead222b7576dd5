"""Trial steps: the user's training step run to be measured, and everything put back after.

The planner, :func:`~nuvec_mlx.largest_fit` and the saved-activations report
measure the step a user runs: a :class:`nuvec_mlx.TrainingStep`, with its own
compile and evaluation settings (every trial step updates: ``accumulate`` is
1). A trial leaves no trace: the model's parameters, the optimizer's state (the
same dicts, which steps compiled before hold), MLX's random key, and the
checkpointing of the blocks are put back as they were, also when a step
raises. Its readings are those of the user's step: the originals kept to put
back are counted out. A :class:`Session` is one fresh step (traced and compiled
at its first call), observed, run unobserved or timed as the caller needs, so
that one compilation serves them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .. import _state, memory
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


def check_step(step: object) -> None:
    """``TypeError`` unless ``step`` is a :class:`TrainingStep` (what the planning functions measure)."""
    if not isinstance(step, TrainingStep):
        raise TypeError(f"step must be an nv.TrainingStep, got {type(step).__name__}")


class Trial:
    """Runs and measures the user's step; :meth:`restoring` puts everything back.

    Args:
        step: the user's step (its model, loss, optimizer and settings).
        blocks: the modules the modes apply to.
    """

    def __init__(self, step: TrainingStep, blocks: Sequence[nn.Module]):
        self.step, self.blocks = step.replace(accumulate=1), list(blocks)
        self.model, self.optimizer = step.model, step.optimizer
        self.tick: Callable[[], Any] = lambda: None  # called after every step (see counting)

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

    @contextlib.contextmanager
    def counting(self, tick: Callable[[], Any]) -> Iterator[None]:
        """Inside, ``tick()`` is called after every step the trial runs (a progress bar's update)."""
        held, self.tick = self.tick, tick
        try:
            yield
        finally:
            self.tick = held

    def measure(self, batch: Any, steps: int = 2) -> list[StepReading]:
        """Run ``steps`` steps on ``batch`` (a fresh trace: the modes may have changed); their readings.

        Every step starts from the same parameters, optimizer state and random
        key, and they are put back after the last. The first step also traces
        the step and compiles its kernels: its memory counts, its time does not.

        Each step is read after every stage, and a reading calls
        :func:`mlx.core.synchronize`, which on CUDA also waits for MLX's worker
        to free the stage's buffers; the user's step goes on to the next stage
        without that wait (unless it synchronizes), so an observed step can
        peak lower than the step as it runs (:meth:`Session.as_run`, :func:`at_least`).
        """
        with self.session(batch) as session:
            return session.observe(steps)

    @contextlib.contextmanager
    def session(self, batch: Any) -> Iterator[Session]:
        """A fresh step on ``batch`` (traced at its first call), to measure and time; its state is put
        back as it was here after each of its steps, and on leaving, also on an error."""
        gc.collect()  # arrays held only by reference cycles (of earlier steps, of the caller) go first
        step, args = self.step.replace(), as_batch(batch)
        undo = step.snapshot()
        try:
            yield Session(self, lambda: step(*args), undo)
        finally:
            undo()

    def copies(self) -> int:
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


def at_least(readings: Sequence[StepReading], peak: int) -> list[StepReading]:
    """``readings`` with every peak at least ``peak`` (a step's, run unobserved: :meth:`Session.as_run`)."""
    return [dataclasses.replace(r, peak=max(r.peak, peak)) for r in readings]


class Session:
    """One fresh step of a :class:`Trial` on a batch: its steps observed, run unobserved, or timed.

    Its first step, whichever it is, traces the step and compiles its kernels.

    Args:
        trial: the trial whose step this is.
        call: one call of the step (dispatched; evaluated by the step itself).
        undo: puts the step's state back as it was before the session.
    """

    def __init__(self, trial: Trial, call: Callable[[], Any], undo: Callable[[], None]):
        self.trial, self.call, self.undo = trial, call, undo
        self.steps = 0  # run so far

    def observe(self, steps: int) -> list[StepReading]:
        """``steps`` steps, each read after every stage (:func:`nuvec_mlx.memory.timeline`)."""
        readings, free = [], self.trial.step.throttle
        free = memory.current_throttle() if free is None else free
        for _ in range(steps):
            with self._step() as held, memory.measure() as m, memory.timeline() as t:
                begin = time.perf_counter()
                self.call()
                mx.synchronize()
                seconds = time.perf_counter() - begin
            stages = [dataclasses.replace(r, active=r.active - held, peak=r.peak - held) for r in t.readings]
            readings.append(StepReading(m.start - held, max(r.peak for r in stages), seconds, stages, free))
        return readings

    def as_run(self, clear_cache: bool = True) -> int:
        """The peak of one step run unobserved, with the step's own settings (absolute, the originals
        the trial keeps counted out), from an empty buffer cache or (``clear_cache=False``) the one the steps
        before it left."""
        with self._step() as held, memory.measure(clear_cache=clear_cache) as m:
            self.call()
        return m.start - held + m.rise

    def peak(self, steps: int = 2) -> int:
        """The highest peak of ``steps`` steps run as a training loop runs them: unobserved, the first from an
        empty buffer cache, as a loop's first step (it compiles where the session has run no step yet: a run
        must survive it too), the others with the cache the steps before them left, as a loop's next steps find
        it (emptied, every allocation would be made afresh)."""
        return max(self.as_run(clear_cache=i == 0) for i in range(steps))

    def time(self, steps: int = 3) -> tuple[float, int]:
        """The median seconds of ``steps`` steps, run as a training loop runs them, and their highest peak.

        Each step is timed from its call to the end of its evaluation and
        :func:`mlx.core.synchronize`, unobserved and with MLX's buffer cache
        kept (as between a loop's steps); a session that has run no step yet
        first runs one that traces and compiles, untimed. :meth:`observe`'s
        steps clear the cache and synchronize after every stage, which costs
        each step in proportion to the memory and stages it has: fine for
        peaks, not for comparing times. The steps run unobserved, as
        :meth:`as_run`'s does: the highest peak of them all (the compiling
        one's too) is theirs, absolute.
        """
        peaks = [] if self.steps else [self.as_run()]
        seconds = []
        for _ in range(steps):
            with self._step() as held, memory.measure(clear_cache=False) as m:
                begin = time.perf_counter()
                self.call()
                mx.synchronize()
                seconds.append(time.perf_counter() - begin)
            peaks.append(m.start - held + m.rise)
        return statistics.median(seconds), max(peaks)

    @contextlib.contextmanager
    def _step(self) -> Iterator[int]:
        """Around one step: the trial's copies made before it (their bytes yielded, which readings count
        out), its state put back after."""
        self.steps += 1
        held = self.trial.copies()
        try:
            yield held
        finally:
            self.undo()
            self.trial.tick()
