"""Evaluation: a step one checkpointed block at a time, within a memory budget.

:func:`eval` is :func:`mlx.core.eval` for a step's results: it first
evaluates the stages that the step's checkpoints marked
(:mod:`nuvec_mlx._marks`), each one after the other, so that MLX's
evaluator, which runs up to ten tasks ahead of the device, never has more
than one block in flight. Arrays with no stages are evaluated as
:func:`mlx.core.eval` evaluates them.

Waiting for each stage leaves the device idle while the host builds the
next one; ``ahead`` stages queued beyond the one waited for hide that, at the
cost of their memory (one more block in flight per stage ahead).

A budget adds a throttle: MLX's evaluator also waits for queued work
whenever active memory exceeds MLX's memory limit, so a limit set just above
the memory the evaluation starts with holds the evaluator back within a
stage too. It is cheap on CPU (the default there for staged evaluations) and
costs a wait after every kernel on a GPU (``math.inf``, no throttle, by
default).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from . import _marks, memory, _registry, _validate

# mx.set_memory_limit is process-wide: evaluations that set it take turns.
_limit_lock = threading.RLock()


def eval(*arrays: Any, budget: int | float | None = None, ahead: int = 0, synchronize: bool = False) -> None:
    """Evaluate arrays as :func:`mlx.core.eval` does, within a memory budget.

    Args:
        arrays: what :func:`mlx.core.eval` takes: arrays, or lists, tuples and
            dicts of them nested as deep as you like (``nn.Module`` state,
            ``mx.random.state`` included); leaves that are not arrays are
            ignored.
        budget: bytes above the currently active memory that the evaluation
            may use before the evaluator waits for queued work; ``None`` uses
            the budget in force (:func:`nuvec_mlx.memory.budget`), ``math.inf``
            turns the throttle off (the stages, if any, are still evaluated
            one by one; without stages this is :func:`mlx.core.eval`).
        ahead: stages queued on the device (:func:`mlx.core.async_eval`)
            beyond the one the host waits for, so that the device runs one
            while the host builds the next: 0 (the default, the lowest peak)
            waits for each stage before building the next; each stage ahead
            keeps one more block in flight. Inside
            :func:`nuvec_mlx.memory.ceiling` and
            :func:`nuvec_mlx.memory.timeline`, which read memory after each
            stage, it is 0.
        synchronize: after each stage, also wait (:func:`mlx.core.synchronize`)
            for the device and for MLX to release the stage's buffers, which on
            CUDA happens on a worker thread after :func:`mlx.core.eval` has
            returned: the next stage may otherwise start while they are still
            held, so that the peak varies from step to step (on an H200, a
            staged MLP step peaked at 2242-3076 MiB, and at a steady 1986 MiB
            synchronized, for 5% more time; more on small steps). It also waits
            for the stages queued ``ahead``.

    The memory limit is restored afterwards, also when evaluation raises.

    Example:
        >>> nv.eval(loss, grads)
        >>> nv.eval({"loss": loss, "grads": grads}, budget=64 << 20)
        >>> nv.eval(loss, state, ahead=1)  # faster on a GPU, one more block in flight
        >>> nv.eval(loss, state, synchronize=True)  # on CUDA, a steadier peak
    """
    if budget is not None:
        _validate.check_budget(budget, "budget")
    _validate.check_int(ahead, "ahead", minimum=0)
    _validate.check_bool(synchronize, "synchronize")
    taken = _registry.take(arrays)
    stages = taken.stages
    nbytes = memory.current_budget(staged=bool(stages)) if budget is None else budget
    try:
        with _throttle(nbytes):
            _evaluate_stages(stages, arrays, 0 if _registry.observed() else ahead, synchronize)
    except BaseException:
        for undo in taken.undos:
            undo()
        raise


def _evaluate_stages(stages: list[mx.array], arrays: tuple[Any, ...], ahead: int, synchronize: bool) -> None:
    """Evaluate ``stages`` one by one, then ``arrays``, with up to ``ahead`` of them queued past the one
    waited for; with ``synchronize``, :func:`mlx.core.synchronize` after each stage."""
    work = [(stage,) for stage in stages] + [arrays]
    queued = 0  # work[:queued] is on the device's queue
    for i, item in enumerate(work):
        while ahead and queued < min(len(work), i + 1 + ahead):
            mx.async_eval(*work[queued])
            queued += 1
        mx.eval(*item)
        if synchronize and i < len(stages):
            mx.synchronize()
        _registry.evaluated(i, len(stages), _marks.kind(item[0]) if i < len(stages) else "outputs")


@contextlib.contextmanager
def _throttle(nbytes: float) -> Iterator[None]:
    """Hold MLX's memory limit at the active memory plus ``nbytes`` inside."""
    if nbytes == math.inf:
        yield
        return
    with _limit_lock:
        mx.synchronize()
        previous = mx.get_memory_limit()
        # Never loosen a tighter limit the user set.
        mx.set_memory_limit(min(previous, mx.get_active_memory() + int(nbytes)))
        try:
            yield
        finally:
            mx.set_memory_limit(previous)
