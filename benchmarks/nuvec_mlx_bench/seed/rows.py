"""The shape of a seed workload's result row, the same for MLX and for the peers.

A row is a JSON-ready dict: where it was measured (``section``), by whom
(``framework``, ``strategy``), the :class:`~.workload.Workload`'s fields, the
workload's analytic ``floor`` (:func:`~.floors.floor`, bytes), and either a
measurement (:func:`nuvec_mlx_bench.core.rounds.measured`'s: ``peak`` in bytes
and ``time`` in seconds with every repeat, ``warmup_s``, MLX's ``parts``; and
``peak_to_floor``) or an ``error``; then whatever the framework adds (MLX's
``traces``, a peer's ``method``, ``version``, ``device`` ...). :func:`add_ratios`
adds the ratios against the plain step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .floors import floor
from .workload import Workload


def row(
    section: str, framework: str, strategy: str, workload: Workload, measurement: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    """One row: a :func:`measured` dict, or ``{"error": text}``, with what it measured.

    Args:
        section: ``"strategies"``, ``"depth"`` or ``"throttles"``.
        framework: ``"mlx"`` or a peer's name.
        strategy: how the blocks were checkpointed.
        workload: the model and shape.
        measurement: :func:`nuvec_mlx_bench.core.rounds.measured`'s dict (or an error).
        extra: more fields (for example ``traces`` or ``method``).

    Example:
        >>> row("strategies", "mlx", "none", SEED, rounds.measured([10 << 20], [0.5], 1.0))["peak_to_floor"]
        0.10416666666666667
    """
    r = {
        "section": section,
        "framework": framework,
        "strategy": strategy,
        **dataclasses.asdict(workload),
        "floor": floor(workload),
        **measurement,
        **extra,
    }
    if "peak" in r:
        r["peak_to_floor"] = r["peak"]["median"] / r["floor"]
    return r


def label(r: dict[str, Any]) -> str:
    """The workload of a row, as a short heading.

    Example:
        >>> label(row("strategies", "mlx", "none", SEED, {"error": "x"}))
        'mlp B=4096 D=256 8 blocks, input grad, compiled'
    """
    grads = "input+weight grads" if r["weight_grads"] else "input grad"
    mode = "compiled" if r["compiled"] else "eager"
    return f"{shape_label(r)}, {grads}, {mode}"


def shape_label(r: dict[str, Any]) -> str:
    """The shapes of a row's (or a :class:`Workload`'s, as a dict) model: ``mlp B=4096 D=256 8 blocks``."""
    shape = f"B={r['batch']}" + (f" T={r['seq']}" if r["model"] == "transformer" else "")
    return f"{r['model']} {shape} D={r['dim']} {r['blocks']} blocks"


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
