"""MLX's peak counter, shared by nuvec's readers: windows that each see the peak since they began.

MLX keeps one peak counter per process, and it only rises: the peak of a
stretch of work below an earlier, higher peak can be read only after a reset.
:func:`nuvec_mlx.memory.measure`, :func:`nuvec_mlx.memory.timeline` and
:func:`nuvec_mlx.memory.ceiling` each open a :class:`Window`, whose peak is
the highest active memory since it began or restarted, also when another
reader resets MLX's counter in between (nested in any order): every reset made
here first folds the counter into every open window. A reset made directly
with :func:`mlx.core.reset_peak_memory` is not seen by the windows.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import mlx.core as mx

_lock = threading.Lock()
_open: weakref.WeakSet[Window] = weakref.WeakSet()


class Window:
    """The highest active memory since the window began or last restarted, in bytes."""

    def __init__(self) -> None:
        self._seen = 0  # the peaks folded in by resets since the window (re)started

    def peak(self) -> int:
        """The peak so far (read after :func:`mlx.core.synchronize`)."""
        mx.synchronize()
        # MLX's reset sets the counter to 0, not to the active memory: until the next allocation it reads low.
        return max(self._seen, mx.get_peak_memory(), mx.get_active_memory())

    def restart(self) -> None:
        """Start afresh from the memory active now."""
        reset()
        self._seen = 0


def reset() -> None:
    """Reset MLX's peak counter to the active memory (after queued work); open windows keep what they saw."""
    mx.synchronize()
    with _lock:
        peak = mx.get_peak_memory()
        for w in list(_open):
            w._seen = max(w._seen, peak)
        mx.reset_peak_memory()


@contextlib.contextmanager
def window() -> Iterator[Window]:
    """A :class:`Window` open inside, begun at entry.

    Example:
        >>> with window() as w:
        ...     mx.eval(step())
        >>> w.peak()
    """
    w = Window()
    w.restart()
    with _lock:  # threads open and reset windows too
        _open.add(w)
    try:
        yield w
    finally:
        with _lock:
            _open.discard(w)
