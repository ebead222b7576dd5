"""The benchmark's outputs: a Markdown table, JSON and PNG plots, each with its environment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from nuvec_mlx.memory import MiB

from ..core.figures import caption, save_figure, spread
from ..seed.rows import label


def table(rows: list[dict]) -> list[str]:
    """Markdown table lines: one line per row, ratios against the same workload's plain step.

    ``floor`` is the workload's analytic floor (:mod:`nuvec_mlx_bench.seed.floors`)
    and ``x floor`` the median peak over it; ``dispatch`` and ``evaluation`` the
    step's parts (MLX's rows), median (min–max) over the repeats.
    """
    lines = [
        "| workload | framework | strategy | peak MiB (min–max) | peak ratio | floor MiB | x floor "
        "| step ms | time ratio | dispatch ms | evaluation ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {label(r)} | {r['framework']} | {r['strategy']} | error: {r['error']} | | | | | | | |")
            continue
        split = r.get("parts", {})
        parts = " | ".join(spread(split[k], 1e3, 2) if k in split else "" for k in ("dispatch", "evaluation"))
        p, t = r["peak"], r["time"]
        ranks = r.get("peak_per_rank")
        per_rank = f"; ranks {', '.join(f'{v / MiB:.1f}' for v in ranks)}" if ranks else ""
        lines.append(
            f"| {label(r)} | {r['framework']} | {r['strategy']} | {p['median'] / MiB:.1f} "
            f"({p['min'] / MiB:.1f}–{p['max'] / MiB:.1f}{per_rank}) | {r.get('peak_ratio', float('nan')):.3f} | "
            f"{r['floor'] / MiB:.1f} | {r['peak_to_floor']:.2f} | "
            f"{t['median'] * 1e3:.1f} | {r.get('time_ratio', float('nan')):.3f} | {parts} |"
        )
    return lines


#: The checkpointed peaks set beside one another, by (framework, strategy), and their headings.
CHECKPOINTED = {
    ("mlx", "nuvec"): "nuvec_mlx",
    ("torch-compile", "checkpoint"): "torch.compile + checkpoint",
    ("jax-jit", "checkpoint"): "jax.jit + jax.checkpoint",
}


def checkpointed_peaks(rows: list[dict]) -> list[str]:
    """Markdown lines: per workload, its floor and the absolute median peaks of nuvec_mlx,
    ``torch.compile`` + checkpoint and ``jax.jit`` + checkpoint (MiB, x floor)."""
    measured = _measured(rows, "strategies")
    found = {(label(r), r["framework"], r["strategy"]): r for r in measured}
    floors = {label(r): r["floor"] for r in measured}
    if not floors:
        return []
    lines = [
        "",
        "Checkpointed peaks, absolute (MiB, x the floor; each peer's peak read as its `method` says):",
        "",
        "| workload | floor | " + " | ".join(CHECKPOINTED.values()) + " |",
        "| --- | --- |" + " --- |" * len(CHECKPOINTED),
    ]
    for name, floor in floors.items():
        cells = []
        for framework, strategy in CHECKPOINTED:
            r = found.get((name, framework, strategy))
            cells.append(f"{r['peak']['median'] / MiB:.1f} ({r['peak_to_floor']:.2f})" if r else "not run")
        lines.append(f"| {name} | {floor / MiB:.1f} | " + " | ".join(cells) + " |")
    return lines


def markdown(env: dict, rows: list[dict], notes: list[str], plots: list[Path]) -> str:
    """The results page: environment, notes, table and plots."""
    head = ["# Peak-memory benchmark", "", *(f"- {k}: `{v}`" for k, v in env.items()), ""]
    pics = [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(head + notes + [""] + table(rows) + [""] + pics) + "\n"


def write(out: Path, env: dict, rows: list[dict], notes: list[str]) -> list[Path]:
    """Write ``results.json``, ``results.md`` and the plots (each captioned with
    :func:`caption`) into ``out``; return the files."""
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "peak_by_strategy.png": plot_strategies(rows),
        "peak_vs_depth.png": plot_depth(rows),
        "time_vs_peak.png": plot_time(rows),
    }
    plots = [save_figure(fig, out / name, caption(env)) for name, fig in figures.items() if fig is not None]
    (out / "results.json").write_text(json.dumps({"environment": env, "notes": notes, "rows": rows}, indent=1))
    (out / "results.md").write_text(markdown(env, rows, notes, plots))
    return [out / "results.json", out / "results.md", *plots]


def _measured(rows: list[dict], section: str) -> list[dict]:
    return [r for r in rows if r["section"] == section and "error" not in r]


def plot_strategies(rows: list[dict]) -> Figure | None:
    """Bars of peak memory per strategy, one panel per workload, its floor a dashed line."""
    rows = _measured(rows, "strategies")
    workloads = list(dict.fromkeys(label(r) for r in rows))
    if not workloads:
        return None
    fig = Figure(figsize=(9, 2.2 + 2.2 * len(workloads)))
    axes = fig.subplots(len(workloads), 1, squeeze=False)
    for ax, w in zip(axes[:, 0], workloads):
        rs = [r for r in rows if label(r) == w]
        names = [f"{r['framework']}\n{r['strategy']}" for r in rs]
        colors = [
            "tab:green" if r["strategy"] == "nuvec" else "tab:blue" if r["framework"] == "mlx" else "tab:gray"
            for r in rs
        ]
        ax.bar(range(len(rs)), [r["peak"]["median"] / MiB for r in rs], color=colors)
        ax.axhline(rs[0]["floor"] / MiB, color="k", ls="--", lw=0.8)
        ax.annotate(" floor", (1, rs[0]["floor"] / MiB), xycoords=("axes fraction", "data"), fontsize=7, va="center")
        ax.set_xticks(range(len(rs)), names, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("peak MiB")
        ax.set_title(w + " (peers' peaks: see results.json's method)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _style(i: int, line: bool = False) -> dict[str, Any]:
    """The ``i``-th series' colour (tab10: no two of the same hue) and, for lines, marker, dash and width."""
    style: dict[str, Any] = {"color": matplotlib.colormaps["tab10"](i % 10)}
    if line:
        style.update(
            marker="osD^v<>"[i % 7],
            ls=("-", "--", "-.", ":")[i % 4],
            lw=max(3.0 - 0.5 * i, 1.0),
            markersize=max(9.0 - 1.5 * i, 3.0),
        )
    return style


def plot_depth(rows: list[dict]) -> Figure | None:
    """Peak memory against the number of blocks, one line per strategy."""
    rows = _measured(rows, "depth")
    if not rows:
        return None
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for i, s in enumerate(dict.fromkeys(r["strategy"] for r in rows)):
        rs = sorted((r for r in rows if r["strategy"] == s), key=lambda r: r["blocks"])
        # Lines that coincide (none and none-policy) stay visible: each later one drawn thinner, with a
        # smaller marker and its own dash, over the earlier ones.
        ax.plot([r["blocks"] for r in rs], [r["peak"]["median"] / MiB for r in rs], label=s, **_style(i, line=True))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("blocks")
    ax.set_ylabel("peak MiB")
    ax.set_title(label(rows[0]).replace(f"{rows[0]['blocks']} blocks", "depth sweep"), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def plot_time(rows: list[dict]) -> Figure | None:
    """Step time against peak memory, as ratios to the plain step: one colour per strategy, one marker per workload."""
    rows = [r for r in _measured(rows, "strategies") if "time_ratio" in r]
    if not rows:
        return None
    names = list(dict.fromkeys(f"{r['framework']} {r['strategy']}" for r in rows))
    workloads = list(dict.fromkeys(label(r) for r in rows))
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for r in rows:
        name = f"{r['framework']} {r['strategy']}"
        ax.scatter(
            r["peak_ratio"],
            r["time_ratio"],
            color=_style(names.index(name))["color"],
            marker="osD^v<>"[workloads.index(label(r)) % 7],
        )
    handles = [Line2D([], [], color=_style(i)["color"], marker="o", ls="", label=n) for i, n in enumerate(names)]
    handles += [Line2D([], [], color="k", marker="osD^v<>"[i % 7], ls="", label=w) for i, w in enumerate(workloads)]
    ax.legend(handles=handles, fontsize=6, loc="center left", bbox_to_anchor=(1, 0.5))
    ax.set_xlabel("peak / plain peak")
    ax.set_ylabel("step time / plain step time")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
