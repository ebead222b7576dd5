"""How every command shows its figures: in text (a median with its spread), and in plots (their caption,
where the figures came from, and how they are saved)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure


def spread(summary: dict[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    """A :func:`~nuvec_mlx_bench.core.rounds.summary` as ``median (min–max)``, each times ``scale``.

    Example:
        >>> spread({"median": 0.0123, "min": 0.011, "max": 0.0141}, scale=1e3)
        '12.3 (11.0–14.1)'
    """
    m, lo, hi = (summary[k] * scale for k in ("median", "min", "max"))
    return f"{m:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"


def caption(env: dict[str, str]) -> str:
    """Where a plot's figures came from: command, backend, device, MLX version, BLAS, throttle.

    Example:
        >>> caption(environment.environment("nuvec-mlx-bench"))
    """
    return (
        f"{env['command']}\nbackend {env['backend']}, {env['device']}, MLX {env['mlx']}, "
        f"BLAS {env['blas']}, nv.eval throttle {env.get('nv.eval throttle', 'default')}"
    )


def save_figure(fig: Figure, path: Path, text: str) -> Path:
    """Write ``fig`` to ``path`` (PNG) with ``text`` (a :func:`caption`) at its foot; return ``path``."""
    fig.text(0.01, 0.01, text, fontsize=6, va="bottom", wrap=True)
    fig.savefig(path, dpi=120)
    return path
