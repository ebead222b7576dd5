"""A memory ceiling: a staged evaluation stops between stages once memory crosses it.

MLX's memory limit is advisory (on a Mac the evaluator waits on memory only
above 1.5x the recommended working set, when the machine already swaps), so a
step too large for the machine is found out by swapping or by the device
running out. Inside :func:`ceiling`, :func:`nuvec_mlx.eval` reads memory after
every stage and raises ``MemoryError`` at the first stage whose evaluation went
above the ceiling: at most one stage (one block) past it. A step of
:class:`nuvec_mlx.TrainingStep`, or compiled with :func:`nuvec_mlx.compile`,
called inside the ceiling gets its state (model, optimizer, random key) put
back as it was before the step.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from . import _peak, _registry, _units, _validate

_ceiling: contextvars.ContextVar[int | None] = contextvars.ContextVar("nuvec_mlx_ceiling", default=None)


def current() -> int | None:
    """The ceiling in force here, in bytes, or ``None``."""
    return _ceiling.get()


class _Watch:
    """Reads the peak of each evaluation inside one ceiling after each of its stages."""

    def __init__(self, nbytes: int, evaluation: _peak.Window):
        self.nbytes, self.evaluation = nbytes, evaluation

    def started(self) -> None:
        # Each evaluation is judged by its own peak, not by what came before it (MLX's counter only rises).
        self.evaluation.restart()

    def __call__(self, index: int, count: int, stage_kind: str) -> None:
        reached = self.evaluation.peak()
        if reached > self.nbytes:
            where = "the outputs" if stage_kind == "outputs" else f"{stage_kind} stage {index + 1} of {count}"
            raise MemoryError(
                f"nv.eval stopped after {where}: MLX memory reached {reached / _units.MiB:.1f} MiB, above the "
                f"ceiling of {self.nbytes / _units.MiB:.1f} MiB (nv.memory.ceiling); a step of nv.TrainingStep or "
                "nv.compile is put back as it was before it: try a smaller batch or more checkpoints"
            )


@contextlib.contextmanager
def ceiling(nbytes: int) -> Iterator[None]:
    """Stop evaluations inside with a ``MemoryError`` once MLX memory crosses ``nbytes``.

    Each :func:`nuvec_mlx.eval` inside (a :class:`nuvec_mlx.TrainingStep`'s
    too) is judged by its own peak: the highest active memory since it began,
    read after each of its stages, so that a staged step (a checkpointed one)
    stops at most one stage past the ceiling, also after evaluations that
    peaked higher. To read it, the ceiling resets MLX's peak counter as each
    evaluation begins, as :func:`nuvec_mlx.memory.measure` and
    :func:`nuvec_mlx.memory.timeline` do (nested in any order, they still see
    their own peaks). Work evaluated inside with :func:`mlx.core.eval` is not
    watched.

    The ``MemoryError`` names the stage and the memory reached. A step of
    :class:`nuvec_mlx.TrainingStep`, or compiled with
    :func:`nuvec_mlx.compile` (its ``outputs`` state), is put back as it was
    before it: the model, the optimizer's state (the same dicts; state the
    step created, such as Adam's first moments, removed, and filled in again
    at the next update) and ``mx.random.state``; so the next step, smaller,
    can run, also inside the same ceiling. A step of your own that is not
    compiled with :func:`nuvec_mlx.compile` is not undone: evaluate its loss
    and gradients inside the ceiling before the optimizer's update.

    What putting back costs: a step inside holds the state it updates as it
    was before the step, until the step ends. Its peak rises by up to its
    trainable parameters and their optimizer state, which :func:`nuvec_mlx.update`
    otherwise frees block by block as the step goes (with LoRA, only the
    adapters and their moments: next to nothing); nothing is held after the
    step.

    Args:
        nbytes: the ceiling, in bytes of MLX's active memory (an int >= 0).

    Example:
        >>> with nv.memory.ceiling(12 << 30):
        ...     for batch in batches:
        ...         loss = step(*batch)  # an nv.TrainingStep
    """
    nbytes = _validate.check_int(nbytes, "nbytes", minimum=0)
    token = _ceiling.set(nbytes)
    try:
        with _peak.window() as evaluation:
            watch = _Watch(nbytes, evaluation)
            with _registry.observing(watch, watch.started):
                yield
    finally:
        _ceiling.reset(token)
