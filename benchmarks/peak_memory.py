"""The peak-memory benchmark: every checkpointing strategy, side by side, in one process.

    nuvec-mlx-bench                # scaled-down shapes, a few minutes on 2 CPU cores
    nuvec-mlx-bench --suite full   # the seed's shapes (for a GPU)
    python -m nuvec_mlx_bench.peak_memory ...   # the same, without the installed command

Runs the seed MLP and a small decoder-only transformer with each strategy of
``benchmarks/workloads.py``, a depth sweep, and (where PyTorch or JAX can be
imported) the same models through ``torch.utils.checkpoint`` and
``jax.checkpoint``. Prints a table and writes ``results.json``,
``results.md`` and PNG plots into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

import nuvec_mlx as nv
from nuvec_mlx_bench import measure, report, targets, workloads


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model at one shape."""

    model: str
    batch: int
    dim: int
    blocks: int
    seq: int = 1
    weight_grads: bool = False
    compiled: bool = True

    def block_input_bytes(self) -> int:
        return 4 * self.batch * self.seq * self.dim


#: Shapes per suite: the workloads of the strategy table, the depth sweep's base and depths.
SUITES = {
    "default": (
        [Workload("mlp", 512, 64, 8), Workload("mlp", 512, 64, 8, weight_grads=True),
         Workload("transformer", 2, 64, 8, seq=128)],
        Workload("mlp", 256, 64, 8),
    ),
    "full": (
        [Workload("mlp", 4096, 256, 8), Workload("mlp", 4096, 256, 8, weight_grads=True),
         Workload("transformer", 8, 256, 8, seq=512)],
        Workload("mlp", 4096, 256, 8),
    ),
}
DEPTH_STRATEGIES = ("none", "none-policy", "mx", "nuvec")


def mlx_rows(w: Workload, strategies: list[str], repeats: int, section: str) -> list[dict]:
    """Measure one workload with each MLX strategy, round-robin, in this process."""
    scenarios = {s: workloads.build(s, **dataclasses.asdict(w)) for s in strategies}
    cases = {s: (lambda sc=sc: sc.step(sc.inputs), sc.evaluate) for s, sc in scenarios.items()}
    results = measure.run_cases(cases, repeats, desc=f"{section}: {w.model} {w.blocks} blocks")
    rows = [{"section": section, "framework": "mlx", "strategy": s, **dataclasses.asdict(w),
             "traces": getattr(scenarios[s].step, "traces", None), **results[s]} for s in strategies]
    return add_ratios(rows)


def peer_rows(w: Workload, peers: list[str], python: str, repeats: int) -> list[dict]:
    """The same workload in PyTorch and JAX, each peer in its own process."""
    from nuvec_mlx_bench import peers as peer_lib

    rows = []
    for peer in tqdm(peers, desc=f"peers: {w.model}", unit="peer"):
        for strategy in ("none", "checkpoint"):
            r = peer_lib.run_isolated(
                peer, python=python, model=w.model, strategy=strategy, batch=w.batch, dim=w.dim,
                blocks=w.blocks, seq=w.seq, weight_grads=w.weight_grads, repeats=repeats,
            )
            peak = {k: r[f"peak{s}"] for k, s in (("median", ""), ("min", "_min"), ("max", "_max"))} if "peak" in r else None
            time = {k: r[f"time{s}"] for k, s in (("median", ""), ("min", "_min"), ("max", "_max"))} if "time" in r else None
            rows.append({**r, "section": "strategies", "framework": peer, "strategy": strategy,
                         **dataclasses.asdict(w), **({"peak": peak, "time": time} if peak else {})})
        add_ratios(rows[-2:])
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """Peak and time ratios against the plain step (``none``) of the same framework."""
    base = next((r for r in rows if r["strategy"] == "none" and "error" not in r), None)
    policy = next((r for r in rows if r["strategy"] == "none-policy"), None)
    for r in rows:
        if base is None or "error" in r:
            continue
        r["peak_ratio"] = r["peak"]["median"] / base["peak"]["median"]
        r["time_ratio"] = r["time"]["median"] / base["time"]["median"]
        if policy:
            r["peak_ratio_vs_policy"] = r["peak"]["median"] / policy["peak"]["median"]
            r["time_ratio_vs_policy"] = r["time"]["median"] / policy["time"]["median"]
    return rows


def depth_growth(rows: list[dict], w: Workload) -> dict[str, list[float]]:
    """How much each strategy's peak grows per added block, in block inputs, depth by depth."""
    growth = {}
    for s in dict.fromkeys(r["strategy"] for r in rows):
        rs = sorted((r for r in rows if r["strategy"] == s), key=lambda r: r["blocks"])
        growth[s] = [
            (b["peak"]["median"] - a["peak"]["median"]) / (b["blocks"] - a["blocks"]) / w.block_input_bytes()
            for a, b in zip(rs, rs[1:])
        ]
    return growth


def depth_notes(growth: dict[str, list[float]], depths: list[int]) -> list[str]:
    """One line per strategy of the depth sweep."""
    between = ", ".join(str(d) for d in sorted(depths))
    return [f"- depth sweep, `{s}`: peak grows per added block by "
            + ", ".join(f"{g:.2f}" for g in gs) + f" block inputs (between {between} blocks)"
            for s, gs in growth.items()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=SUITES, default="default", help="shapes (default: scaled down)")
    p.add_argument("--models", default="mlp,transformer", help="comma-separated: mlp, transformer")
    p.add_argument("--batch", type=int, help="override the suite's batch size")
    p.add_argument("--dim", type=int, help="override the suite's model width")
    p.add_argument("--blocks", type=int, help="override the suite's number of blocks")
    p.add_argument("--seq", type=int, help="override the transformer's sequence length")
    p.add_argument("--strategies", default=",".join(workloads.STRATEGIES),
                   help="comma-separated MLX strategies (default: all; see benchmarks/workloads.py)")
    p.add_argument("--weight-grads", choices=("both", "on", "off"), default="both",
                   help="which MLP gradients to take: input only (off), all (on), or both")
    p.add_argument("--eager", action="store_true", help="do not compile the step")
    p.add_argument("--depths", default="4,8,16,32", help="blocks of the depth sweep; '' skips it")
    p.add_argument("--peers", default="auto",
                   help="comma-separated from torch-eager, torch-compile, jax-jit; 'auto': those importable; 'none'")
    p.add_argument("--peer-python", default=sys.executable, help="the interpreter that runs the peers")
    p.add_argument("--budget", type=measure.parse_budget, metavar="MIB",
                   help="nv.eval's budget for none-policy and nuvec, MiB or 'inf' (default: nuvec_mlx's on this device)")
    p.add_argument("--repeats", type=int, default=3, help="measurements per case (medians reported)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="output folder")
    args = p.parse_args(argv)
    args.strategies = args.strategies.split(",")
    unknown = set(args.strategies) - set(workloads.STRATEGIES)
    if unknown:
        p.error(f"--strategies: unknown {sorted(unknown)}; choose from {', '.join(workloads.STRATEGIES)}")
    args.models = args.models.split(",")
    if set(args.models) - set(workloads.MODELS):
        p.error(f"--models: choose from {', '.join(workloads.MODELS)}")
    args.depths = [int(d) for d in args.depths.split(",") if d]
    return args


def selected(args: argparse.Namespace) -> tuple[list[Workload], Workload]:
    """The suite's workloads, with the command line's overrides."""
    table_workloads, depth_base = SUITES[args.suite]
    over = {k: getattr(args, k) for k in ("batch", "dim", "blocks", "seq") if getattr(args, k)}
    keep = {"both": (False, True), "on": (True,), "off": (False,)}[args.weight_grads]
    chosen = [dataclasses.replace(w, **over, compiled=not args.eager) for w in table_workloads
              if w.model in args.models and (w.model != "mlp" or w.weight_grads in keep)]
    return chosen, dataclasses.replace(depth_base, **over, compiled=not args.eager)


def peers_to_run(args: argparse.Namespace) -> list[str]:
    if args.peers == "none":
        return []
    from nuvec_mlx_bench import peers

    if args.peers == "auto":
        return peers.available() if args.peer_python == sys.executable else list(peers.PEERS)
    return args.peers.split(",")


def notes_for(args: argparse.Namespace, peers: list[str], rows: list[dict], depth: list[dict],
              depth_base: Workload) -> list[str]:
    """The results' notes: how they were measured, the depth sweep's growth and issue #3's targets."""
    growth = depth_growth(depth, depth_base) if depth else {}
    depths = sorted({r["blocks"] for r in depth})
    none = "none asked for" if args.peers == "none" else "none importable here"
    notes = [
        f"- suite `{args.suite}`" + (": scaled-down shapes, so that it runs in minutes on a CPU; "
                                     "`--suite full` runs the seed's" if args.suite == "default" else ""),
        f"- MLX figures: medians of {args.repeats} (min–max), cases round-robin in one process; "
        "peaks after `mx.synchronize()`, cache cleared first, above the memory active before the step; "
        f"times: {measure.TIMES}",
        "- ratios: against the plain step (`none`) of the same framework and workload; "
        "`none` and the other MLX strategies evaluate with `mx.eval`, `none-policy` and `nuvec` with `nv.eval`",
        f"- peers run in their own processes ({', '.join(peers) or none}); "
        "each row's `method` in results.json says how its peak was read",
        *depth_notes(growth, depths),
    ]
    return notes + targets.checks(rows, growth, depths, args.budget)


def main(argv: list[str] | None = None) -> int:
    """The ``nuvec-mlx-bench`` command: run the benchmark, exit status 0."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark that the command line ``argv`` asks for; return its rows."""
    args = parse_args(argv)
    if args.budget is None:
        args.budget = nv.memory.current_budget()
    with nv.memory.budget(args.budget):
        return benchmark(args)


def benchmark(args: argparse.Namespace) -> list[dict]:
    """Measure, report and write what ``args`` asks for, inside ``nv.memory.budget(args.budget)``."""
    table_workloads, depth_base = selected(args)
    peers = peers_to_run(args)
    env = {**measure.environment(), "nv.eval budget": measure.budget_text(args.budget)}
    reports = mx.distributed.init().rank() == 0  # under mlx.launch, rank 0 reports every rank's peak
    parts = len(table_workloads) + len(args.depths)
    rows, depth = [], []

    def save(done: int) -> list[str]:
        """Write what was measured so far: an interrupted run leaves its finished parts behind."""
        notes = notes_for(args, peers, rows, depth, depth_base)
        if done < parts:
            notes.insert(0, f"- partial: {done} of {parts} parts measured (the run was still going)")
        if reports:
            report.write(args.out, env, rows + depth, notes)
        return notes

    notes = save(0)
    for done, w in enumerate(table_workloads, 1):
        rows += mlx_rows(w, args.strategies, args.repeats, "strategies")
        rows += peer_rows(w, peers, args.peer_python, args.repeats) if peers else []
        notes = save(done)
    for done, blocks in enumerate(args.depths, len(table_workloads) + 1):
        w = dataclasses.replace(depth_base, blocks=blocks)
        depth += mlx_rows(w, [s for s in DEPTH_STRATEGIES if s in args.strategies], args.repeats, "depth")
        notes = save(done)
    if reports:
        print("\n".join(report.table(rows + depth)))
        print("\n".join(notes))
        print(f"wrote results.json, results.md and plots into {args.out}")
    return rows + depth


if __name__ == "__main__":
    sys.exit(main())
