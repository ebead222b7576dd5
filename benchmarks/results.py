"""The shape of a result row, the same for MLX and for the peers.

A row is a JSON-ready dict: where it was measured (``section``), by whom
(``framework``, ``strategy``), the :class:`~nuvec_mlx_bench.workload.Workload`'s
fields, the workload's analytic ``floor`` (:func:`nuvec_mlx_bench.floors.floor`,
bytes), and either a measurement (``peak`` in bytes and ``time`` in seconds,
each a :func:`summary` with every repeat, ``warmup_s``, and ``peak_to_floor``)
or an ``error``; then whatever the framework adds (MLX's ``traces``, a peer's
``method``, ``version``, ``device`` ...). :func:`add_ratios` adds the ratios
against the plain step.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from nuvec_mlx_bench.floors import floor
from nuvec_mlx_bench.workload import Workload


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and every value in the order measured (``repeats``).

    Example:
        >>> summary([3, 1, 2])
        {'median': 2, 'min': 1, 'max': 3, 'repeats': [3, 1, 2]}
    """
    if not values:
        raise ValueError("values must not be empty")
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "repeats": list(values)}


def measured(peaks: Sequence[int], times: Sequence[float], warmup_s: float) -> dict[str, Any]:
    """A measurement: the peaks and times of the repeats, and the warm-up step's seconds."""
    return {"peak": summary(peaks), "time": summary(times), "warmup_s": warmup_s}


def row(section: str, framework: str, strategy: str, workload: Workload,
        measurement: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One row: a :func:`measured` dict, or ``{"error": text}``, with what it measured.

    Args:
        section: ``"strategies"``, ``"depth"`` or ``"budgets"``.
        framework: ``"mlx"`` or a peer's name.
        strategy: how the blocks were checkpointed.
        workload: the model and shape.
        measurement: :func:`measured`'s dict (or an error).
        extra: more fields (for example ``traces`` or ``method``).

    Example:
        >>> row("strategies", "mlx", "none", SEED, measured([10 << 20], [0.5], 1.0))["peak_to_floor"]
        0.10416666666666667
    """
    r = {"section": section, "framework": framework, "strategy": strategy,
         **dataclasses.asdict(workload), "floor": floor(workload), **measurement, **extra}
    if "peak" in r:
        r["peak_to_floor"] = r["peak"]["median"] / r["floor"]
    return r


def label(r: dict[str, Any]) -> str:
    """The workload of a row, as a short heading.

    Example:
        >>> label(row("strategies", "mlx", "none", SEED, {"error": "x"}))
        'mlp B=4096 D=256 8 blocks, input grad, compiled'
    """
    shape = f"B={r['batch']}" + (f" T={r['seq']}" if r["model"] == "transformer" else "")
    grads = "input+weight grads" if r["weight_grads"] else "input grad"
    mode = "compiled" if r["compiled"] else "eager"
    return f"{r['model']} {shape} D={r['dim']} {r['blocks']} blocks, {grads}, {mode}"


def workload_of(r: dict[str, Any]) -> Workload:
    """The workload a row measured."""
    return Workload(**{f.name: r[f.name] for f in dataclasses.fields(Workload)})


def add_ratios(rows: list[dict[str, Any]], base: str = "none") -> list[dict[str, Any]]:
    """Add ``peak_ratio`` and ``time_ratio`` against the ``base`` strategy's medians.

    ``rows`` are one framework's rows of one workload; rows with an error, or
    all of them when the base has one, get no ratios. Returns ``rows``.
    """
    plain = next((r for r in rows if r["strategy"] == base and "error" not in r), None)
    for r in rows:
        if plain is not None and "error" not in r:
            r["peak_ratio"] = r["peak"]["median"] / plain["peak"]["median"]
            r["time_ratio"] = r["time"]["median"] / plain["time"]["median"]
    return rows
