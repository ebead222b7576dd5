"""The fine-tuning benchmark's outputs: a Markdown table, the targets' checks, JSON and the plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure

from nuvec_mlx import mlx_lm as nv_mlx_lm
from nuvec_mlx_bench import budgets, measure
from nuvec_mlx_bench.report import caption, save_figure
from nuvec_mlx_bench.train_steps import AHEAD

MiB = 1 << 20
#: The issue's targets for nuvec against mlx-lm's ``--grad-checkpoint``, set for an H200 at
#: a 1B model (bf16, seq 2048, batch 4): mode -> (peak ratio <=, time ratio <=); and the
#: largest sequence in 16 GiB, >= 1.5x mlx-lm's.
TARGETS = {"full": (0.6, 1.05), "lora": (0.8, 1.05), "qlora": (0.8, 1.05)}
SEQ_TARGET = 1.5


def add_ratios(rows: list[dict]) -> list[dict]:
    """Add each row's ratios of peak and time to ``none``'s and to ``mlx-lm``'s (one workload's rows)."""
    by = {r["strategy"]: r for r in rows}
    for r in rows:
        for base in ("none", "mlx-lm"):
            if base in by:
                r[f"peak_vs_{base}"] = r["peak"]["median"] / by[base]["peak"]["median"]
                r[f"time_vs_{base}"] = r["time"]["median"] / by[base]["time"]["median"]
    return rows


def _ratio(r: dict, name: str) -> str:
    return f"{r[name]:.2f}" if name in r else ""


def table(rows: list[dict]) -> list[str]:
    """Markdown table lines, one per workload and strategy."""
    lines = ["| workload | strategy | held MiB | step peak MiB (min–max) | peak / none | peak / mlx-lm "
             "| step s (min–max) | time / mlx-lm | tokens/s | largest seq |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        p, t = r["peak"], r["time"]
        lines.append(
            f"| {r['label']} | {r['strategy']} | {r['resident'] / MiB:.1f} | {p['median'] / MiB:.1f} "
            f"({p['min'] / MiB:.1f}–{p['max'] / MiB:.1f}) | {_ratio(r, 'peak_vs_none')} | {_ratio(r, 'peak_vs_mlx-lm')} "
            f"| {t['median']:.3g} ({t['min']:.3g}–{t['max']:.3g}) | {_ratio(r, 'time_vs_mlx-lm')} "
            f"| {r['tokens_per_s']:.0f} | {r.get('largest_seq', '')} |")
    return lines


def _check(what: str, value: float, op: str, bound: float) -> str:
    met = value <= bound if op == "<=" else value >= bound
    verdict = "met" if met else f"MISSED by {abs(value - bound):.2f}"
    return f"{what} {value:.2f} (target {op} {bound:g}: {verdict})"


def notes(rows: list[dict], args: argparse.Namespace) -> list[str]:
    """How the figures were measured, and nuvec against the targets, one line per workload."""
    lines = [
        f"- peaks: medians of {args.repeats} (min–max), cases round-robin in one process, read by "
        "`nuvec_mlx.memory.measure` after `mx.synchronize()` with the cache cleared first, above the memory "
        "active before the step; `held` is what the strategy's model and optimizer hold between steps "
        "(parameters and Adam state), so a step needs held + step peak",
        f"- times: {measure.TIMES}; tokens/s = batch x seq / the median step time",
        "- strategies: `none` and `mlx-lm` are mlx-lm's trainer step (`mx.compile` of `nn.value_and_grad`, "
        "`mx.eval`), `mlx-lm` with its `grad_checkpoint`; `nuvec` is `nuvec_mlx.mlx_lm.training_step` with every "
        f"block checkpointed, `nv.eval` at {budgets.budget_text(args.budget)} with the trainer's stages ahead "
        f"(`nuvec_mlx.mlx_lm.default_ahead()`, here {nv_mlx_lm.default_ahead()}); `nuvec-inf` the same at budget inf; "
        "`nuvec-aheadN` the same with N stages queued ahead (`nv.eval(..., ahead=N)`); "
        "`nuvec-mx-eval` nuvec's checkpoint on every block in mlx-lm's own step (`mx.compile`, `mx.eval`)",
    ]
    if args.seqs:
        lines.append(f"- peak against length: one warm step per strategy at each of {args.seqs} tokens")
    if args.memory:
        lines.append(f"- largest seq: the longest multiple of {args.seq_step} tokens (up to {args.max_seq}) whose "
                     f"held + step peak stays within {args.memory:g} MiB, found by measuring steps "
                     "(doubling, then bisecting)")
    lines.append(f"- targets (set for an H200 at a 1B model; elsewhere a hint): nuvec against mlx-lm's "
                 f"`grad_checkpoint`, peak and time ratios {TARGETS}, largest sequence >= {SEQ_TARGET}x")
    for label in dict.fromkeys(r["label"] for r in rows):
        by = {r["strategy"]: r for r in rows if r["label"] == label}
        theirs = by.get("mlx-lm")
        for ours in (by.get(s) for s in ("nuvec", "nuvec-inf", *AHEAD)):
            if not ours or not theirs:
                continue
            peak, time = TARGETS[ours["workload"]["mode"]]
            checks = [_check("peak", ours["peak_vs_mlx-lm"], "<=", peak),
                      _check("time", ours["time_vs_mlx-lm"], "<=", time)]
            if ours.get("largest_seq") and theirs.get("largest_seq"):
                checks.append(_check("largest seq", ours["largest_seq"] / theirs["largest_seq"], ">=", SEQ_TARGET))
            lines.append(f"- {label}: {ours['strategy']} / mlx-lm: " + "; ".join(checks))
    return lines


def plot(rows: list[dict], memory_mib: float) -> Figure | None:
    """Held + step peak against sequence length, one panel per workload, one line per strategy."""
    labels = [label for label in dict.fromkeys(r["label"] for r in rows)
              if any(r.get("sweep") or r.get("search") for r in rows if r["label"] == label)]
    if not labels:
        return None
    fig = Figure(figsize=(7, 1.5 + 3 * len(labels)))
    axes = fig.subplots(len(labels), 1, squeeze=False)
    styles = {"none": ("tab:gray", "o-"), "mlx-lm": ("tab:blue", "s-"), "nuvec": ("tab:green", "o-"),
              "nuvec-inf": ("tab:olive", "^--"), "nuvec-ahead0": ("tab:cyan", "d-"),
              "nuvec-ahead1": ("tab:brown", "d--"), "nuvec-ahead2": ("tab:pink", "d:"),
              "nuvec-mx-eval": ("tab:purple", "v:")}
    for ax, label in zip(axes[:, 0], labels):
        for r in (r for r in rows if r["label"] == label):
            points = sorted({int(k): v for k, v in {**r.get("sweep", {}), **r.get("search", {})}.items()}.items())
            color, style = styles.get(r["strategy"], ("k", "o-"))
            ax.plot([s for s, _ in points], [(r["resident"] + p) / MiB for _, p in points], style, ms=4,
                    color=color, label=r["strategy"])
            if r.get("largest_seq"):
                ax.axvline(r["largest_seq"], color=color, ls=":", lw=0.8)
        if memory_mib:
            ax.axhline(memory_mib, color="k", ls="--", lw=0.8)
            ax.annotate(f" {memory_mib:g} MiB", (0, memory_mib), xycoords=("axes fraction", "data"), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("held + step peak, MiB")
        ax.set_title(label.rsplit(" T=", 1)[0] + (" (dotted: largest length that fits)" if memory_mib else ""),
                     fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def write(out: Path, env: dict, rows: list[dict], args: argparse.Namespace, partial: bool = False) -> list[Path]:
    """Write ``results.json``, ``results.md`` and ``peak_vs_seq.png`` into ``out``; return the files."""
    out.mkdir(parents=True, exist_ok=True)
    lines = notes(rows, args)
    if partial:
        lines.insert(0, "- partial: the run was still going")
    fig = plot(rows, args.memory)
    plots = [save_figure(fig, out / "peak_vs_seq.png", caption(env))] if fig is not None else []
    (out / "results.json").write_text(json.dumps({"environment": env, "notes": lines, "rows": rows}, indent=1))
    head = ["# Fine-tuning benchmark", "", *(f"- {k}: `{v}`" for k, v in env.items()), ""]
    pics = [f"![{p.stem}]({p.name})" for p in plots]
    (out / "results.md").write_text("\n".join(head + lines + [""] + table(rows) + [""] + pics) + "\n")
    return [out / "results.json", out / "results.md", *plots]
