"""What a peer needs from its framework, and the framework behind each peer.

:func:`load` imports the framework (PyTorch or JAX) only when it is called:
this module, like the whole package, imports neither at its top.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..core.rounds import Probe
from ..seed.workload import Workload
from . import PEERS


class Framework(Protocol):
    """A peer's framework: the step, a peak probe, a barrier, the results on the host."""

    def info(self) -> dict[str, Any]:
        """Version, device and how matmuls are computed."""

    def probe(self) -> Probe:
        """How this framework's peaks are read here."""

    def sync(self, outputs: Any) -> None:
        """Wait until ``outputs`` are computed."""

    def train_step(self, workload: Workload, strategy: str) -> tuple[Callable[[], list], dict[str, Any]]:
        """The step (its outputs: the gradients, weights first, then the loss) and notes on it."""

    def allocation(self, nbytes: int) -> Callable[[], Any]:
        """A step that allocates ``nbytes`` and returns them (for calibration)."""

    def to_numpy(self, outputs: list) -> list[np.ndarray]:
        """Outputs on the host."""


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load(peer: str) -> Framework:
    """The framework behind a peer (imports it).

    Raises:
        ValueError: ``peer`` is not one of :data:`~nuvec_mlx_bench.peers.PEERS`.

    Example:
        >>> load("jax-jit").info()["version"]
        'jax 0.10.2 (jaxlib 0.10.2)'
    """
    if peer not in PEERS:
        raise ValueError(f"peer must be one of {PEERS}, got {peer!r}")
    if peer == "jax-jit":
        from .jax_peer import Jax

        return Jax()
    from .torch_peer import Torch

    return Torch(compiled=peer == "torch-compile")
