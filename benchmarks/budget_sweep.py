"""Peak memory and step time of the seed step against the evaluation budget.

For each budget (``inf`` is plain ``mx.eval``), runs the plain and the
checkpointed step side by side, round-robin, in one process, and writes
``budget_sweep[_weight_grads].json`` and ``.md``:

    nuvec-mlx-bench-sweep --out benchmarks/results/cpu
    python -m nuvec_mlx_bench.budget_sweep --out benchmarks/results/cpu   # the same
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import nuvec_mlx as nv
from nuvec_mlx_bench import measure, workloads


def main(argv: list[str] | None = None) -> int:
    """The ``nuvec-mlx-bench-sweep`` command: run the sweep, exit status 0."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> list[dict]:
    """Run the sweep that the command line ``argv`` asks for; return its rows."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--weight-grads", action="store_true")
    p.add_argument("--budgets", default="inf,0,1,16,64,256", help="MiB, comma-separated")
    p.add_argument("--strategies", default="none,mx,nuvec", help="from none, mx, nuvec")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = p.parse_args(argv)
    shape = dict(batch=args.batch, dim=args.dim, blocks=args.blocks, weight_grads=args.weight_grads)
    budgets = [measure.parse_budget(b) for b in args.budgets.split(",")]
    scenarios = {s: workloads.build(s, **shape) for s in args.strategies.split(",")}
    cases = {
        (b, s): (lambda sc=sc: sc.step(sc.inputs), lambda out, b=b: nv.eval(out, budget=b))
        for b in budgets for s, sc in scenarios.items()
    }
    results = measure.run_cases(cases, args.repeats, desc="budget sweep")
    rows = [{"budget": b, "strategy": s, **r} for (b, s), r in results.items()]
    for r in rows:
        plain = results[(r["budget"], "none")]
        r["peak_ratio"] = r["peak"]["median"] / plain["peak"]["median"]
        r["time_ratio"] = r["time"]["median"] / plain["time"]["median"]
        if math.inf in budgets:
            r["time_vs_plain_mx_eval"] = r["time"]["median"] / results[(math.inf, "none")]["time"]["median"]
    env = measure.environment()
    name = "budget_sweep" + ("_weight_grads" if args.weight_grads else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(
        json.dumps({"environment": env, "shape": shape, "rows": rows}, indent=1, default=str)
    )
    lines = [
        f"# Budget sweep: seed step, {shape}",
        "",
        *(f"- {k}: `{v}`" for k, v in env.items()),
        "",
        "Ratios are against `none` at the same budget, in the same process; `vs mx.eval` is against "
        f"`none` evaluated by plain `mx.eval`. Medians of {args.repeats}, cases round-robin; peaks "
        f"after `mx.synchronize()` with the cache cleared first; times: {measure.TIMES}.",
        "",
        "| budget | strategy | peak MiB | peak ratio | step s | time ratio | time vs mx.eval plain |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        b = measure.budget_text(r["budget"])
        lines.append(
            f"| {b} | {r['strategy']} | {r['peak']['median'] / measure.MiB:.1f} | {r['peak_ratio']:.3f} | "
            f"{r['time']['median']:.4f} | {r['time_ratio']:.3f} | {r.get('time_vs_plain_mx_eval', math.nan):.3f} |"
        )
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    sys.exit(main())
