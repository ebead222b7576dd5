"""The fine-tuning benchmark's outputs: a Markdown table, the targets' checks, JSON and the length plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from nuvec_mlx import default_ahead
from nuvec_mlx.memory import MiB

from ..core import mlx_measure, options, rounds, throttle
from ..core.figures import caption, save_figure, spread
from . import cases

#: The bases each row's peak and time are set against (``peak_vs_<base>``, ``time_vs_<base>``).
BASES = ("none", "mlx-lm", "nuvec-unchunked")
#: The targets of ``nuvec`` (the issues' for an H200 at the public 1B configurations, bf16,
#: batch 4 x 2048): (what, the ratio's key, <= or >=, bound).
TARGETS = (
    ("peak / mlx-lm's", "peak_vs_mlx-lm", "<=", 0.30),
    ("peak / unchunked nuvec's", "peak_vs_nuvec-unchunked", "<=", 0.5),
    ("time / mlx-lm's", "time_vs_mlx-lm", "<=", 1.03),
    ("time / unchunked nuvec's", "time_vs_nuvec-unchunked", "<=", 1.0),
)
#: The largest sequence in this memory: nuvec's >= this many times mlx-lm's.
SEQ_TARGET = ("16GiB", 3.0)
#: From this length on, each doubling of the length at most multiplies nuvec's step peak by this (the CPU's
#: target, where attention trains unfused: a peak that grows with T, not T squared).
DOUBLING = (1024, 2.2)
STYLES = {
    "none": ("tab:gray", "o-"),
    "mlx-lm": ("tab:blue", "s-"),
    "nuvec": ("tab:green", "o-"),
    "nuvec-unchunked": ("tab:olive", "^--"),
    "nuvec-mlp-chunks": ("tab:red", "o--"),
    "nuvec-ahead0": ("tab:cyan", "d-"),
    "nuvec-ahead2": ("tab:pink", "d:"),
    "nuvec-mx-eval": ("tab:purple", "v:"),
}


def add_ratios(rows: list[dict]) -> list[dict]:
    """Add each row's ratios of peak and time to those of :data:`BASES` that ran (one workload's rows)."""
    by = {r["strategy"]: r for r in rows}
    for r in rows:
        for base in BASES:
            if base in by:
                r[f"peak_vs_{base}"] = r["peak"]["median"] / by[base]["peak"]["median"]
                r[f"time_vs_{base}"] = r["time"]["median"] / by[base]["time"]["median"]
    return rows


def _ratio(r: dict, name: str) -> str:
    return f"{r[name]:.2f}" if name in r else ""


def table(rows: list[dict], memory: list[int]) -> list[str]:
    """Markdown table lines, one per workload and strategy; ``memory`` the searched memories (bytes)."""
    sizes = [options.size_text(m) for m in memory]
    lines = [
        "| workload | strategy | held MiB | step peak MiB (min–max) | peak / none | peak / mlx-lm "
        "| step s (min–max) | time / mlx-lm | dispatch ms (min–max) | evaluation ms (min–max) | tokens/s"
        + "".join(f" | largest seq in {s}" for s in sizes)
        + " |",
        "| --- " * (11 + len(sizes)) + "|",
    ]
    for r in rows:
        parts = r.get("parts", {})
        split = " | ".join(spread(parts[k], 1e3) if k in parts else "" for k in ("dispatch", "evaluation"))
        largest = "".join(f" | {r.get('largest_seq', {}).get(s, '')}" for s in sizes)
        lines.append(
            f"| {r['label']} | {r['strategy']} | {r['resident'] / MiB:.1f} | {spread(r['peak'], 1 / MiB)} "
            f"| {_ratio(r, 'peak_vs_none')} | {_ratio(r, 'peak_vs_mlx-lm')} | {spread(r['time'], 1, 3)} "
            f"| {_ratio(r, 'time_vs_mlx-lm')} | {split} | {r['tokens_per_s']:.0f}{largest} |"
        )
    return lines


def _check(what: str, value: float, op: str, bound: float) -> str:
    met = value <= bound if op == "<=" else value >= bound
    verdict = "met" if met else f"MISSED by {abs(value - bound):.2f}"
    return f"{what} {value:.2f} (target {op} {bound:g}: {verdict})"


def growth_text(fit: dict[str, float], seq: int) -> str:
    """What grows how, at ``seq`` tokens: the fit's parts (:func:`~nuvec_mlx_bench.train.lengths.growth`) in MiB.

    Example:
        >>> growth_text({"constant": 0, "per_token": MiB, "per_token_squared": 0, "max_residual": 0}, 4)
        'at 4 tokens: 0.0 + 4.0 (x T) + 0.0 (x T²) MiB'
    """
    return (
        f"at {seq} tokens: {fit['constant'] / MiB:.1f} + {fit['per_token'] * seq / MiB:.1f} (x T) + "
        f"{fit['per_token_squared'] * seq * seq / MiB:.1f} (x T²) MiB"
    )


def notes(rows: list[dict], args: argparse.Namespace) -> list[str]:
    """How the figures were measured, what grows with the length, and nuvec against the targets."""
    lines = [
        f"- peaks: medians of {args.repeats} (min–max), cases round-robin in one process, read by "
        "`nuvec_mlx.memory.measure` after `mx.synchronize()` with the cache cleared first, above the memory "
        "active before the step; `held` is what the strategy's model and optimizer hold between steps "
        "(parameters and Adam state), so a step needs held + step peak",
        f"- times: {rounds.TIMES}; tokens/s = batch x seq / the median step time; {mlx_measure.PARTS} "
        "(nuvec's: `TrainingStep.dispatch_seconds` and `evaluation_seconds`; mlx-lm's: its compiled step's call "
        "and its `mx.eval`)",
        "- strategies: `none` and `mlx-lm` are mlx-lm's trainer step (`mx.compile` of `nn.value_and_grad`, "
        "`mx.eval`), `mlx-lm` with its `grad_checkpoint`; `nuvec` is `nuvec-mlx-lora --grad-checkpoint`'s step: "
        "every block checkpointed and chunked along the sequence (`nv.chunk_layers(model, nv.Chunks())`), the loss "
        "head in chunks (`nuvec_mlx.mlx_lm.chunked_loss`), an `nv.TrainingStep` with the throttle "
        f"{throttle.throttle_text(args.throttle)} and the device's stages ahead (`nv.default_ahead()`, here "
        f"{default_ahead()}); `nuvec-unchunked` the same without chunks (every `nv.Chunks` setting `None`, mlx-lm's "
        f"`default_loss`); `nuvec-mlp-chunks` with each block's MLP in chunks of {cases.MLP_CHUNK} tokens "
        "(`--mlp-chunk`); `nuvec-aheadN` with N stages queued ahead; `nuvec-mx-eval` nuvec's checkpoint on every "
        "block in mlx-lm's own step (`mx.compile`, `mx.eval`)",
    ]
    if args.seqs:
        lines.append(
            f"- peak against length: one warm step per strategy at each of {args.seqs} tokens; `growth` fits "
            "constant + a x T + b x T² to every length measured (the sweep's and the search's)"
        )
    if args.memory:
        lines.append(
            f"- largest seq: the longest multiple of {args.seq_step} tokens (up to {args.max_seq}) whose held + step "
            f"peak stays within {', '.join(options.size_text(m) for m in args.memory)} in each of {args.repeats} "
            "steps after a warm-up step, found by measuring (doubling from the workload's length, then bisecting)"
        )
    not_run = {f"{r['label']}: {r['strategy']}": r["not_run"] for r in rows if r.get("not_run")}
    if not_run:
        lines.append(
            f"- not run (whole logits of {cases.LOGITS_LIMIT:,} elements or more end MLX's process on CUDA; counted as "
            "not fitting in the search): " + "; ".join(f"{k} at {sorted(v)} tokens" for k, v in not_run.items())
        )
    lines.append(
        "- targets (set for an H200 at the public 1B configurations, bf16, batch 4 x 2048; elsewhere a hint): "
        + "; ".join(f"nuvec {what} {op} {bound:g}" for what, _, op, bound in TARGETS)
        + f"; largest sequence in {SEQ_TARGET[0]} >= {SEQ_TARGET[1]:g}x mlx-lm's; (a CPU target, attention "
        f"unfused) from {DOUBLING[0]} tokens on, each doubling of the length at most {DOUBLING[1]:g}x the peak"
    )
    for label in dict.fromkeys(r["label"] for r in rows):
        by = {r["strategy"]: r for r in rows if r["label"] == label}
        for r in by.values():
            fit, longest = r.get("growth"), max(map(int, {**r["sweep"], **r["search"]}), default=0)
            if fit:
                lines.append(f"- {label}: {r['strategy']}'s peak {growth_text(fit, longest)}")
        ours = by.get("nuvec")
        if ours is None:
            continue
        checks = [_check(what, ours[key], op, bound) for what, key, op, bound in TARGETS if key in ours]
        memory, factor = SEQ_TARGET
        theirs = by.get("mlx-lm", {}).get("largest_seq", {}).get(memory)
        if theirs and memory in ours.get("largest_seq", {}):
            checks.append(
                _check(f"largest seq in {memory} / mlx-lm's", ours["largest_seq"][memory] / theirs, ">=", factor)
            )
        for t, ratio in doublings(ours["sweep"]):
            checks.append(_check(f"peak at {2 * t} / at {t} tokens", ratio, "<=", DOUBLING[1]))
        if checks:
            lines.append(f"- {label}: nuvec: " + "; ".join(checks))
    return lines


def doublings(sweep: dict[Any, int], start: int = DOUBLING[0]) -> list[tuple[int, float]]:
    """(T, peak at 2T / peak at T) for every T >= ``start`` measured with its double.

    Example:
        >>> doublings({"1024": 10, "2048": 21, "4096": 40})
        [(1024, 2.1), (2048, 1.9047619047619047)]
    """
    peaks = {int(k): v for k, v in sweep.items()}
    return [(t, peaks[2 * t] / peaks[t]) for t in sorted(peaks) if t >= start and 2 * t in peaks]


def _points(r: dict[str, Any]) -> list[tuple[int, int]]:
    return sorted({int(k): v for k, v in {**r["sweep"], **r["search"]}.items()}.items())


def plot(rows: list[dict], memory: list[int]) -> Figure | None:
    """Held + step peak against sequence length, one panel per workload, one line per strategy; each line's
    fit (dotted) and, in the legend, what of its peak grows with T and with T² at the longest length."""
    labels = [
        label
        for label in dict.fromkeys(r["label"] for r in rows)
        if any(r["sweep"] or r["search"] for r in rows if r["label"] == label)
    ]
    if not labels:
        return None
    fig = Figure(figsize=(8, 1.5 + 3.5 * len(labels)))
    axes = fig.subplots(len(labels), 1, squeeze=False)
    for ax, label in zip(axes[:, 0], labels):
        for r in (r for r in rows if r["label"] == label):
            points = _points(r)
            color, style = STYLES.get(r["strategy"], ("k", "o-"))
            name = r["strategy"]
            fit = r.get("growth")
            if fit:
                t = points[-1][0]
                linear, square = fit["per_token"] * t / MiB, fit["per_token_squared"] * t * t / MiB
                name += f" ({linear:.0f} x T + {square:.0f} x T² MiB at {t})"
                grid = [points[0][0] + (t - points[0][0]) * i / 40 for i in range(41)]
                ax.plot(
                    grid,
                    [
                        (r["resident"] + fit["constant"] + fit["per_token"] * s + fit["per_token_squared"] * s * s)
                        / MiB
                        for s in grid
                    ],
                    ":",
                    lw=0.8,
                    color=color,
                )
            ax.plot(
                [s for s, _ in points],
                [(r["resident"] + p) / MiB for s, p in points],
                style,
                ms=4,
                color=color,
                label=name,
            )
            for seq in r.get("largest_seq", {}).values():
                if seq:
                    ax.axvline(seq, color=color, ls=":", lw=0.6)
        for m in memory:
            ax.axhline(m / MiB, color="k", ls="--", lw=0.6)
            ax.annotate(f" {options.size_text(m)}", (0, m / MiB), xycoords=("axes fraction", "data"), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T (tokens)")
        ax.set_ylabel("held + step peak, MiB")
        ax.set_title(label.rsplit(" T=", 1)[0] + (" (dotted: fit; vertical: largest length that fits)"), fontsize=9)
        ax.legend(fontsize=7)
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
    (out / "results.md").write_text("\n".join(head + lines + [""] + table(rows, args.memory) + [""] + pics) + "\n")
    return [out / "results.json", out / "results.md", *plots]
