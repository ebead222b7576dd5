"""The depth sweep's measure: how much a strategy's peak grows per added block.

Growth is counted in block inputs (:meth:`~nuvec_mlx_bench.seed.workload.Workload.block_input_bytes`)
between consecutive depths: of the medians, or of each repeat, pairing the
repeats of two depths by their index.
"""

from __future__ import annotations

from typing import Any

from ..seed.rows import workload_of


def _by_depth(rows: list[dict[str, Any]], strategy: str) -> list[dict[str, Any]]:
    return sorted((r for r in rows if r["strategy"] == strategy and "error" not in r), key=lambda r: r["blocks"])


def _steps(rs: list[dict[str, Any]], peak_of) -> list[float]:
    return [
        (peak_of(b) - peak_of(a)) / (b["blocks"] - a["blocks"]) / workload_of(a).block_input_bytes()
        for a, b in zip(rs, rs[1:])
    ]


def median_growth(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each strategy's median-peak growth per added block, between consecutive depths.

    Args:
        rows: the depth sweep's rows (one per strategy and depth).

    Example:
        >>> median_growth(depth_rows)["nuvec"]  # block inputs per block: 4 -> 8, 8 -> 16, 16 -> 32
        [g1, g2, g3]
    """
    return {
        s: _steps(_by_depth(rows, s), lambda r: r["peak"]["median"]) for s in dict.fromkeys(r["strategy"] for r in rows)
    }


def repeat_growth(rows: list[dict[str, Any]], strategy: str) -> list[list[float]]:
    """``strategy``'s growth per added block in every repeat: one list per repeat index.

    Repeat ``j`` of each depth is paired with repeat ``j`` of the next; a
    repeat index that some depth lacks is left out.
    """
    rs = _by_depth(rows, strategy)
    if not rs:
        return []
    n = min(len(r["peak"]["repeats"]) for r in rs)
    return [_steps(rs, lambda r, j=j: r["peak"]["repeats"][j]) for j in range(n)]
