"""Device memory: statistics, measurements, and the throttle that :func:`nuvec_mlx.eval` keeps to.

Every figure is read after :func:`mlx.core.synchronize`, so that work still
queued on the device (and frees that wait for it, as on CUDA) has finished.
The counters are MLX's device-neutral ones and mean the same on CPU, CUDA and
Metal: bytes the allocator handed out (CPU counts requested sizes, Metal
page-aligned ones, CUDA rounded ones). A *peak* is always the highest active
memory, in bytes, counting everything the process holds in MLX; a *rise* is a
peak above what was active when a measurement began.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator

import mlx.core as mx

from . import _distributed, _peak, _validate
from ._ceiling import ceiling
from ._timeline import StageReading, Timeline, timeline
from ._units import MiB

__all__ = [
    "DEFAULT_THROTTLE",
    "MiB",
    "Measurement",
    "StageReading",
    "Stats",
    "Timeline",
    "all_stats",
    "ceiling",
    "current_throttle",
    "measure",
    "reset_peak",
    "stats",
    "throttle",
    "timeline",
]

#: The default throttle of staged evaluations on CPU, in bytes (a GPU has none): see :func:`current_throttle`.
DEFAULT_THROTTLE = MiB

_throttle: contextvars.ContextVar[float | None] = contextvars.ContextVar("nuvec_mlx_throttle", default=None)


@dataclasses.dataclass(frozen=True)
class Stats:
    """A snapshot of the allocator, in bytes.

    Attributes:
        active: memory held by live arrays.
        peak: the highest ``active`` since the last :func:`reset_peak`.
        cache: memory freed by arrays and kept for reuse.
        limit: MLX's memory limit (:func:`mlx.core.set_memory_limit`).
    """

    active: int
    peak: int
    cache: int
    limit: int


def stats() -> Stats:
    """Read the allocator's counters once queued work has finished.

    Example:
        >>> s = nv.memory.stats()
        >>> s.active <= s.peak
        True
    """
    mx.synchronize()
    active = mx.get_active_memory()
    return Stats(
        active=active,
        peak=max(mx.get_peak_memory(), active),  # MLX's reset sets it to 0 until the next allocation
        cache=mx.get_cache_memory(),
        limit=mx.get_memory_limit(),
    )


def reset_peak() -> None:
    """Reset the peak counter to the active memory, after queued work has finished.

    A :func:`measure`, :func:`timeline` or :func:`ceiling` open around it keeps the peak it saw before.
    """
    _peak.reset()


@dataclasses.dataclass
class Measurement:
    """What :func:`measure` saw, in bytes; filled in when its block exits.

    Attributes:
        start: active memory at entry.
        end: active memory at exit.
        rise: the highest active memory inside the block, above ``start``
            (the block's peak is ``start + rise``).
    """

    start: int = 0
    end: int = 0
    rise: int = 0


@contextlib.contextmanager
def measure(clear_cache: bool = True) -> Iterator[Measurement]:
    """Measure the peak memory of a block, above what was active at entry.

    It resets MLX's peak counter (:func:`mlx.core.get_peak_memory` no longer
    shows what came before); measurements, timelines and ceilings nested in
    any order each still see their own peak.

    Args:
        clear_cache: free MLX's buffer cache at entry (the default), so that
            the block's allocations are not served from buffers freed earlier.

    Example:
        >>> with nv.memory.measure() as m:
        ...     step(x, y)
        >>> m.rise  # bytes above what was active at entry
    """
    _validate.check_bool(clear_cache, "clear_cache")
    mx.synchronize()
    if clear_cache:
        mx.clear_cache()
    m = Measurement(start=mx.get_active_memory())
    with _peak.window() as seen:
        try:
            yield m
        finally:
            m.rise = max(0, seen.peak() - m.start)
            m.end = mx.get_active_memory()


@contextlib.contextmanager
def throttle(nbytes: int | float) -> Iterator[None]:
    """Set the throttle of :func:`nuvec_mlx.eval` inside a block.

    The throttle is how many bytes above the memory already active an
    evaluation may use before MLX's evaluator stops running ahead: beyond it,
    the evaluator waits for queued work to finish (and free its buffers)
    before it dispatches more. A small throttle gives the lowest peak; a
    larger one lets more work overlap; ``math.inf`` turns it off (a step's
    stages are still evaluated one by one). The setting is per thread and per
    task (a :mod:`contextvars` variable).

    Args:
        nbytes: bytes, an int >= 0, or ``math.inf``.

    Example:
        >>> with nv.memory.throttle(64 << 20):
        ...     nv.eval(step(xs))
    """
    token = _throttle.set(_validate.check_nbytes(nbytes, "nbytes"))
    try:
        yield
    finally:
        _throttle.reset(token)


def current_throttle(staged: bool = True) -> float:
    """The throttle :func:`nuvec_mlx.eval` keeps to: the innermost :func:`throttle`, else the default.

    Args:
        staged: whether the evaluation is staged (a step with checkpoints,
            from nuvec's gradients or compile). The default applies to staged
            evaluations only: :data:`DEFAULT_THROTTLE` on CPU, where waiting
            for the worker thread is cheap and trims what runs ahead within a
            stage, and ``math.inf`` on a GPU, where stages alone bound the
            run-ahead and a throttle would add a wait after every kernel. An
            evaluation with no stages is :func:`mlx.core.eval` itself unless
            you set a throttle.

    Example:
        >>> nv.memory.current_throttle()  # on CPU
        1048576
    """
    _validate.check_bool(staged, "staged")
    nbytes = _throttle.get()
    if nbytes is not None:
        return nbytes
    return DEFAULT_THROTTLE if staged and mx.default_device() == mx.cpu else math.inf


def all_stats(group: mx.distributed.Group | None = None) -> list[Stats]:
    """Read every process's :func:`stats`, in rank order.

    MLX's counters are per process: in data-parallel training each rank holds
    its own activations, and its peak says nothing about the others'. This
    gathers each rank's four counters with one
    :func:`mlx.core.distributed.all_gather` (as int64), so it is a collective:
    every rank of ``group`` must call it, or the others wait. Each rank's
    counters are read before the gather allocates anything.

    Args:
        group: the processes to ask; ``None`` for the global group
            (:func:`mlx.core.distributed.init`), which is this process alone
            when it was not launched distributed.

    Returns:
        One :class:`Stats` per rank of ``group``, rank 0 first; every rank
        gets the same list.

    Example:
        >>> for rank, s in enumerate(nv.memory.all_stats()):
        ...     print(rank, s.peak)
    """
    if group is None:
        group = mx.distributed.init()
    elif not isinstance(group, mx.distributed.Group):
        raise TypeError(f"group must be an mlx.core.distributed.Group or None, got {type(group).__name__}")
    return [Stats(*row) for row in _distributed.gather(dataclasses.astuple(stats()), group)]
