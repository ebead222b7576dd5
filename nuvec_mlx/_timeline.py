"""A memory timeline: MLX memory after each stage of the evaluations of a step.

Inside :func:`timeline`, :func:`nuvec_mlx.eval` reads MLX's memory after
every stage (after :func:`mlx.core.synchronize`): the active memory, and the
peak the stage reached (MLX's peak counter is reset as each evaluation starts
and after each reading; ``nv.memory.measure`` and ``nv.memory.ceiling``,
nested either way, still see their own peaks). The result names where the step
peaks, and writes JSON and a PNG plot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx

from . import _marks, _peak, _registry, _units, _validate


@dataclasses.dataclass(frozen=True)
class StageReading:
    """Memory after one stage, in bytes.

    Attributes:
        evaluation: which ``nv.eval`` inside the timeline (from 0).
        index: the stage's place in that evaluation (from 0); the last is the
            evaluation of the arrays themselves.
        kind: ``"forward"``, ``"backward"``, ``"update"`` (of a block's
            parameters, by an optimizer inside the step), ``"chunk"`` (one
            chunk of a chunked checkpoint, forward or backward) or ``"outputs"``.
        block: the checkpointed block the stage ends (from 1), when known
            (``None`` for a chunk).
        seconds: since the timeline began.
        active: MLX's active memory after the stage.
        peak: the highest active memory during the stage.
    """

    evaluation: int
    index: int
    kind: str
    block: int | None
    seconds: float
    active: int
    peak: int

    def name(self) -> str:
        """The stage in words, e.g. ``backward pass of block 3``."""
        if self.kind == "outputs":
            return "the evaluation of the outputs"
        if self.kind == "update" and self.block:
            return f"update of block {self.block}'s parameters"
        if self.kind == _marks.CHUNK:
            return f"chunk stage {self.index + 1}"
        return f"{self.kind} pass of block {self.block}" if self.block else f"{self.kind} stage {self.index + 1}"


@dataclasses.dataclass
class Timeline:
    """The readings of one :func:`timeline` block."""

    readings: list[StageReading] = dataclasses.field(default_factory=list)

    def peak(self) -> StageReading:
        """The reading with the highest peak."""
        if not self.readings:
            raise ValueError("the timeline holds no readings: no nv.eval ran inside it")
        return max(self.readings, key=lambda r: r.peak)

    def describe(self) -> str:
        """Where the step peaks, in one sentence."""
        top = self.peak()
        return (
            f"peak {top.peak / _units.MiB:.1f} MiB during {top.name()} "
            f"(stage {top.index + 1} of evaluation {top.evaluation + 1}, {len(self.readings)} readings)"
        )

    def to_dict(self) -> dict:
        """The readings, and the peak, as plain data."""
        return {
            "readings": [dataclasses.asdict(r) for r in self.readings],
            "peak": dataclasses.asdict(self.peak()) | {"name": self.peak().name()},
        }

    def save_json(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` as JSON to ``path``."""
        path = _validate.check_path(path, "path")
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def plot(self, path: str | Path, title: str = "MLX memory per stage") -> Path:
        """Plot active memory and each stage's peak against time, stages marked, to a PNG.

        Needs matplotlib (``pip install "nuvec-mlx[bench]"``). Draws on a figure of
        its own, without pyplot: the backend and figures of a notebook or script
        are left as they were.
        """
        path = _validate.check_path(path, "path")
        _validate.check_str(title, "title")
        try:
            from matplotlib.figure import Figure
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("Timeline.plot needs matplotlib: pip install matplotlib") from e
        top = self.peak()
        t = [r.seconds * 1e3 for r in self.readings]
        fig = Figure(figsize=(8, 4))
        ax = fig.subplots()
        ax.step(t, [r.active / _units.MiB for r in self.readings], where="post", label="active after the stage")
        colors = {
            "forward": "tab:blue",
            "backward": "tab:orange",
            "update": "tab:purple",
            "chunk": "tab:gray",
            "outputs": "tab:green",
        }
        for kind in colors:
            rs = [(x, r) for x, r in zip(t, self.readings) if r.kind == kind]
            if rs:
                ax.scatter(
                    [x for x, _ in rs],
                    [r.peak / _units.MiB for _, r in rs],
                    color=colors[kind],
                    s=14,
                    label=f"peak during a {kind} stage" if kind != "outputs" else "peak: outputs",
                )
        ax.annotate(
            f"peak: {top.name()}",
            (top.seconds * 1e3, top.peak / _units.MiB),
            xytext=(10, -14),
            textcoords="offset points",
            fontsize=8,
        )
        ax.set_xlabel("ms since the timeline began")
        ax.set_ylabel("MiB")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return path


class _Recorder:
    def __init__(self, result: Timeline, stage: _peak.Window):
        self.result, self.start, self.evaluation = result, time.perf_counter(), -1
        self.stage = stage  # the peak since the last reading
        self.forward = self.backward = 0

    def __call__(self, index: int, count: int, stage_kind: str) -> None:
        mx.synchronize()
        if index == 0:
            self.evaluation += 1
            self.forward = self.backward = 0
        self.forward += stage_kind == _marks.FORWARD
        self.backward += stage_kind == _marks.BACKWARD
        # Forward stages end blocks 1, 2, ...; backward ones reach them last first; an update follows its block's.
        block = self.forward if stage_kind == _marks.FORWARD else self.forward - self.backward + 1
        known = block > 0 and stage_kind not in ("outputs", _marks.CHUNK)
        self.result.readings.append(
            StageReading(
                self.evaluation,
                index,
                stage_kind,
                block if known else None,
                time.perf_counter() - self.start,
                mx.get_active_memory(),
                self.stage.peak(),
            )
        )
        self.stage.restart()


@contextlib.contextmanager
def timeline() -> Iterator[Timeline]:
    """Record MLX's memory after every stage of the :func:`nuvec_mlx.eval` calls inside.

    Example:
        >>> with nv.memory.timeline() as t:
        ...     nv.eval(step(xs))
        >>> print(t.describe())
        >>> t.plot("timeline.png")
    """
    result = Timeline()
    with _peak.window() as stage, _registry.observing(_Recorder(result, stage), stage.restart):
        yield result
