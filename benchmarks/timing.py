"""How a step is timed, the same way in every framework.

A GPU step of a few milliseconds, timed on its own, varies by tens of percent
with launch and host overheads: an MLX step through ``mx.eval`` measured 1.29x
itself on the H200 that way. So a time is the mean of as many back-to-back
steps as fill :data:`MIN_SECONDS`; a step that takes longer on its own (every
CPU step of the benchmark) is timed once. This module imports no framework, so
that the peers' processes time their steps exactly as MLX's are timed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

#: The least wall time one measurement spans, in seconds.
MIN_SECONDS = 0.1


def seconds(run: Callable[[], object], min_seconds: float = MIN_SECONDS) -> float:
    """Seconds per call of ``run``, averaged over calls that fill ``min_seconds``.

    Args:
        run: one whole step, returning once the device has finished it.
        min_seconds: the least time measured; 0 times a single call.

    Returns:
        The first call's time if it took ``min_seconds`` or more, else the mean
        of as many further calls as that call's time says fill ``min_seconds``.

    Example:
        >>> seconds(lambda: mx.eval(step(xs)) or mx.synchronize())
    """
    start = time.perf_counter()
    run()
    once = time.perf_counter() - start
    if once >= min_seconds:
        return once
    calls = math.ceil(min_seconds / max(once, 1e-6))
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls
