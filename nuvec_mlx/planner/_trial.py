"""Trial steps: a model's training step run to be measured, and everything put back after.

The planner and the saved-activations report measure the step a user runs:
the loss and gradients of the model's trainable parameters
(:func:`nuvec_mlx.value_and_grad`), the optimizer's update when there is one
(:func:`nuvec_mlx.update`: each checkpointed block's a stage after its backward),
compiled with :func:`nuvec_mlx.compile` (unless told otherwise) and evaluated
with :func:`nuvec_mlx.eval`. A trial leaves no trace: the model's parameters,
the optimizer's state, MLX's random key, and the checkpoint wrapping of the
blocks are put back as they were, also when a step raises. Its readings are
those of the user's step: the originals kept to put back are counted out.
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
import mlx.optimizers as optim
from mlx.utils import tree_map

from .. import _pytree, _random, memory
from ..compile import compile as nv_compile
from ..evaluate import eval as nv_eval
from ..grad import value_and_grad
from ..nn import checkpoint_module
from ..update import update

#: A block that is not wrapped at all (every other mode is a checkpoint policy).
PLAIN = "plain"


@dataclasses.dataclass(frozen=True)
class Reading:
    """One measured step: the memory after each stage, and its time."""

    start: int  # active memory when the evaluation began (weights, optimizer state, batch)
    peak: int  # the highest active memory during it
    seconds: float  # from the step's call to the end of its evaluation
    stages: list  # nv.memory.Reading per stage


def as_batch(batch: Any) -> tuple:
    """The positional arguments a batch stands for: an array alone, or a tuple or list of them."""
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    return (batch,)


class Trial:
    """Runs and measures one model's training step; :meth:`restoring` puts everything back.

    Args:
        model: the model; ``blocks`` are the modules the modes apply to.
        loss_fn: ``loss_fn(model, *batch)``, as :func:`mlx.nn.value_and_grad` takes.
        optimizer: updates the model in the step, when given.
        compiled: compile the step with :func:`nuvec_mlx.compile`.
        synchronize: the step as run is evaluated with ``nv.eval(...,
            synchronize=True)`` (unobserved and timed steps).
    """

    def __init__(self, model: nn.Module, loss_fn: Callable, blocks: Sequence[nn.Module],
                 optimizer: optim.Optimizer | None = None, compiled: bool = True, synchronize: bool = False):
        self.model, self.loss_fn, self.blocks = model, loss_fn, list(blocks)
        self.optimizer, self.compiled, self.synchronize = optimizer, compiled, synchronize

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """Inside, steps may run; after, the model, optimizer, random key and block wrapping are as before."""
        parameters = tree_map(lambda a: a, self.model.parameters())
        # The state dict itself is put back, not a copy: a step compiled before (its
        # inputs and outputs) holds that dict, and would otherwise update a stale one.
        held = self.optimizer.state if self.optimizer is not None else None
        opt_state = tree_map(lambda a: a, held) if held is not None else None
        key, classes = _random.key(), [type(b) for b in self.blocks]
        try:
            if self.optimizer is not None:
                self.optimizer.init(self.model.trainable_parameters())
                mx.eval(self.optimizer.state)
            yield
        finally:
            self.model.update(parameters)
            if self.optimizer is not None:
                held.clear()
                held.update(opt_state)
                self.optimizer.state = held  # and uninitialised, so that it fills in what it lacks
            _random.set_key(key)
            for block, cls in zip(self.blocks, classes):
                block.__class__ = cls
            gc.collect()

    def set_modes(self, modes: Sequence[Any]) -> None:
        """Wrap each block as its mode says: :data:`PLAIN`, or checkpointed with that policy."""
        for block, mode in zip(self.blocks, modes):
            plain = isinstance(mode, str) and mode == PLAIN
            checkpoint_module(block, enable=not plain, policy=None if plain else mode)

    def _step(self) -> Callable:
        vg = value_and_grad(self.model, self.loss_fn)
        state: list = [self.model.state, mx.random.state]
        if self.optimizer is not None:
            state.append(self.optimizer.state)

        def step(*batch: Any) -> Any:
            loss, grads = vg(self.model, *batch)
            if self.optimizer is None:
                return loss, grads
            update(self.optimizer, self.model, grads)
            return loss

        if self.compiled:
            return nv_compile(step, inputs=state, outputs=state), state
        return step, state

    def measure(self, batch: Any, steps: int = 2, as_run: bool = False) -> list[Reading]:
        """Run ``steps`` steps on ``batch`` (a fresh trace: the modes may have changed); their readings.

        Every step starts from the same parameters, optimizer state and random
        key, and they are put back after the last. The first step also traces
        the step and compiles its kernels: its memory counts, its time does not.

        Each step is read after every stage, and a reading calls
        :func:`mlx.core.synchronize`, which on CUDA also waits for MLX's worker
        to free the stage's buffers; :func:`nuvec_mlx.eval` alone goes on to the
        next stage without that wait, so an observed step can peak lower than
        the step as it runs. With ``as_run``, one more step runs unobserved,
        and every reading's peak is at least that step's.
        """
        readings = []
        with self._fresh(batch) as (step, state, undo):
            for _ in range(steps):
                held = self._copies()
                with memory.measure() as m, memory.timeline() as t:
                    begin = time.perf_counter()
                    out = step()
                    nv_eval(out, state)
                    mx.synchronize()
                    seconds = time.perf_counter() - begin
                del out
                undo()
                stages = [dataclasses.replace(r, active=r.active - held, peak=r.peak - held) for r in t.readings]
                readings.append(Reading(m.start - held, max(r.peak for r in stages), seconds, stages))
            if as_run:
                held = self._copies()
                with memory.measure() as m:
                    nv_eval(step(), state, synchronize=self.synchronize)
                undo()
                readings = [dataclasses.replace(r, peak=max(r.peak, m.start - held + m.peak)) for r in readings]
        return readings

    def time(self, batch: Any, steps: int = 3) -> float:
        """The median seconds of ``steps`` steps on ``batch``, run as a training loop runs them.

        After one step that traces and compiles, each step is timed from its
        call to the end of :func:`nuvec_mlx.eval` and :func:`mlx.core.synchronize`,
        unobserved and with MLX's buffer cache kept (as between a loop's steps),
        and put back after. :meth:`measure`'s steps clear the cache and
        synchronize after every stage, which costs each step in proportion to
        the memory and stages it has: fine for peaks, not for comparing times.
        """
        seconds = []
        with self._fresh(batch) as (step, state, undo):
            for _ in range(steps + 1):
                self._copies()
                begin = time.perf_counter()
                nv_eval(step(), state, synchronize=self.synchronize)
                mx.synchronize()
                seconds.append(time.perf_counter() - begin)
                undo()
        return statistics.median(seconds[1:])

    @contextlib.contextmanager
    def _fresh(self, batch: Any) -> Iterator[tuple[Callable[[], Any], list, Callable[[], None]]]:
        """A freshly traced step on ``batch`` (a call of no arguments), the state it updates, and
        what puts that state back as it was here; it is put back on leaving, also on an error."""
        gc.collect()  # arrays held only by reference cycles (of earlier steps, of the caller) go first
        step, state = self._step()
        args = as_batch(batch)
        undo = _pytree.snapshot(state)
        try:
            yield (lambda: step(*args)), state, undo
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
        nbytes = _pytree.copy_arrays(self.optimizer.state)
        parameters = self.model.trainable_parameters()
        nbytes += _pytree.copy_arrays(parameters)
        self.model.update(parameters)
        return nbytes
