"""A memory ceiling: a staged evaluation stops between stages once memory crosses it.

MLX's memory limit is advisory (on a Mac the evaluator waits on memory only
above 1.5x the recommended working set, when the machine already swaps), so a
step too large for the machine is found out by swapping or by the device
running out. Inside :func:`ceiling`, :func:`nuvec_mlx.eval` reads memory after
every stage and raises ``MemoryError`` at the first stage that went above the
ceiling: at most one stage (one block) past it. A step compiled with
:func:`nuvec_mlx.compile` and called inside the ceiling gets its ``outputs``
state (model, optimizer) put back as it was before the step.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import mlx.core as mx

from . import _registry, _validate

MiB = 1 << 20

_ceiling: contextvars.ContextVar[int | None] = contextvars.ContextVar("nuvec_mlx_ceiling", default=None)


def current() -> int | None:
    """The ceiling in force here, in bytes, or ``None``."""
    return _ceiling.get()


class _Watch:
    """Reads memory after each stage of the evaluations inside one ceiling."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.peak_before = 0

    def __call__(self, index: int, count: int, stage_kind: str) -> None:
        mx.synchronize()
        # MLX's peak counter is monotonic: it tells this evaluation's peak only
        # once it has moved past what it was when the evaluation began.
        peak = mx.get_peak_memory()
        reached = max(mx.get_active_memory(), peak if peak > self.peak_before else 0)
        if reached > self.nbytes:
            where = "the outputs" if stage_kind == "outputs" else f"{stage_kind} stage {index + 1} of {count}"
            # The counter now holds this step's peak: start it afresh, so that the next
            # evaluation inside the same ceiling is judged by its own peak.
            mx.reset_peak_memory()
            self.peak_before = 0
            raise MemoryError(
                f"nv.eval stopped after {where}: MLX memory reached {reached / MiB:.1f} MiB, "
                f"above the ceiling of {self.nbytes / MiB:.1f} MiB (nv.memory.ceiling); "
                "the step's state is as it was before it: try a smaller batch or more checkpoints"
            )


@contextlib.contextmanager
def ceiling(nbytes: int) -> Iterator[None]:
    """Stop evaluations inside with a ``MemoryError`` once MLX memory crosses ``nbytes``.

    The check runs after each stage of a staged evaluation (a checkpointed
    step), so the evaluation stops at most one stage past the ceiling; a step
    compiled with :func:`nuvec_mlx.compile` and called inside gets its
    ``outputs`` state (model and optimizer) restored to what it was before
    the step, so that the next step, smaller, can run, also inside the same
    ceiling (a stop resets MLX's peak counter). A step that is not compiled
    with :func:`nuvec_mlx.compile` is not undone: evaluate its loss and
    gradients inside the ceiling before the optimizer's update.

    Args:
        nbytes: the ceiling, in bytes of MLX's active memory (an int >= 0).

    Example:
        >>> with nv.memory.ceiling(12 << 30):
        ...     nv.eval(step(x, y), state)
    """
    nbytes = _validate.check_int(nbytes, "nbytes", minimum=0)
    watch = _Watch(nbytes)
    token = _ceiling.set(nbytes)
    try:
        with _registry.observing(watch):
            mx.synchronize()
            watch.peak_before = mx.get_peak_memory()
            yield
    finally:
        _ceiling.reset(token)
