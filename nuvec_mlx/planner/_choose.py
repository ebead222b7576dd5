"""Choosing how each block runs so that the predicted peak fits, at the least recompute time.

The peak model (measured by :mod:`nuvec_mlx.planner.plan`): a staged step evaluates
the blocks' forward passes one by one, then their backward passes last block
first. While block ``j`` runs forward, memory holds what the blocks before it
kept (their outputs, and the activations their mode keeps for the backward
pass); while it runs backward, the same, plus what ``j`` kept itself and the
rest of the step (the gradients already computed, the cotangent). So every
stage's peak is a prefix sum over the earlier blocks' choices plus a term of
the block's own choice, and a dynamic programme over the blocks, keeping for
each amount kept so far the cheapest way to get there, finds the cheapest
choice whose every stage fits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

#: The resolution of the amounts kept, as a fraction of the limit: choices within
#: one such step of each other are merged (the cheaper one stays).
RESOLUTION = 1 / 4096


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to run one block, and what it costs, in bytes above the step's start.

    Attributes:
        mode: the mode's name.
        keeps: what the block holds from its forward to its backward pass, its output included.
        forward: its forward stage's peak, above what the blocks before it keep.
        backward: its backward stage's peak, above what the blocks before it keep
            (its own keeps and the rest of the step included); ``None`` when it has no backward stage.
        cost: recompute seconds per step.
    """

    mode: str
    keeps: int
    forward: int
    backward: int | None
    cost: float

    def need(self, before: int) -> tuple[int, str]:
        """The highest of this block's stage peaks when the blocks before it keep ``before``, and its stage."""
        if self.backward is not None and self.backward > self.forward:
            return before + self.backward, "backward"
        return before + self.forward, "forward"


@dataclasses.dataclass(frozen=True)
class Choice:
    """A mode for every block, its predicted peak above the step's start, and its recompute cost."""

    modes: tuple[str, ...]
    peak: int
    cost: float
    at: tuple[int, str]  # the block whose stage peaks and its kind; (len(modes), "outputs") for the outputs


def choose(options: Sequence[Sequence[Option]], limit: float, outputs: int) -> Choice | None:
    """The cheapest mode per block whose predicted peak is at most ``limit``; ``None`` if none fits.

    Args:
        options: for each block, the ways it can run.
        limit: bytes above the step's start that no stage may exceed.
        outputs: the peak of the last stage (the arrays themselves: the
            optimizer's update, the gradients handed over), the same whatever the modes.

    Example:
        >>> keep, full = Option("keep", 10, 2, 12, 0.0), Option("full", 1, 2, 14, 1.0)
        >>> choose([[keep, full]] * 2, limit=21, outputs=5).modes
        ('full', 'keep')
    """
    if outputs > limit:
        return None
    step = max(1.0, limit * RESOLUTION)
    # amount kept so far -> (cost, peak so far, where, modes): the cheapest way found to keep it.
    frontier: dict[int, tuple] = {0: (0.0, outputs, (len(options), "outputs"), (), 0)}
    for j, block in enumerate(options):
        reached: dict[int, tuple] = {}
        for cost, peak, at, modes, kept in frontier.values():
            for option in block:
                need, kind = option.need(kept)
                if need > limit:
                    continue
                total = kept + option.keeps
                entry = (
                    cost + option.cost,
                    max(peak, need),
                    (j, kind) if need > peak else at,
                    modes + (option.mode,),
                    total,
                )
                bucket = math.floor(total / step)
                if bucket not in reached or entry[:2] < reached[bucket][:2]:
                    reached[bucket] = entry
        frontier = _pareto(reached)
        if not frontier:
            return None
    cost, peak, at, modes, _ = min(frontier.values(), key=lambda e: e[:2])
    return Choice(modes, peak, cost, at)


def _pareto(reached: dict[int, tuple]) -> dict[int, tuple]:
    """Drop the entries that keep more and cost no less than another."""
    kept: dict[int, tuple] = {}
    best = math.inf
    for bucket in sorted(reached):
        if reached[bucket][0] < best:
            best = reached[bucket][0]
            kept[bucket] = reached[bucket]
    return kept


def smallest(options: Sequence[Sequence[Option]], outputs: int) -> Choice:
    """The choice with the smallest predicted peak (the cheapest among those)."""
    high = (
        outputs
        + sum(max(o.keeps for o in block) for block in options)
        + max(max(max(o.forward, o.backward or 0) for o in block) for block in options)
    )
    low = outputs
    best = choose(options, high, outputs)
    assert best is not None  # every mode of every block fits under high
    while high - low > max(1, high * RESOLUTION):
        middle = (low + high) // 2
        found = choose(options, middle, outputs)
        if found is None:
            low = middle
        else:
            best, high = found, found.peak
    # choose's buckets follow its limit, so at best.peak it could in principle find nothing; the
    # planner would then fail on None, as it always has (returning best instead would change it).
    return choose(options, best.peak, outputs)  # type: ignore[return-value]
