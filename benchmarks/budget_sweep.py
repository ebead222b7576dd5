"""Peak memory and step time of the seed step against the evaluation budget.

Runs plain and checkpointed steps side by side in one process for each budget
(``inf`` is plain ``mx.eval``) and writes ``budget_sweep.json`` and ``.md``:

    python benchmarks/budget_sweep.py --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx
from tqdm import tqdm

import nuvec_mlx as nv
from benchmarks import seed

MiB = 1 << 20


def environment() -> dict:
    """Where the figures came from."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "mlx": mx.__version__,
        "backend": str(mx.default_device()),
        "device": info.get("device_name", platform.processor() or platform.machine()),
        "blas": "MLX bundled" if mx.default_device() == mx.cpu else "n/a (GPU)",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def run_case(strategy: str, budget: float, repeats: int, **shape) -> dict:
    """Median peak (cache cleared first) and median step time (warm cache)."""
    sc = seed.build(strategy, **shape)
    evaluate = lambda out: nv.eval(out, budget=budget)
    evaluate(sc.step(sc.inputs))  # compile and warm up
    peaks, times = [], []
    for _ in range(repeats):
        peaks.append(seed.peak(sc, evaluate))
        mx.synchronize()
        t = time.perf_counter()
        evaluate(sc.step(sc.inputs))
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return {
        "strategy": strategy,
        "budget": budget,
        "peak": statistics.median(peaks),
        "peak_min": min(peaks),
        "peak_max": max(peaks),
        "time": statistics.median(times),
        "time_min": min(times),
        "time_max": max(times),
        "traces": sc.step.traces,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--weight-grads", action="store_true")
    p.add_argument("--budgets", default="inf,0,1,16,64,256", help="MiB, comma-separated")
    p.add_argument("--strategies", default="none,mx,nuvec")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = p.parse_args(argv)
    shape = dict(batch=args.batch, dim=args.dim, blocks=args.blocks, weight_grads=args.weight_grads)
    budgets = [math.inf if b == "inf" else int(float(b) * MiB) for b in args.budgets.split(",")]
    strategies = args.strategies.split(",")
    cases = [(b, s) for b in budgets for s in strategies]
    rows = [run_case(s, b, args.repeats, **shape) for b, s in tqdm(cases, desc="budget sweep")]
    base = {r["budget"]: r for r in rows if r["strategy"] == "none"}
    plain_mx_eval = base.get(math.inf)
    for r in rows:
        ref = base[r["budget"]]
        r["peak_ratio"] = r["peak"] / ref["peak"]
        r["time_ratio"] = r["time"] / ref["time"]
        if plain_mx_eval:
            r["time_vs_plain_mx_eval"] = r["time"] / plain_mx_eval["time"]
    env = environment()
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
        "Ratios are against `none` at the same budget, in the same process; "
        "`vs mx.eval` is against `none` evaluated by plain `mx.eval`. "
        f"Peaks: median of {args.repeats}, cache cleared first; times: median of {args.repeats} warm steps.",
        "",
        "| budget | strategy | peak MiB | peak ratio | step s | time ratio | time vs mx.eval plain |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        b = "inf (mx.eval)" if r["budget"] == math.inf else f"{r['budget'] / MiB:g} MiB"
        lines.append(
            f"| {b} | {r['strategy']} | {r['peak'] / MiB:.1f} | {r['peak_ratio']:.3f} | "
            f"{r['time']:.4f} | {r['time_ratio']:.3f} | {r.get('time_vs_plain_mx_eval', float('nan')):.3f} |"
        )
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
