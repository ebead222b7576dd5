"""Peak memory and step time of the seed step against ``nv.eval``'s throttle.

For each throttle (``inf`` is plain ``mx.eval`` for a step without stages),
runs the plain and the checkpointed step side by side, round-robin, in one
process, and writes ``throttle_sweep[_weight_grads].json`` and ``.md``
(``budget_sweep`` before the throttle had its name)::

    nuvec-mlx-bench-sweep --out benchmarks/results/cpu
    python -m nuvec_mlx_bench.sweep --out benchmarks/results/cpu   # the same
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import nuvec_mlx as nv
from nuvec_mlx.memory import MiB

from ..core import environment, mlx_measure, options, rounds, throttle
from ..seed import rows as seed_rows
from ..seed import strategies
from ..seed.workload import SEED, Workload

#: The strategies the sweep can run (each evaluated by ``nv.eval`` at every throttle).
STRATEGIES = ("none", "mx", "nuvec")


def main(argv: list[str] | None = None) -> int:
    """The ``nuvec-mlx-bench-sweep`` command: run the sweep, exit status 0."""
    run(argv)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The sweep's command line; a strategy it cannot run is an error."""
    p = argparse.ArgumentParser(prog="nuvec-mlx-bench-sweep", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=SEED.batch)
    p.add_argument("--dim", type=int, default=SEED.dim)
    p.add_argument("--blocks", type=int, default=SEED.blocks)
    p.add_argument("--weight-grads", action="store_true", help="also differentiate every weight")
    p.add_argument(
        "--throttles",
        "--budgets",
        default="inf,0,1,16,64,256",
        help="nv.eval's throttles, MiB or inf, comma-separated (--budgets is its former name)",
    )
    p.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma-separated from none, mx, nuvec; none (the ratios' base) is required",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = p.parse_args(argv)
    args.strategies = options.csv(args.strategies)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if not set(args.strategies) <= set(STRATEGIES) or "none" not in args.strategies:
        p.error(f"--strategies: choose from {', '.join(STRATEGIES)}, none included; got {args.strategies}")
    try:
        args.throttles = [throttle.parse_throttle(b) for b in options.csv(args.throttles)]
        args.workload = Workload("mlp", args.batch, args.dim, args.blocks, weight_grads=args.weight_grads)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    return args


def run(argv: list[str] | None = None) -> list[dict]:
    """Run the sweep that the command line ``argv`` asks for; write and return its rows."""
    args = parse_args(argv)
    w = args.workload
    scenarios = {s: strategies.build(s, w) for s in args.strategies}
    cases = {
        (b, s): (lambda sc=sc: sc.step(sc.inputs), lambda out, b=b: nv.eval(out, throttle=b))
        for b in args.throttles
        for s, sc in scenarios.items()
    }
    measured = mlx_measure.run_cases(cases, args.repeats, desc="throttle sweep")
    rows = [seed_rows.row("throttles", "mlx", s, w, m, throttle=b) for (b, s), m in measured.items()]
    for b in args.throttles:
        seed_rows.add_ratios([r for r in rows if r["throttle"] == b])
    if math.inf in args.throttles:
        plain = measured[(math.inf, "none")]["time"]["median"]
        for r in rows:
            r["time_vs_plain_mx_eval"] = r["time"]["median"] / plain
    env = environment.environment(environment.command_line("nuvec-mlx-bench-sweep", argv))
    name = "throttle_sweep" + ("_weight_grads" if w.weight_grads else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({"environment": env, "workload": str(w), "rows": rows}, indent=1))
    lines = [
        f"# Throttle sweep: {w}",
        "",
        *(f"- {k}: `{v}`" for k, v in env.items()),
        "",
        "Ratios are against `none` at the same throttle, in the same process; `vs mx.eval` is against "
        f"`none` evaluated by plain `mx.eval`. Medians of {args.repeats}, cases round-robin; peaks "
        f"after `mx.synchronize()` with the cache cleared first; times: {rounds.TIMES}.",
        "",
        "| throttle | strategy | peak MiB | peak ratio | step s | time ratio | time vs mx.eval plain |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {throttle.throttle_text(r['throttle'])} | {r['strategy']} | {r['peak']['median'] / MiB:.1f} | "
            f"{r['peak_ratio']:.3f} | {r['time']['median']:.4f} | {r['time_ratio']:.3f} | "
            f"{r.get('time_vs_plain_mx_eval', math.nan):.3f} |"
        )
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows
