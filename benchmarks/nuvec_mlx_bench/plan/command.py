"""The planner against a sweep of budgets, and against the fixed checkpointing rules it replaces.

For each model (the seed workloads' MLP and transformer as modules, an mlx-lm
Llama with random weights), :class:`nuvec_mlx.Planner` measures the model's
:class:`nuvec_mlx.TrainingStep` once, then plans for budgets spread from the
smallest peak it can reach to the unchecked peak (each verified by the
planner's own measurement). Then every plan and the fixed rules (every block
checkpointed, every 2nd, ``ceil(sqrt(n))`` segments of blocks, none) are
measured side by side, round-robin, with the benchmark's own probe, each case a
step of its own (:mod:`.rules`); for each budget the plan's time is set beside
the fastest rule that fits the same budget. Writes ``results.json``,
``results.md`` and ``plan_sweep.png``::

    nuvec-mlx-bench-plan --out benchmarks/results/cpu/plan
    python -m nuvec_mlx_bench.plan --out benchmarks/results/cpu/plan   # the same
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import mlx.core as mx

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB

from ..core import environment, mlx_measure, options, rounds
from ..core.figures import caption
from . import rules

MODELS = ("mlp", "transformer", "llama")
#: The shapes: ``small`` for a CPU (minutes), ``full`` for a GPU.
SUITES = {
    "small": {
        "mlp": dict(batch=256, dim=128, blocks=8),
        "transformer": dict(batch=2, dim=128, blocks=8, seq=256),
        "llama": dict(hidden=128, layers=8, batch=2, seq=128),
    },
    "full": {
        "mlp": dict(batch=16384, dim=1024, blocks=16),
        "transformer": dict(batch=8, dim=1024, blocks=16, seq=2048),
        "llama": dict(hidden=2048, layers=16, batch=4, seq=2048),
    },
}


def sweep(
    name: str, shape: dict, budgets: int, repeats: int, optimizer: str = "none", synchronize: bool = False
) -> list[dict]:
    """One model's rows: each budget's plan and the fixed rules, measured side by side (every step
    a :class:`nuvec_mlx.TrainingStep` with ``synchronize``, the planner's as-run steps too).

    Peaks are absolute, as a plan's budget counts: the rise each case's step measured above the
    memory active before it, plus what a step of that case alone starts from (``start``): the memory
    active once the planner is done (the model and its batch; the planner leaves the optimizer as
    it found it) and the case's own optimizer state.
    """
    built = rules.build(name, shape)
    planned = nv.TrainingStep(built.model, built.loss, rules.OPTIMIZERS[optimizer](), synchronize=synchronize)
    planner = nv.Planner(planned, built.batch)
    first = planner.plan(1 << 50)
    plans = [
        planner.plan(int(first.smallest + k * (first.unchecked - first.smallest) / (budgets - 1)))
        for k in range(budgets)
    ]
    chosen: dict[str, str | nv.Plan] = {f"plan for {p.budget / MiB:.1f} MiB": p for p in plans}
    chosen |= {r: r for r in rules.ALL_RULES}
    gc.collect()
    mx.synchronize()
    base = mx.get_active_memory()
    cases = {r: rules.case(built, rule, optimizer, synchronize) for r, rule in chosen.items()}
    measured = mlx_measure.run_cases(
        {r: (c.step, c.finish) for r, c in cases.items()}, repeats, desc=f"{name}: plans and rules"
    )
    rows = []
    for r, m in measured.items():
        plan = chosen[r] if isinstance(chosen[r], nv.Plan) else None
        start = base + cases[r].optimizer_bytes()
        rows.append(
            {
                "model": name,
                "shape": shape,
                "case": r,
                "start": start,
                "peak": {k: v + start if k != "repeats" else [x + start for x in v] for k, v in m["peak"].items()},
                "time": m["time"],
                **(
                    {
                        "budget": plan.budget,
                        "fits": plan.fits,
                        "planned_measured": plan.measured,
                        "predicted": plan.predicted,
                        "smallest": plan.smallest,
                        "unchecked": plan.unchecked,
                        "modes": plan.modes,
                        "corrections": len(plan.corrections),
                        "rule": plan.rule,
                    }
                    if plan
                    else {}
                ),
            }
        )
    none = next(r for r in rows if r["case"] == "none")
    for row in rows:
        row["peak_vs_none"] = row["peak"]["median"] / none["peak"]["median"]
        row["time_vs_none"] = row["time"]["median"] / none["time"]["median"]
        if "budget" in row:
            fitting = [r for r in rows if r["case"] in rules.RULES and r["peak"]["max"] <= row["budget"]]
            best = min(fitting, key=lambda r: r["time"]["median"], default=None)
            row["best_rule"] = best and best["case"]
            row["time_vs_best_rule"] = best and row["time"]["median"] / best["time"]["median"]
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a bad value is a parser error."""
    p = argparse.ArgumentParser(prog="nuvec-mlx-bench-plan", description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=tuple(SUITES), default="small")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated from {', '.join(MODELS)}")
    p.add_argument("--budgets", type=int, default=5, help="budgets per model, from the smallest to unchecked")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--optimizer",
        choices=tuple(rules.OPTIMIZERS),
        default="none",
        help="the step's optimizer: none (loss and gradients), or Adam updating with nv.update "
        "(each case then holds its own model and optimizer state)",
    )
    p.add_argument(
        "--synchronize",
        action="store_true",
        help="every step a TrainingStep(synchronize=True), as the plans are then verified",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/plan"))
    args = p.parse_args(argv)
    args.models = options.csv(args.models)
    if not set(args.models) <= set(MODELS):
        p.error(f"--models: choose from {', '.join(MODELS)}; got {args.models}")
    if args.budgets < 2 or args.repeats < 1:
        p.error(f"--budgets must be >= 2 and --repeats >= 1, got {args.budgets} and {args.repeats}")
    return args


def lines(rows: list[dict]) -> list[str]:
    """The results table, Markdown."""
    out = [
        "| model | case | budget MiB | planner's measured / predicted MiB | ratio | fits | peak MiB, median "
        "(min–max) | vs none | step ms | vs none | fastest of every block, every 2nd, sqrt(n) within the budget "
        "| time vs it | modes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        p, t = r["peak"], r["time"]
        planned = (
            (
                f"{r['planned_measured'] / MiB:.2f} / {r['predicted'] / MiB:.2f} | "
                f"{r['planned_measured'] / r['predicted']:.3f} | {r['fits']}"
            )
            if "budget" in r
            else " | |"
        )
        modes = " ".join(m.replace("save_", "")[:4] for m in r.get("modes", []))
        rule = (
            f"{r['best_rule']} | {r['time_vs_best_rule']:.2f}"
            if r.get("best_rule")
            else "none fits | "
            if "budget" in r
            else " | "
        )
        budget = f"{r['budget'] / MiB:.2f}" if "budget" in r else ""
        out.append(
            f"| {r['model']} | {r['case']} | {budget} | "
            f"{planned} | {p['median'] / MiB:.2f} ({p['min'] / MiB:.2f}–{p['max'] / MiB:.2f}) | "
            f"{r['peak_vs_none']:.2f} | {t['median'] * 1e3:.0f} | {r['time_vs_none']:.2f} | {rule} | {modes} |"
        )
    return out


def plot(rows: list[dict], env: dict, path: Path) -> Path:
    """Measured peak against budget per model (the line is peak = budget), the rules as marks."""
    from matplotlib.figure import Figure

    names = list(dict.fromkeys(r["model"] for r in rows))
    fig = Figure(figsize=(4.5 * len(names), 4))
    axes = fig.subplots(1, len(names), squeeze=False)
    for ax, name in zip(axes[0], names):
        rs = [r for r in rows if r["model"] == name]
        planned = [r for r in rs if "budget" in r]
        b = [r["budget"] / MiB for r in planned]
        ax.plot(b, b, "k--", lw=0.8, label="peak = budget")
        ax.plot(b, [r["planned_measured"] / MiB for r in planned], "o-", label="plan, planner's measurement")
        ax.plot(b, [r["predicted"] / MiB for r in planned], "x:", label="plan, predicted")
        ax.plot(b, [r["peak"]["max"] / MiB for r in planned], "s", mfc="none", label="plan, max of the repeats")
        for r in rs:
            if "budget" not in r:
                ax.axhline(r["peak"]["median"] / MiB, lw=0.6, color="tab:gray")
                ax.annotate(r["case"], (b[0], r["peak"]["median"] / MiB), fontsize=6, va="bottom")
        ax.set_xlabel("budget MiB")
        ax.set_ylabel("peak MiB")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=6)
    fig.text(0.01, 0.01, caption(env), fontsize=6, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    return path


def run(argv: list[str] | None = None) -> list[dict]:
    """Run the sweep the command line asks for; write and return its rows."""
    args = parse_args(argv)
    env = environment.environment(environment.command_line("nuvec-mlx-bench-plan", argv))
    rows = [
        row
        for name in args.models
        for row in sweep(name, SUITES[args.suite][name], args.budgets, args.repeats, args.optimizer, args.synchronize)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    planned = [r for r in rows if "budget" in r]
    within = sum(r["fits"] and r["planned_measured"] <= r["budget"] for r in planned)
    ratios = [r["planned_measured"] / r["predicted"] for r in planned]
    text = [
        "# Planner sweep",
        "",
        *(f"- {k}: `{v}`" for k, v in env.items()),
        "",
        f"Budgets met by the planner's own measurement: {within} of {len(planned)}; measured/predicted "
        f"{min(ratios):.3f}–{max(ratios):.3f}; the rows' peaks are then measured again, round-robin with the "
        f"rules (median, min–max of {args.repeats}, after `mx.synchronize()`, cache cleared, absolute: the "
        "model and batch included); times: " + rounds.TIMES + ".",
        "",
        *lines(rows),
        "",
        "![peak against budget](plan_sweep.png)",
    ]
    (args.out / "results.md").write_text("\n".join(text) + "\n")
    plot(rows, env, args.out / "plan_sweep.png")
    print("\n".join(text))
    return rows


def main(argv: list[str] | None = None) -> int:
    """The ``nuvec-mlx-bench-plan`` command: run the sweep, exit status 0."""
    run(argv)
    return 0
