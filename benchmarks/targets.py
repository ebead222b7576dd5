"""Issue #3's targets, checked against the rows of a benchmark run.

The targets were set for the seed step (B=4096, D=256, 8 blocks, compiled),
with ratios taken against the plain step evaluated the same way
(``none-policy``: both through :func:`nuvec_mlx.eval`). Every run checks them
on its own shapes, so that a reader sees at once where a run stands; a run at
other shapes is a hint, not the verdict.
"""

from __future__ import annotations

import math

#: (bound on nuvec's peak ratio, bound on its time ratio), against ``none-policy``.
CHECKPOINT_BOUNDS = {False: (0.25, 1.55), True: (0.30, 1.45)}
#: ``none-policy`` against ``none``: the policy must not tax plain steps.
POLICY_TIME_BOUND = 1.10
#: Checkpointed peak growth per added block, in block inputs (input gradient only).
DEPTH_GROWTH_BOUND = 1.25


def _check(name: str, value: float, bound: float) -> str:
    verdict = "met" if value <= bound else f"MISSED by {value - bound:.3f}"
    return f"- {name}: {value:.3f} (target <= {bound:g}): {verdict}"


def overall_growth(steps: list[float], depths: list[int]) -> float:
    """Growth per added block from the shallowest to the deepest model, from the growth
    between consecutive depths (weighted by the blocks each step adds)."""
    depths = sorted(depths)
    added = [b - a for a, b in zip(depths, depths[1:])]
    return sum(g * n for g, n in zip(steps, added)) / sum(added)


def checks(rows: list[dict], growth: dict[str, list[float]], depths: list[int],
           budget: float) -> list[str]:
    """Markdown lines: each target, the measured value and whether it was met.

    Args:
        rows: the run's rows (``peak_memory.main``'s).
        growth: the depth sweep's peak growth per added block, in block
            inputs, between consecutive ``depths``, by strategy (empty when no
            sweep ran).
        depths: the depth sweep's numbers of blocks.
        budget: the budget ``nv.eval`` ran at.
    """
    lines = []
    mlx = [r for r in rows if r["framework"] == "mlx" and r["section"] == "strategies" and "error" not in r]
    for model_rows in _by_workload(mlx):
        by = {r["strategy"]: r for r in model_rows}
        first = model_rows[0]
        what = f"{first['model']} B={first['batch']}, {'input+weight' if first['weight_grads'] else 'input'} grads"
        peak_bound, time_bound = CHECKPOINT_BOUNDS[first["weight_grads"]]
        if "nuvec" in by and "peak_ratio_vs_policy" in by["nuvec"]:
            lines.append(_check(f"{what}: nuvec peak / plain peak (both nv.eval)",
                                by["nuvec"]["peak_ratio_vs_policy"], peak_bound))
            lines.append(_check(f"{what}: nuvec time / plain time (both nv.eval)",
                                by["nuvec"]["time_ratio_vs_policy"], time_bound))
        if "none-policy" in by and "time_ratio" in by["none-policy"]:
            lines.append(_check(f"{what}: plain nv.eval time / mx.eval time",
                                by["none-policy"]["time_ratio"], POLICY_TIME_BOUND))
            lines.append(_check(f"{what}: plain nv.eval peak / mx.eval peak",
                                by["none-policy"]["peak_ratio"], 1.0))
            if budget == math.inf:
                lines.append("  (at budget inf `nv.eval` runs `mx.eval` itself: these two lines compare "
                             "one evaluation with itself, and show the measurement's spread)")
    if growth.get("nuvec"):
        lines.append(_check("depth sweep: nuvec peak growth per added block (block inputs, "
                            "shallowest to deepest)", overall_growth(growth["nuvec"], depths), DEPTH_GROWTH_BOUND))
    return ["", "Issue #3's targets on this run's shapes:", *lines] if lines else []


def _by_workload(rows: list[dict]) -> list[list[dict]]:
    keys = list(dict.fromkeys((r["model"], r["batch"], r["weight_grads"], r["seq"], r["blocks"]) for r in rows))
    return [[r for r in rows if (r["model"], r["batch"], r["weight_grads"], r["seq"], r["blocks"]) == k] for k in keys]
