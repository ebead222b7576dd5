"""Numbers gathered from every process of a distributed group, in rank order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx


def gather(values: Sequence[int], group: mx.distributed.Group) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), rank 0 first, with one
    :func:`mlx.core.distributed.all_gather` (as int64): a collective, so every rank of ``group`` must
    call it at the same point, or the others wait.

    Example:
        >>> gather([peak], mx.distributed.init())  # [[rank 0's peak], [rank 1's peak], ...]
    """
    gathered = mx.distributed.all_gather(mx.array(list(values), dtype=mx.int64), group=group)
    return cast("list[list[int]]", gathered.reshape(group.size(), len(values)).tolist())
