"""What one measured step says about each block: what it keeps, its stages' peaks, its recompute time.

A staged step's timeline (:func:`nuvec_mlx.memory.timeline`) has a reading
after every stage. Block stages (a block's forward, its backward, its
optimizer update) come in a known order: the blocks' forward stages in
order, then their backward stages last block first. Chunk stages (a chunked
checkpoint's, inside a block or between the blocks: the loss head) belong to
the block stage that follows them: their peaks count as its peak, their time
as its time. So the head's chunks, between the last block's forward and its
backward, count as the last block's backward: when they run, every block
holds what it keeps, as at that stage.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from ..memory import StageReading
from ._trial import StepReading


def _block_stages(stages: Sequence[StageReading]) -> list[StageReading]:
    """The block stages of a step's readings, each with the peak of the chunk stages before it."""
    out, highest = [], 0
    for r in stages:
        highest = max(highest, r.peak)
        if r.kind != "chunk":
            out.append(dataclasses.replace(r, peak=highest))
            highest = 0
    return out


@dataclasses.dataclass
class Profile:
    """One measured step with every block in one mode: what each block keeps and costs."""

    mode: str
    readings: list[StepReading]
    keeps: list[int]  # per block, bytes held from its forward to its backward stage
    forward: list[int]  # per block, its forward stage's peak above what was held before it
    backward: list[int | None]  # per block, its backward stage's peak above what was held before it
    rest: list[int | None]  # per block, what else the step held at its backward stage
    backward_seconds: list[float | None]
    outputs: int  # the last stage's peak, above the start

    @classmethod
    def of(cls, mode: str, readings: Sequence[StepReading], blocks: int) -> Profile:
        """Read a profile off steps' stages (``blocks`` forward stages, then up to as many backward
        ones): the mean of each figure over the steps (how far they vary is :func:`spread`),
        the last step's times (the first step also compiles)."""
        each = [cls._one(mode, r, blocks) for r in readings]

        def mean(*values: Any) -> Any:
            return None if values[0] is None else round(statistics.fmean(values))

        fields = ("keeps", "forward", "backward", "rest")
        keeps, forward, backward, rest = ([mean(*v) for v in zip(*(getattr(p, f) for p in each))] for f in fields)
        return cls(
            mode,
            list(readings),
            keeps,
            forward,
            backward,
            rest,
            each[-1].backward_seconds,
            mean(*(p.outputs for p in each)),
        )

    @classmethod
    def _one(cls, mode: str, reading: StepReading, blocks: int) -> Profile:
        stages = _block_stages(reading.stages)
        forward = [r for r in stages if r.kind == "forward"]
        backward = [r for r in stages if r.kind == "backward"][::-1]  # block order
        if len(forward) != blocks or len(backward) > blocks:
            raise ValueError(
                f"nv.plan expects each of the {blocks} blocks to run once per step, as one forward "
                f"and at most one backward stage; the step in mode {mode} had {len(forward)} forward "
                f"and {len(backward)} backward stages"
            )
        start, first = reading.start, blocks - len(backward)  # blocks before `first`: no backward stage
        held = [start] + [r.active for r in forward]
        where = {id(r): k for k, r in enumerate(stages)}
        previous = [stages[where[id(r)] - 1] for r in backward]  # the stage each backward stage follows
        # A block's update stage (nv.update) follows its backward stage: its peak counts as the block's.
        after = [stages[where[id(r)] + 1] for r in backward]
        peaks = [max(r.peak, a.peak if a.kind == "update" else 0) for r, a in zip(backward, after, strict=True)]
        before = [r.active for r in previous]
        pad: list[Any] = [None] * first
        return cls(
            mode,
            [reading],
            [held[j + 1] - held[j] for j in range(blocks)],
            [forward[j].peak - held[j] for j in range(blocks)],
            pad + [peaks[i] - before[i] for i in range(len(backward))],
            pad + [before[i] - held[first + i + 1] for i in range(len(backward))],
            pad + [r.seconds - p.seconds for r, p in zip(backward, previous, strict=True)],
            stages[-1].peak - start,
        )


def spread(readings: Sequence[StepReading]) -> int:
    """The most any stage's peak (above the step's start) differed between the readings of one step.

    Where a stage passed the throttle (start + ``free``), only above it: below
    it MLX's evaluator runs ahead freely, as far as the host gets before the
    worker thread, so a busy machine shows as a low reading there, not as a
    higher peak; above it the evaluator waits, and what varies is whether one
    more array is in flight at the peak.
    """
    free = min((r.free for r in readings), default=float("inf"))
    stages = zip(*([s.peak - r.start for s in r.stages] for r in readings))

    def low(peaks: Sequence[int]) -> float:
        return max(min(peaks), free) if max(peaks) > free else min(peaks)

    return max((int(max(peaks) - low(peaks)) for peaks in stages), default=0)


def highest(readings: Sequence[StepReading]) -> StepReading:
    """The reading with the highest peak, with the last one's time (the first step also compiles)."""
    top = max(readings, key=lambda r: r.peak)
    return dataclasses.replace(top, seconds=readings[-1].seconds)


def peak_stage(reading: StepReading) -> StageReading:
    """The block stage (or the outputs) during which ``reading``'s step peaked, its chunks counted in."""
    return max(_block_stages(reading.stages), key=lambda r: r.peak)
