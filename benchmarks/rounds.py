"""How a step is measured, the same way in every framework: its peak and its time, in rounds.

A :class:`Probe` reads one step's peak memory (MLX's allocator, PyTorch's,
JAX's or the process's resident set); :func:`peak` is the one way a peak is
taken. :func:`measure` runs several steps (cases) round-robin, one repeat of
every case before the next, so that a slow spell of a shared machine falls
on all of them alike. This module imports no framework: the peers' processes
measure with it exactly as the MLX process does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from nuvec_mlx_bench import timing
from nuvec_mlx_bench.results import measured

#: One step: dispatches its work and returns what must be finished.
Step = Callable[[], Any]
#: Finishes a step's outputs: evaluates them and waits for the device.
Finish = Callable[[Any], None]


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


def measure(cases: Mapping[str, tuple[Step, Finish]], repeats: int, probe: Probe,
            progress: Callable[[], None] = lambda: None) -> dict[str, dict[str, Any]]:
    """Measure every case: a warm-up step each, then ``repeats`` rounds of peaks, then of times.

    The peaks come first: :class:`~nuvec_mlx_bench.peers.peak_probes.RssProbe`
    needs the process as it started, and ``probe.done()`` leaves it faster
    for the timed steps.

    Args:
        cases: name to ``(step, finish)``; ``finish`` must wait for the device.
        repeats: peaks and times per case.
        probe: how the peaks are read.
        progress: called after every step measured (``len(cases) * (2 * repeats + 1)`` calls).

    Returns:
        name to :func:`~nuvec_mlx_bench.results.measured`'s dict.

    Example:
        >>> measure({"ones": (lambda: mx.ones((1024,)), finish)}, repeats=3, probe=probe)
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    warmup, peaks, times = {}, {name: [] for name in cases}, {name: [] for name in cases}
    for name, (step, finish) in cases.items():
        warmup[name] = timing.seconds(lambda: finish(step()), min_seconds=0)  # compiles
        progress()
    for _ in range(repeats):
        for name, (step, finish) in cases.items():
            peaks[name].append(peak(step, finish, probe))
            progress()
    probe.done()
    for _ in range(repeats):
        for name, (step, finish) in cases.items():
            times[name].append(timing.seconds(lambda: finish(step())))
            progress()
    return {name: measured(peaks[name], times[name], warmup[name]) for name in cases}
