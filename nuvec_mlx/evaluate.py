"""Evaluation: a step one checkpointed block at a time, within a memory throttle.

:func:`eval` is :func:`mlx.core.eval` for a step's results: it first
evaluates the stages that the step's checkpoints marked
(:mod:`nuvec_mlx._marks`), each one after the other, so that MLX's
evaluator, which runs up to ten tasks ahead of the device, never has more
than one block in flight. Arrays with no stages are evaluated as
:func:`mlx.core.eval` evaluates them.

Waiting for each stage leaves the device idle while the host builds the
next one; ``ahead`` stages queued beyond the one waited for hide that, at the
cost of their memory (one more block in flight per stage ahead).

A throttle holds the evaluator back within a stage too: MLX's evaluator
waits for queued work whenever active memory exceeds MLX's memory limit, so
a limit set just above the memory the evaluation starts with makes it wait.
That is cheap on CPU (the default there for staged evaluations) and costs a
wait after every kernel on a GPU (``math.inf``, no throttle, by default).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from . import _marks, _registry, _validate, memory

# mx.set_memory_limit is process-wide: evaluations that set it take turns.
_limit_lock = threading.RLock()


def default_ahead(device: mx.Device | mx.DeviceType | None = None) -> int:
    """The stages :func:`eval` queues ahead by default on ``device``.

    1 on a GPU: without it the device idles while the host builds each
    stage; one stage ahead keeps one more block in flight. 0 on the CPU,
    where the host's work is small beside the kernels' and the lowest peak
    costs nothing.

    Args:
        device: an :class:`mlx.core.Device` or a device type (``mx.gpu``,
            ``mx.cpu``), as :func:`mlx.core.set_default_device` takes; ``None``
            for MLX's default device.

    Example:
        >>> nv.default_ahead(mx.cpu), nv.default_ahead(mx.gpu)
        (0, 1)
    """
    if device is None:
        device = mx.default_device()
    if not isinstance(device, (mx.Device, mx.DeviceType)):
        raise TypeError(f"device must be an mlx.core.Device, a device type or None, got {type(device).__name__}")
    return 1 if getattr(device, "type", device) == mx.gpu else 0


def eval(
    *arrays: Any,
    throttle: int | float | None = None,
    ahead: int | None = None,
    synchronize: bool = False,
) -> None:
    """Evaluate arrays as :func:`mlx.core.eval` does, a checkpointed step one block at a time.

    Args:
        arrays: what :func:`mlx.core.eval` takes: arrays, or lists, tuples and
            dicts of them nested as deep as you like (``nn.Module`` state,
            ``mx.random.state`` included); leaves that are not arrays are
            ignored.
        throttle: bytes above the currently active memory that the evaluation
            may use before the evaluator waits for queued work; ``None`` uses
            the throttle in force (:func:`nuvec_mlx.memory.throttle`, else
            :func:`nuvec_mlx.memory.current_throttle`'s default), ``math.inf``
            turns it off (the stages, if any, are still evaluated one by one;
            without stages this is :func:`mlx.core.eval`).
        ahead: stages queued on the device (:func:`mlx.core.async_eval`)
            beyond the one the host waits for, so that the device runs one
            while the host builds the next; each stage ahead keeps one more
            block in flight. ``None`` for :func:`default_ahead` (1 on a GPU, 0
            on the CPU); 0 gives the lowest peak. On a GPU a queued stage's
            memory is allocated as it is queued, and the throttle does not
            hold it back. Inside :func:`nuvec_mlx.memory.ceiling` and
            :func:`nuvec_mlx.memory.timeline`, which read memory after each
            stage, it is 0.
        synchronize: after each stage, also wait (:func:`mlx.core.synchronize`)
            for the device and for MLX to release the stage's buffers, which on
            CUDA happens on a worker thread after :func:`mlx.core.eval` has
            returned: the next stage may otherwise start while they are still
            held, so that the peak varies from step to step. It also waits for
            the stages queued ``ahead``.

    The memory limit is restored afterwards, also when evaluation raises.

    Example:
        >>> nv.eval(loss, grads)
        >>> nv.eval({"loss": loss, "grads": grads}, throttle=64 << 20)
        >>> nv.eval(loss, state, ahead=0)  # the lowest peak, one host wait per stage
        >>> nv.eval(loss, state, synchronize=True)  # on CUDA, the same peak every step
    """
    ahead = check_settings(throttle, ahead, synchronize)  # before the registry forgets what is taken
    taken = _registry.take(arrays)
    _run(taken.stages, arrays, throttle, ahead, synchronize, taken.undos)


def check_settings(throttle: object, ahead: object, synchronize: object) -> int:
    """Check the evaluation settings; ``ahead`` as it applies (:func:`default_ahead` for ``None``)."""
    if throttle is not None:
        _validate.check_nbytes(throttle, "throttle")
    _validate.check_bool(synchronize, "synchronize")
    return default_ahead() if ahead is None else _validate.check_int(ahead, "ahead", minimum=0)


def staged(
    stages: Sequence[mx.array],
    arrays: Sequence[Any],
    *,
    throttle: int | float | None,
    ahead: int | None,
    synchronize: bool,
    undos: Sequence[Callable[[], None]] = (),
) -> None:
    """Evaluate ``stages`` one by one, then ``arrays``, as :func:`eval` does; the ``undos`` put the
    steps' state back if it raises (a :func:`nuvec_mlx.memory.ceiling` stop).

    :func:`eval` takes the stages of the arrays it is given from the
    registry; :class:`nuvec_mlx.TrainingStep`, which has its stages in hand,
    calls this directly.
    """
    _run(stages, arrays, throttle, check_settings(throttle, ahead, synchronize), synchronize, undos)


def _run(
    stages: Sequence[mx.array],
    arrays: Sequence[Any],
    throttle: int | float | None,
    ahead: int,
    synchronize: bool,
    undos: Sequence[Callable[[], None]],
) -> None:
    """:func:`staged` with its settings checked (``ahead`` as it applies)."""
    nbytes = memory.current_throttle(staged=bool(stages)) if throttle is None else throttle
    try:
        with _throttled(nbytes):
            _evaluate_stages(list(stages), tuple(arrays), 0 if _registry.observed() else ahead, synchronize)
    except BaseException:
        for undo in undos:
            undo()
        raise


def _evaluate_stages(stages: list[mx.array], arrays: tuple[Any, ...], ahead: int, synchronize: bool) -> None:
    """Evaluate ``stages`` one by one, then ``arrays``, with up to ``ahead`` of them queued past the one
    waited for; with ``synchronize``, :func:`mlx.core.synchronize` after each stage."""
    work = [(stage,) for stage in stages] + [arrays]
    kinds = [_marks.kind(stage) for stage in stages] + ["outputs"]
    queued = 0  # work[:queued] is on the device's queue
    _registry.starting()
    for i, item in enumerate(work):
        while ahead and queued < len(work) and queued - i <= ahead:
            mx.async_eval(*work[queued])
            queued += 1
        mx.eval(*item)
        if synchronize and i < len(stages):
            mx.synchronize()
        _registry.evaluated(i, len(stages), kinds[i])


@contextlib.contextmanager
def _throttled(nbytes: float) -> Iterator[None]:
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
