"""A training step's peak memory, and mlx-lm's report line that ends with it.

mlx-lm reports ``mx.get_peak_memory()``: the process's high-water mark since
it started (model loading included), read without waiting for the device.
:class:`StepPeaks` measures each step on its own with
:func:`nuvec_mlx.memory.measure` (after :func:`mlx.core.synchronize`, the
cache left as it is): the highest active memory during the step, weights and
optimizer state included; and it keeps the process's high-water mark as
mlx-lm reports it, which resetting MLX's peak counter would otherwise lose.
Under ``mlx.launch`` each rank measures its own steps, and each report gathers
every rank's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.cli_ui import TrainUI as MlxLmTrainUI

from .. import _distributed, memory


class StepPeaks:
    """The highest peak of the steps since the last :meth:`report`, in bytes, and the process's.

    Example:
        >>> peaks = StepPeaks()
        >>> with peaks.step():
        ...     nv.eval(step(batch))
        >>> process_peak, step_peaks = peaks.report(mx.distributed.init())
    """

    def __init__(self) -> None:
        self.process = 0
        self.steps = 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Measure the step inside: active memory at entry plus the peak above it."""
        mx.synchronize()
        self.process = max(self.process, mx.get_peak_memory())
        with memory.measure(clear_cache=False) as m:
            yield
        self.steps = max(self.steps, m.start + m.rise)

    def report(self, group: mx.distributed.Group) -> tuple[int, list[int]]:
        """The process's peak so far, and the steps' highest peak since the last report on each rank of
        ``group``, in rank order: a collective (every rank reports at the same point)."""
        mx.synchronize()
        process, steps = max(self.process, mx.get_peak_memory()), self.steps
        self.steps = 0
        return process, [row[0] for row in _distributed.gather([steps], group)]


def peak_text(nbytes: int) -> str:
    """A peak in GB as mlx-lm writes memory (MB below 0.1 GB, kB below 0.1 MB).

    Example:
        >>> peak_text(1_234_000_000), peak_text(45_600_000), peak_text(1024)
        ('1.234 GB', '45.6 MB', '1.0 kB')
    """
    if nbytes >= 1e8:
        return f"{nbytes / 1e9:.3f} GB"
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"


class _Line:
    """Stands in for the console while mlx-lm writes a report line: keeps what it prints."""

    def __init__(self) -> None:
        self.printed: list[Any] = []

    def print(self, *objects: Any, **_: Any) -> None:
        self.printed.extend(objects)


def peaks_text(nbytes: list[int]) -> tuple[str, str]:
    """The report line's end, a label and the peaks: one process's, or every rank's, in rank order.

    Example:
        >>> peaks_text([45_600_000]), peaks_text([45_600_000, 46_100_000])
        (('peak', '45.6 MB'), ('peak per rank', '45.6 MB, 46.1 MB'))
    """
    return "peak" if len(nbytes) == 1 else "peak per rank", ", ".join(peak_text(n) for n in nbytes)


class TrainUI(MlxLmTrainUI):
    """mlx-lm's training display; its report line ends with the steps' peak memory, each rank's."""

    def report_train(
        self, it: int, train_loss: float, tokens_sec: float, trained_tokens: int, step_peak: int | list[int] = 0
    ) -> None:
        """mlx-lm's report line (iteration, loss, tokens/s, tokens), then ``step_peak``: this process's, or
        every rank's (a list in rank order)."""
        console, line = self._console, _Line()
        self._console = line  # type: ignore[assignment]  # a stand-in that keeps the one line printed
        try:
            super().report_train(it, train_loss, tokens_sec, trained_tokens)
        finally:
            self._console = console
        if line.printed:  # rank 0 only, as mlx-lm's
            *before, last = line.printed
            for obj in before:
                console.print(obj)
            label, values = peaks_text([step_peak] if isinstance(step_peak, int) else step_peak)
            console.print(f"{last}    [ui.muted]{label}[/ui.muted] [ui.strong]{values}[/ui.strong]")
