"""Flat-list plumbing shared by the flat transforms and the pytree adapter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def substitute(items: Sequence[T], positions: Sequence[int], values: Sequence[Any]) -> list[T]:
    """A copy of ``items`` with ``values`` put at ``positions``, in order.

    Example:
        >>> substitute(["a", "b", "c"], [0, 2], ["x", "z"])
        ['x', 'b', 'z']
    """
    result = list(items)
    for i, v in zip(positions, values, strict=True):
        result[i] = v
    return result
