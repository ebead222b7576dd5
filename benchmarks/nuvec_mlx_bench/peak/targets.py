"""The benchmark's targets, checked against the rows of a run: one table, :data:`TARGETS`.

Ratios are against the plain step (``none``: no checkpoint, ``mx.eval``) of
the same workload in the same process. The targets were set for the seed's
shapes on a CPU and for the full suite on a GPU (``cuda`` or ``metal``); every
run checks those of its backend on its own shapes, so that a reader sees at
once where a run stands: at other shapes a hint, not the verdict. A missed
target's line says so itself: by how much, as a multiple of the bound, and,
at shapes other than those it was set for, which those were.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..seed.rows import label, shape_label, workload_of
from ..seed.workload import LONG_TRANSFORMER, SEED, WIDE_MLP, Workload
from . import depth

GPU = ("cuda", "metal")
CPU = ("cpu",)
ANY = CPU + GPU

#: One workload's rows, by ``(framework, strategy)``.
Rows = Mapping[tuple[str, str], dict[str, Any]]


def _field(framework: str, strategy: str, name: str) -> Callable[[Rows], float | None]:
    def read(rows: Rows) -> float | None:
        return rows.get((framework, strategy), {}).get(name)

    return read


def _spread(rows: Rows) -> float | None:
    r = rows.get(("mlx", "nuvec"))
    if r is None:
        return None
    low = min(r["peak"]["repeats"])
    return max(r["peak"]["repeats"]) / low if low else math.inf


def _against_torch_compile(rows: Rows) -> float | None:
    ours, theirs = rows.get(("mlx", "nuvec")), rows.get(("torch-compile", "checkpoint"))
    if not ours or not theirs or "error" in theirs:
        return None
    return ours["peak"]["median"] / theirs["peak"]["median"]


@dataclasses.dataclass(frozen=True)
class Target:
    """A bound on one measure of a workload's rows, and where it applies.

    Attributes:
        what: the measure, as the check line names it.
        measure: reads the measure from one workload's rows (the depth
            sweep's, for :data:`DEPTH`); ``None`` where the run lacks a row it needs.
        bound: the target: ``measure <= bound``, or with ``within``,
            ``|measure - 1| <= bound``.
        backends: the backends it is set for.
        model: the model it is set for (``None``: every model).
        weight_grads: the gradients it is set for (``None``: both).
        within: a two-sided bound around 1.
        policy: it compares ``nv.eval`` with ``mx.eval``, which at throttle
            ``inf`` are one and the same.
        set_for: the shapes its bound was set on (the weights' gradients
            aside); empty where it holds at any shape.
    """

    what: str
    measure: Callable[[Any], float | None]
    bound: float
    backends: tuple[str, ...]
    model: str | None = None
    weight_grads: bool | None = None
    within: bool = False
    policy: bool = False
    set_for: tuple[Workload, ...] = ()

    def applies(self, backend: str, model: str, weight_grads: bool) -> bool:
        """Whether the target is set for this backend and workload."""
        return backend in self.backends and self.model in (None, model) and self.weight_grads in (None, weight_grads)

    def line(self, heading: str, value: float, workload: Workload | None = None) -> str:
        """The check line: the value, the target, met or MISSED: by how much, as a multiple of the bound,
        and, where ``workload`` (the run's) has other shapes than those the target was set for, which."""
        off = abs(value - 1) if self.within else value
        target = f"1 ± {self.bound:g}" if self.within else f"<= {self.bound:g}"
        said = f"- {heading}: {self.what}: {value:.3f} (target {target})"
        if off <= self.bound:
            return f"{said}: met"
        times = f"{off / self.bound:.2f}x the {'distance from 1 allowed' if self.within else 'target'}"
        return f"{said}: MISSED by {off - self.bound:.3f} ({times}){self._elsewhere(workload)}"

    def _elsewhere(self, workload: Workload | None) -> str:
        """Where the target was set on other shapes than ``workload``'s: which, and what a miss means here."""
        shapes = [dataclasses.replace(w, weight_grads=False, compiled=True) for w in self.set_for]
        if not shapes or workload is None or dataclasses.replace(workload, weight_grads=False, compiled=True) in shapes:
            return ""
        named = " and ".join(shape_label(dataclasses.asdict(w)) for w in shapes)
        return f"; set for {named}: at this run's shapes a hint, not the verdict"


NUVEC_PEAK = _field("mlx", "nuvec", "peak_ratio")
NUVEC_TIME = _field("mlx", "nuvec", "time_ratio")
SPREAD = "nuvec peak max / min over the repeats"

#: Every target of a workload's rows.
#: The shapes the GPU targets were set on: the full suite's.
FULL_MLP, FULL_TRANSFORMER = (SEED, WIDE_MLP), (LONG_TRANSFORMER,)

TARGETS = (
    Target("nuvec peak / plain peak", NUVEC_PEAK, 0.22, GPU, model="mlp", set_for=FULL_MLP),
    Target(SPREAD, _spread, 1.10, GPU, model="mlp", set_for=FULL_MLP),
    Target("nuvec time / plain time", NUVEC_TIME, 1.25, GPU, model="mlp", weight_grads=True, set_for=FULL_MLP),
    Target("nuvec time / plain time", NUVEC_TIME, 1.55, GPU, model="mlp", weight_grads=False, set_for=FULL_MLP),
    Target(
        "nuvec peak / torch.compile+checkpoint peak (absolute)",
        _against_torch_compile,
        1.0,
        GPU,
        model="mlp",
        set_for=FULL_MLP,
    ),
    Target("nuvec peak / plain peak", NUVEC_PEAK, 0.20, GPU, model="transformer", set_for=FULL_TRANSFORMER),
    Target("nuvec peak / plain peak", NUVEC_PEAK, 0.17, CPU, model="mlp", set_for=(SEED,)),
    Target("nuvec time / plain time", NUVEC_TIME, 1.55, CPU, model="mlp", set_for=(SEED,)),
    Target(SPREAD, _spread, 1.10, CPU, model="mlp", set_for=(SEED,)),
    Target("plain nv.eval time / mx.eval time", _field("mlx", "none-policy", "time_ratio"), 1.03, ANY, policy=True),
    Target(
        "plain nv.eval peak / mx.eval peak",
        _field("mlx", "none-policy", "peak_ratio"),
        0.01,
        ANY,
        within=True,
        policy=True,
    ),
)


def _worst_growth(rows: list[dict[str, Any]]) -> float | None:
    return max((g for gs in depth.repeat_growth(rows, "nuvec") for g in gs), default=None)


#: The depth sweep's target: nuvec's peak growth per added block, in block inputs.
DEPTH = Target(
    "nuvec peak growth per added block (block inputs), between consecutive depths, worst over every repeat",
    _worst_growth,
    1.1,
    ANY,
)


def checks(rows: list[dict[str, Any]], backend: str, throttle: float | None) -> list[str]:
    """Markdown lines: each target that applies, the measured value and whether it was met.

    Args:
        rows: the run's rows (strategy table and depth sweep).
        backend: MLX's backend in the run (``cpu``, ``cuda`` or ``metal``).
        throttle: the throttle ``nv.eval`` ran at (``None``: nuvec_mlx's default,
            under which ``nv.eval`` of a step without stages is ``mx.eval``).

    Example:
        >>> checks(rows, "cpu", 1 << 20)[1]
        "Targets on this run's shapes (backend cpu; ratios against the plain step `none`, mx.eval):"
    """
    lines, unmeasured = [], []
    table = [r for r in rows if r["section"] == "strategies"]
    for heading, by in _by_workload(table).items():
        first = next(iter(by.values()))
        for t in TARGETS:
            if not t.applies(backend, first["model"], first["weight_grads"]):
                continue
            value = t.measure(by)
            if value is None:
                unmeasured.append(f"{heading}: {t.what}")
                continue
            lines.append(t.line(heading, value, workload_of(first)))
            if t.policy and throttle in (None, math.inf):
                lines.append(
                    f"  (at throttle {'inf' if throttle else 'default'} `nv.eval` of a step without "
                    "stages runs `mx.eval` itself: this compares one evaluation with itself, "
                    "and shows the measurement's spread and nv.eval's own overhead)"
                )
    swept = [r for r in rows if r["section"] == "depth" and r["framework"] == "mlx"]
    growth = DEPTH.measure(swept)
    if growth is not None:
        depths = ", ".join(str(d) for d in sorted({r["blocks"] for r in swept}))
        unit = workload_of(swept[0]).block_input_bytes() / 1024
        lines.append(DEPTH.line(f"depth sweep ({depths} blocks; a block input {unit:g} KiB)", growth))
    if unmeasured:
        lines.append("- not checked (a row it needs did not run): " + "; ".join(unmeasured))
    if not lines:
        return []
    return [
        "",
        f"Targets on this run's shapes (backend {backend}; ratios against the plain step `none`, mx.eval):",
        *lines,
    ]


def _by_workload(rows: list[dict[str, Any]]) -> dict[str, dict[tuple[str, str], dict[str, Any]]]:
    grouped: dict[str, dict[tuple[str, str], dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r or r["framework"] != "mlx":
            grouped.setdefault(label(r), {})[(r["framework"], r["strategy"])] = r
    return grouped
