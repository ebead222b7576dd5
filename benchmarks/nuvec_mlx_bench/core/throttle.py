"""``nv.eval``'s throttle on the command line and in the results."""

from __future__ import annotations

import math

from nuvec_mlx.memory import MiB


def parse_throttle(text: str) -> float:
    """A throttle from the command line: MiB (``"0"``, ``"64"``, ``"0.5"``) or ``"inf"``, in bytes.

    Raises:
        ValueError: ``text`` is neither ``"inf"`` nor a number of MiB >= 0.

    Example:
        >>> parse_throttle("0.5")
        524288
    """
    if text == "inf":
        return math.inf
    mib = float(text)
    if not mib >= 0:
        raise ValueError(f"a throttle must be 'inf' or MiB >= 0, got {text!r}")
    return int(mib * MiB)


def throttle_text(nbytes: float | None) -> str:
    """A throttle as the results print it; ``None`` is nuvec_mlx's default.

    Example:
        >>> throttle_text(math.inf)
        'inf (no throttle: the stages alone)'
    """
    if nbytes is None:
        return "nuvec_mlx's default (staged evaluations: 1 MiB on CPU, inf on a GPU; others: mx.eval)"
    return "inf (no throttle: the stages alone)" if nbytes == math.inf else f"{nbytes / MiB:g} MiB"
