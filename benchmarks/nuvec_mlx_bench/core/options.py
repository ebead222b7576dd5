"""Command-line values every command reads the same way: lists, counts and memory sizes."""

from __future__ import annotations

import argparse
import math

from nuvec_mlx.memory import MiB
from nuvec_mlx.mlx_lm.plan import parse_bytes


def csv(text: str) -> list[str]:
    """A comma-separated list; empty items are dropped (``''`` is the empty list).

    Example:
        >>> csv("a,,b")
        ['a', 'b']
    """
    return [t for t in text.split(",") if t]


def positive(text: str) -> int:
    """An int >= 1, for ``type=``; anything else is a parser error.

    Example:
        >>> positive("3")
        3
    """
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text}")
    return n


def chunk_settings(text: str) -> dict[str, int | str]:
    """``--chunks``' comma-separated ``name=value`` pairs, as :meth:`nuvec_mlx.Chunks.from_settings` takes them:
    each value a size in tokens, ``auto``, or 0 (off).

    Raises:
        ValueError: an item without ``=``, or a value neither ``auto`` nor an int >= 0.

    Example:
        >>> chunk_settings("mlp=2048,attention=auto")
        {'mlp': 2048, 'attention': 'auto'}
    """
    settings: dict[str, int | str] = {}
    for item in csv(text):
        name, sep, value = item.partition("=")
        if not sep or not (value == "auto" or value.isdigit()):
            raise ValueError(f"--chunks: expected name=size, name=auto or name=0, got {item!r}")
        settings[name] = value if value == "auto" else int(value)
    return settings


def memory_size(text: str) -> int:
    """A memory size in bytes: with a unit (``"16GiB"``, ``"512MiB"``) or a bare number of MiB (``"0"``).

    Raises:
        ValueError: a size below 0, or a unit other than KiB, MiB, GiB, TiB.

    Example:
        >>> memory_size("1.5GiB") == memory_size("1536")
        True
    """
    try:
        mib = float(text)
    except ValueError:
        return parse_bytes(text)
    if not 0 <= mib < math.inf:
        raise ValueError(f"a memory size must be >= 0, got {text!r}")
    return int(mib * MiB)


def size_text(nbytes: int) -> str:
    """A memory size as the results print it, in the largest unit that keeps it whole (MiB at least).

    Example:
        >>> size_text(16 << 30), size_text(3 << 20)
        ('16GiB', '3MiB')
    """
    if nbytes and nbytes % (1 << 30) == 0:
        return f"{nbytes >> 30}GiB"
    return f"{nbytes / MiB:g}MiB"
