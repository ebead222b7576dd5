"""How a step is measured, the same way in every framework: its peak, its time and its parts, in rounds.

A :class:`Probe` reads one step's peak memory (MLX's allocator, PyTorch's,
JAX's or the process's resident set); :func:`peak` is the one way a peak is
taken. :func:`seconds` times a step: a GPU step of a few milliseconds, timed
on its own, varies by tens of percent with launch and host overheads (an MLX
step through ``mx.eval`` measured 1.29x itself on the H200 that way), so a
time is the mean of as many back-to-back steps as fill :data:`MIN_SECONDS`; a
step that takes longer on its own (every CPU step of the benchmark) is timed
once. :class:`Parts` collects where a step's time went (the host's dispatch,
the evaluation), as the step reports it. :func:`measure` runs several steps
(cases) round-robin, one repeat of every case before the next, so that a slow
spell of a shared machine falls on all of them alike, and summarises each
(:func:`summary`, :func:`measured`). This module imports no framework: the
peers' processes measure with it exactly as the MLX process does.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

#: One step: dispatches its work and returns what must be finished.
Step = Callable[[], Any]
#: Finishes a step's outputs: evaluates them and waits for the device.
Finish = Callable[[Any], None]
#: The least wall time one time measurement spans, in seconds.
MIN_SECONDS = 0.1
#: How the results describe a time.
TIMES = (
    f"warm steps until the device has finished, each the mean of back-to-back steps that fill "
    f"{MIN_SECONDS:g} s (a single step where one takes longer)"
)


class Probe(Protocol):
    """Reads the peak of one step: ``start`` before it, ``stop`` after it (bytes above the start).

    ``done`` comes after the last peak, before the timed steps; ``method``
    says how the peak is read, ``notes`` what a run of it found.
    """

    method: str
    notes: dict[str, Any]

    def start(self) -> None: ...

    def stop(self) -> int: ...

    def done(self) -> None: ...


class Parts:
    """Seconds a case's steps spent in named parts, summed over its calls.

    A case adds one call's parts as it runs (:meth:`add`); :func:`measure`
    takes a :meth:`snapshot` before each timed repeat and reads the mean per
    call since (:meth:`mean_since`).

    Example:
        >>> parts = Parts()
        >>> before = parts.snapshot()
        >>> parts.add(dispatch=0.002, evaluation=0.010)
        >>> parts.mean_since(before)
        {'dispatch': 0.002, 'evaluation': 0.01}
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls = 0

    def add(self, **seconds: float) -> None:
        """Add one call's seconds per part."""
        for name, value in seconds.items():
            self.seconds[name] += value
        self.calls += 1

    def snapshot(self) -> tuple[dict[str, float], int]:
        """The sums and the number of calls so far."""
        return dict(self.seconds), self.calls

    def mean_since(self, snapshot: tuple[dict[str, float], int]) -> dict[str, float]:
        """Each part's mean seconds per call since ``snapshot`` (empty if no call came since)."""
        sums, calls = snapshot
        if self.calls <= calls:
            return {}
        return {name: (total - sums.get(name, 0.0)) / (self.calls - calls) for name, total in self.seconds.items()}


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


def peak(step: Step, finish: Finish, probe: Probe) -> int:
    """Peak bytes of one step above what was in use before it, its outputs included.

    Example:
        >>> peak(lambda: make_outputs(), finish, probe)  # bytes
    """
    probe.start()
    outputs = step()
    finish(outputs)
    del outputs
    return probe.stop()


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and every value in the order measured (``repeats``).

    Example:
        >>> summary([3, 1, 2])
        {'median': 2, 'min': 1, 'max': 3, 'repeats': [3, 1, 2]}
    """
    if not values:
        raise ValueError("values must not be empty")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "repeats": list(values)}


def measured(
    peaks: Sequence[int], times: Sequence[float], warmup_s: float, parts: Sequence[dict[str, float]] = ()
) -> dict[str, Any]:
    """A measurement: the peaks and times of the repeats, the warm-up step's seconds, and, where the
    case reported them, each part's seconds per repeat (``parts``: one dict per repeat) summarised."""
    result = {"peak": summary(peaks), "time": summary(times), "warmup_s": warmup_s}
    names = [name for name in dict.fromkeys(n for p in parts for n in p) if all(name in p for p in parts)]
    if names:
        result["parts"] = {name: summary([p[name] for p in parts]) for name in names}
    return result


def measure(
    cases: Mapping[Any, tuple[Step, Finish]],
    repeats: int,
    probe: Probe,
    progress: Callable[[], None] = lambda: None,
    parts: Mapping[Any, Parts] | None = None,
) -> dict[Any, dict[str, Any]]:
    """Measure every case: a warm-up step each, then ``repeats`` rounds of peaks, then of times.

    The peaks come first: :class:`~nuvec_mlx_bench.peers.peak_probes.RssProbe`
    needs the process as it started, and ``probe.done()`` leaves it faster
    for the timed steps.

    Args:
        cases: name to ``(step, finish)``; ``finish`` must wait for the device.
        repeats: peaks and times per case.
        probe: how the peaks are read.
        progress: called after every step measured (``len(cases) * (2 * repeats + 1)`` calls).
        parts: name to the :class:`Parts` its case adds to; each timed repeat
            reads the mean per call over the calls it made.

    Returns:
        name to :func:`measured`'s dict.

    Example:
        >>> measure({"ones": (lambda: mx.ones((1024,)), finish)}, repeats=3, probe=probe)
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    parts = parts or {}
    warmup, peaks = {}, {name: [] for name in cases}
    times, split = {name: [] for name in cases}, {name: [] for name in cases}
    for name, (step, finish) in cases.items():
        warmup[name] = seconds(lambda step=step, finish=finish: finish(step()), min_seconds=0)  # compiles
        progress()
    for _ in range(repeats):
        for name, (step, finish) in cases.items():
            peaks[name].append(peak(step, finish, probe))
            progress()
    probe.done()
    for _ in range(repeats):
        for name, (step, finish) in cases.items():
            before = parts[name].snapshot() if name in parts else None
            times[name].append(seconds(lambda step=step, finish=finish: finish(step())))
            if before is not None:
                split[name].append(parts[name].mean_since(before))
            progress()
    return {name: measured(peaks[name], times[name], warmup[name], split[name]) for name in cases}
