"""Where the figures came from: command, MLX version, backend, device, BLAS."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from pathlib import Path

import mlx.core as mx

import nuvec_mlx as nv


def backend() -> str:
    """MLX's backend for the default device: ``cpu``, ``cuda`` or ``metal``."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


def blas() -> str:
    """The BLAS MLX's CPU backend uses: the BLAS libraries mapped into this process
    from MLX's own packages (NumPy's OpenBLAS, also mapped, is not MLX's)."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        maps = Path("/proc/self/maps").read_text().split("\n")
    except OSError:
        return "unknown"
    paths = {Path(line.split()[-1]) for line in maps if "blas" in line.lower()}
    mlx_libs = sorted(p.name for p in paths if any(part.startswith("mlx") for part in p.parts))
    if mlx_libs:
        return ", ".join(mlx_libs) + " (bundled with the mlx wheel)"
    return ", ".join(sorted(p.name for p in paths)) or "unknown"


def command_line(prog: str, argv: list[str] | None) -> str:
    """The command that ran: ``prog`` and its arguments (``sys.argv``'s unless ``argv`` is given).

    Example:
        >>> command_line("nuvec-mlx-bench", ["--suite", "full"])
        'nuvec-mlx-bench --suite full'
    """
    return shlex.join([prog, *(sys.argv[1:] if argv is None else argv)])


def environment(command: str) -> dict[str, str]:
    """Where the figures came from: command, MLX, backend, device, BLAS, Python, date.

    Args:
        command: the command line that ran the benchmark, as a reader would type it.

    Example:
        >>> environment("nuvec-mlx-bench --suite full")["backend"]
        'cpu'
    """
    on = backend()
    return {
        "command": command,
        "mlx": mx.__version__,
        "nuvec_mlx": nv.__version__,
        "backend": on,
        "device": mx.device_info().get("device_name", platform.machine()),
        "cpu_count": str(os.cpu_count()),
        "blas": blas() if on == "cpu" else "n/a (GPU)",
        "MLX_MAX_OPS_PER_BUFFER": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "unset (MLX default)"),
        "ranks": str(mx.distributed.init().size()),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
