"""How a peer's peak is read: the framework's own allocator on a GPU, the resident set on a CPU.

Peaks are read from the framework's own allocator on a GPU (PyTorch's
:class:`TorchCudaProbe`; JAX's, whose peak cannot be reset, through a padding
buffer: :class:`JaxStatsProbe`) and from the process's resident high-water
mark on a CPU, where neither framework counts its peak (:class:`RssProbe`).
Each is a :class:`nuvec_mlx_bench.core.rounds.Probe`, and every result says how
its peak was read in ``method``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np

#: The peer processes' environment. glibc maps every buffer of 64 KiB and more on
#: its own and unmaps it when it is freed, so that the resident set follows the
#: live buffers (glibc reads this at start only; :class:`RssProbe` needs it);
#: JAX allocates GPU memory as it goes instead of taking 75% of it up front.
ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "131072",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}
#: glibc's mallopt parameters, and what RssProbe.done sets them to for the timed steps
#: (the mmap threshold's maximum, where glibc's own sliding threshold tends).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
FAST_MMAP_THRESHOLD, FAST_TRIM_THRESHOLD = 32 << 20, 64 << 20


def _status_kib(field: str) -> int:
    """A field of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class RssProbe:
    """The process's resident high-water mark (Linux, glibc), for frameworks that count no CPU peak.

    ``start`` hands glibc's free heap back (``malloc_trim``), resets the
    high-water mark to the resident set (``5`` into ``/proc/self/clear_refs``)
    and notes the resident set; ``stop`` returns ``VmHWM`` minus that. It needs
    the process started with :data:`ENV`'s glibc settings, which unmap freed
    buffers: with glibc's defaults, freed buffers stay in its heap and the
    figure overstates two- to fourfold. Those settings also slow steps down
    (every buffer is fresh pages: PyTorch's CPU steps threefold), so ``done``
    raises glibc's thresholds (mmap 32 MiB, its maximum; trim 64 MiB) for the
    timed steps that follow. Only touched pages count, and everything the
    process touches.
    """

    method = (
        "resident high-water mark: VmHWM minus VmRSS before the step, the mark reset through "
        "/proc/self/clear_refs; glibc unmapping freed buffers of 64 KiB and more "
        "(MALLOC_MMAP_THRESHOLD_=65536), its free heap trimmed first"
    )

    def __init__(self) -> None:
        if os.environ.get("MALLOC_MMAP_THRESHOLD_") != ENV["MALLOC_MMAP_THRESHOLD_"]:
            raise RuntimeError(
                "a resident-set peak needs the process started with MALLOC_MMAP_THRESHOLD_="
                f"{ENV['MALLOC_MMAP_THRESHOLD_']} (run_isolated sets it)"
            )
        self.notes: dict[str, Any] = {"time_note": "glibc mmap threshold 32 MiB, trim threshold 64 MiB"}
        self._libc = ctypes.CDLL(None)
        self._base = 0

    def start(self) -> None:
        self._libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        self._base = _status_kib("VmRSS")

    def stop(self) -> int:
        return (_status_kib("VmHWM") - self._base) * 1024

    def done(self) -> None:
        self._libc.mallopt(M_MMAP_THRESHOLD, FAST_MMAP_THRESHOLD)
        self._libc.mallopt(M_TRIM_THRESHOLD, FAST_TRIM_THRESHOLD)


class TorchCudaProbe:
    """PyTorch's CUDA caching allocator: its peak of allocated bytes, reset before the step."""

    method = (
        "torch.cuda.max_memory_allocated() minus memory_allocated() before the step, after "
        "synchronize, empty_cache and reset_peak_memory_stats"
    )

    def __init__(self, torch: Any) -> None:
        self.cuda = torch.cuda
        self.notes: dict[str, Any] = {}
        self._base = 0

    def start(self) -> None:
        self.cuda.synchronize()
        self.cuda.empty_cache()
        self.cuda.reset_peak_memory_stats()
        self._base = self.cuda.memory_allocated()

    def stop(self) -> int:
        self.cuda.synchronize()
        return self.cuda.max_memory_allocated() - self._base

    def done(self) -> None:
        pass


class JaxStatsProbe:
    """JAX's device allocator stats, whose lifetime ``peak_bytes_in_use`` cannot be reset.

    Compiling alone (XLA's autotuning) sets a lifetime peak far above a small
    step's, so ``start`` first fills the gap: it places a padding buffer that
    brings ``bytes_in_use`` up to the lifetime peak, so that whatever the step
    adds shows as a new peak. The figure is ``peak_bytes_in_use`` after the
    step minus ``bytes_in_use`` before it (the padding included); each
    measurement raises the lifetime peak, and the next padding, by one step's
    peak. ``notes["peak_exact"]`` is false if a padding fell short of the
    lifetime peak (the figure then a lower bound). JAX's allocator counts
    whole chunks in use, so the figure includes its internal fragmentation,
    which XLA's own plan (``xla_temp_bytes`` + ``xla_output_bytes``) does not.
    """

    method = (
        "device.memory_stats(): peak_bytes_in_use after the step minus bytes_in_use before it; "
        "JAX cannot reset the peak, so a padding buffer first brings bytes_in_use up to it"
    )

    def __init__(self, jax: Any, device: Any) -> None:
        self.jax, self.device = jax, device
        self.notes: dict[str, Any] = {"peak_exact": True}
        self._pad: Any = None
        self._base = 0

    def start(self) -> None:
        stats = self.device.memory_stats()
        gap = stats["peak_bytes_in_use"] - stats["bytes_in_use"]
        if gap > 0:
            self._pad = self.jax.device_put(np.zeros(gap, np.uint8), self.device).block_until_ready()
        stats = self.device.memory_stats()
        self.notes["peak_exact"] &= stats["bytes_in_use"] >= stats["peak_bytes_in_use"]
        self._base = stats["bytes_in_use"]

    def stop(self) -> int:
        self._pad = None
        return self.device.memory_stats()["peak_bytes_in_use"] - self._base

    def done(self) -> None:
        pass
