"""The peak-memory benchmark: every checkpointing strategy, side by side, in one process.

    nuvec-mlx-bench                              # scaled-down shapes, minutes on 2 CPU cores
    nuvec-mlx-bench --suite full                 # the seed's and larger shapes (for a GPU)
    python -m nuvec_mlx_bench.peak ...           # the same, without the installed command

Runs the MLP and the decoder-only transformer (:mod:`nuvec_mlx_bench.seed`)
with each MLX strategy, a depth sweep, and (where PyTorch or JAX can be
imported) the same models through ``torch.utils.checkpoint`` and
``jax.checkpoint``, each peer in a process of its own. Each MLX step's time is
also taken apart: the host's dispatch (the call of the compiled step) and the
evaluation. Prints a table, the checkpointed peaks beside the analytic floor
and the targets' checks, and writes ``results.json``, ``results.md`` and PNG
plots into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

import nuvec_mlx as nv

from .. import peers
from ..core import environment, mlx_measure, options, rounds, throttle
from ..peers.process import run_isolated
from ..seed import rows as seed_rows
from ..seed import strategies
from ..seed.workload import LONG_TRANSFORMER, MODELS, SEED, WIDE_MLP, Workload
from . import depth, report, targets

PROG = "nuvec-mlx-bench"


@dataclasses.dataclass(frozen=True)
class Suite:
    """The shapes of a run: the strategy table's workloads, the depth sweep's, and MLX's repeats."""

    table: tuple[Workload, ...]
    depth_base: Workload
    repeats: int


def _both_grads(*ws: Workload) -> tuple[Workload, ...]:
    return tuple(dataclasses.replace(w, weight_grads=g) for w in ws for g in (False, True))


#: The suites. ``full`` keeps the seed MLP (B=4096 D=256) and adds the MLP at B=16384
#: D=1024 and the transformer at B=8 T=2048 D=1024 (which replaces B=8 T=512 D=256).
SUITES = {
    "default": Suite(
        _both_grads(Workload("mlp", 512, 64, 8), Workload("transformer", 2, 64, 8, seq=128)),
        Workload("mlp", 256, 64, 8),
        repeats=3,
    ),
    "full": Suite(
        _both_grads(SEED, WIDE_MLP, LONG_TRANSFORMER),
        SEED,
        repeats=15,
    ),
}
DEPTHS = "4,8,16,32"
DEPTH_STRATEGIES = ("none", "none-policy", "mx", "nuvec")
#: The strategies that evaluate with nv.eval, and so read --throttle.
THROTTLED = ("none-policy", "nuvec")


def mlx_rows(w: Workload, chosen: list[str], repeats: int, section: str) -> list[dict]:
    """Measure one workload with each MLX strategy, round-robin, in this process: peaks, times,
    and each step's dispatch and evaluation apart."""
    scenarios = {s: strategies.build(s, w) for s in chosen}
    parts = {s: rounds.Parts() for s in chosen}
    cases = {
        s: mlx_measure.split(lambda sc=sc: sc.step(sc.inputs), sc.evaluate, parts[s]) for s, sc in scenarios.items()
    }
    measured = mlx_measure.run_cases(cases, repeats, desc=f"{section}: {w.model} {w.blocks} blocks", parts=parts)
    rows = {
        s: seed_rows.row(section, "mlx", s, w, measured[s], traces=getattr(scenarios[s].step, "traces", None))
        for s in chosen
    }
    return seed_rows.add_ratios(list(mlx_measure.add_rank_peaks(rows).values()))


def peer_rows(w: Workload, names: list[str], python: str, repeats: int) -> list[dict]:
    """The same workload in PyTorch and JAX, each peer and strategy in a process of its own."""
    rows = []
    for peer in tqdm(names, desc=f"peers: {w.model}", unit="peer"):
        pair = [
            seed_rows.row("strategies", peer, s, w, run_isolated(peer, w, s, repeats, python)) for s in peers.STRATEGIES
        ]
        rows += seed_rows.add_ratios(pair)
    return rows


def depth_notes(rows: list[dict]) -> list[str]:
    """One line per strategy of the depth sweep: its median peak's growth per added block."""
    between = ", ".join(str(d) for d in sorted({r["blocks"] for r in rows}))
    return [
        f"- depth sweep, `{s}`: median peak grows per added block by "
        + ", ".join(f"{g:.2f}" for g in gs)
        + f" block inputs (between {between} blocks)"
        for s, gs in depth.median_growth(rows).items()
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; an option that a chosen workload cannot honour is an error."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=SUITES, default="default", help="shapes (default: scaled down for a CPU)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: mlp, transformer")
    p.add_argument("--batch", type=int, help="override the suite's batch size")
    p.add_argument("--dim", type=int, help="override the suite's model width")
    p.add_argument("--blocks", type=int, help="override the suite's number of blocks (not the depth sweep's)")
    p.add_argument("--seq", type=int, help="override the transformer's sequence length")
    p.add_argument(
        "--strategies",
        default=",".join(strategies.STRATEGIES),
        help="comma-separated MLX strategies, none included (default: all; see seed/strategies.py)",
    )
    p.add_argument(
        "--weight-grads",
        choices=("both", "on", "off"),
        default="both",
        help="the gradients: input only (off), input and weights (on), or each workload twice "
        "(both); the depth sweep takes the weights' only with on",
    )
    p.add_argument("--eager", action="store_true", help="do not compile the step (MLX only: no peers)")
    p.add_argument(
        "--depths",
        help=f"blocks of the depth sweep of the MLP (default {DEPTHS} with the mlp among --models); '' skips it",
    )
    p.add_argument(
        "--peers",
        default="auto",
        help="comma-separated from torch-eager, torch-compile, jax-jit; 'auto': those importable "
        "(none with --eager); 'none'",
    )
    p.add_argument("--peer-python", help="the interpreter that runs the peers (default: this one)")
    p.add_argument(
        "--throttle",
        "--budget",
        type=throttle.parse_throttle,
        metavar="MIB",
        help="nv.eval's throttle for none-policy and nuvec, MiB or 'inf' (default: nuvec_mlx's here; "
        "--budget is its former name)",
    )
    p.add_argument(
        "--repeats", type=options.positive, help="MLX's measurements per case (default: the suite's, 3 or 15)"
    )
    p.add_argument(
        "--peer-repeats",
        type=options.positive,
        help="each peer's measurements (default 3: peers repeat their peaks to the MiB)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="output folder")
    args = p.parse_args(argv)
    args.strategies = options.csv(args.strategies)
    unknown = set(args.strategies) - set(strategies.STRATEGIES)
    if unknown:
        p.error(f"--strategies: unknown {sorted(unknown)}; choose from {', '.join(strategies.STRATEGIES)}")
    if "none" not in args.strategies:
        p.error("--strategies must include none: every ratio is taken against it")
    if args.throttle is not None and not set(THROTTLED) & set(args.strategies):
        p.error(f"--throttle: no strategy evaluates with nv.eval; add {' or '.join(THROTTLED)}")
    args.models = options.csv(args.models)
    if not args.models or set(args.models) - set(MODELS):
        p.error(f"--models: choose from {', '.join(MODELS)}")
    if args.seq is not None and "transformer" not in args.models:
        p.error("--seq: only the transformer has a sequence; add transformer to --models")
    if args.depths is None:
        args.depths = DEPTHS if "mlp" in args.models else ""
    args.depths = [int(d) for d in options.csv(args.depths)]
    if args.depths and "mlp" not in args.models:
        p.error("--depths: the depth sweep runs the mlp; add mlp to --models, or pass --depths ''")
    args.peer_option, args.peers = args.peers, _peers(p, args)
    if not args.peers and (args.peer_python or args.peer_repeats):
        p.error("--peer-python and --peer-repeats need peers to run")
    args.peer_python = args.peer_python or sys.executable
    args.peer_repeats = args.peer_repeats or 3
    try:
        args.workloads, args.depth_base = selected(args)
        for blocks in args.depths:
            dataclasses.replace(args.depth_base, blocks=blocks)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    args.repeats = args.repeats or SUITES[args.suite].repeats
    return args


def _peers(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    if args.peers == "none":
        return []
    if args.peers == "auto":
        if args.eager:
            return []
        return peers.available() if args.peer_python in (None, sys.executable) else list(peers.PEERS)
    chosen = options.csv(args.peers)
    if set(chosen) - set(peers.PEERS):
        p.error(f"--peers: choose from {', '.join(peers.PEERS)}, or auto or none")
    if args.eager:
        p.error("--eager: the peers measure counterparts of the compiled step; add --peers none")
    return chosen


def selected(args: argparse.Namespace) -> tuple[list[Workload], Workload]:
    """The suite's workloads with the command line's overrides, and the depth sweep's base.

    Raises:
        ValueError, TypeError: an override no workload can take (from :class:`Workload`).
    """
    suite = SUITES[args.suite]
    over = {k: getattr(args, k) for k in ("batch", "dim", "blocks") if getattr(args, k) is not None}
    grads = {"both": (False, True), "on": (True,), "off": (False,)}[args.weight_grads]
    chosen = []
    for w in suite.table:
        if w.model in args.models and w.weight_grads in grads:
            seq = {"seq": args.seq} if args.seq is not None and w.model == "transformer" else {}
            chosen.append(dataclasses.replace(w, **over, **seq, compiled=not args.eager))
    base_over = {k: v for k, v in over.items() if k != "blocks"}
    base = dataclasses.replace(
        suite.depth_base, **base_over, weight_grads=args.weight_grads == "on", compiled=not args.eager
    )
    return list(dict.fromkeys(chosen)), base


def notes_for(args: argparse.Namespace, rows: list[dict], backend: str) -> list[str]:
    """The results' notes: how they were measured, the depth sweep's growth, the checkpointed peaks
    and the targets."""
    swept = [r for r in rows if r["section"] == "depth"]
    who = ", ".join(args.peers) or {"none": "none asked for"}.get(
        args.peer_option, "none with --eager" if args.eager else "none importable here"
    )
    notes = [
        f"- suite `{args.suite}`"
        + (
            ": scaled-down shapes, so that it runs in minutes on a CPU; `--suite full` runs the seed's and larger"
            if args.suite == "default"
            else ""
        ),
        f"- MLX figures: medians of {args.repeats} (min–max; every repeat in results.json), cases round-robin "
        "in one process; peaks after `mx.synchronize()`, cache cleared first, above the memory active before "
        f"the step; times: {rounds.TIMES}; {mlx_measure.PARTS}",
        f"- peers: medians of {args.peer_repeats}, each peer and strategy in its own process "
        f"({who}); each row's `method` in results.json says how its peak was read",
        "- ratios: against the plain step (`none`) of the same framework and workload; `none` and the other "
        "MLX strategies evaluate with `mx.eval`, `none-policy` and `nuvec` with `nv.eval`",
        "- floor: the bytes a checkpointed step of the workload cannot go below by MLX's vjps "
        "(stored block inputs, finished weight gradients, one block's backward live set; "
        "`nuvec_mlx_bench.floors`); `x floor` is the median peak over it",
        *depth_notes(swept),
    ]
    return notes + report.checkpointed_peaks(rows) + targets.checks(rows, backend, args.throttle)


def main(argv: list[str] | None = None) -> int:
    """The ``nuvec-mlx-bench`` command: run the benchmark, exit status 0."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark that the command line ``argv`` asks for; return its rows.

    Example:
        >>> rows = run(["--batch", "16", "--dim", "32", "--blocks", "2", "--peers", "none"])
    """
    args = parse_args(argv)
    env = {
        **environment.environment(environment.command_line(PROG, argv)),
        "nv.eval throttle": throttle.throttle_text(args.throttle),
    }
    if args.throttle is None:  # nuvec_mlx's defaults, as a user gets them
        return benchmark(args, env)
    with nv.memory.throttle(args.throttle):
        return benchmark(args, env)


def benchmark(args: argparse.Namespace, env: dict[str, str]) -> list[dict]:
    """Measure, report and write what ``args`` asks for (inside ``run``'s throttle, if one was given)."""
    reports = mx.distributed.init().rank() == 0  # under mlx.launch, rank 0 reports every rank's peak
    parts = len(args.workloads) + len(args.depths)
    rows: list[dict] = []

    def save(done: int) -> list[str]:
        """Write what was measured so far: an interrupted run leaves its finished parts behind."""
        notes = notes_for(args, rows, env["backend"])
        if done < parts:
            notes.insert(0, f"- partial: {done} of {parts} parts measured (the run was still going)")
        if reports:
            report.write(args.out, env, rows, notes)
        return notes

    notes = save(0)
    for done, w in enumerate(args.workloads, 1):
        rows += mlx_rows(w, args.strategies, args.repeats, "strategies")
        rows += peer_rows(w, args.peers, args.peer_python, args.peer_repeats) if args.peers else []
        notes = save(done)
    for done, blocks in enumerate(args.depths, len(args.workloads) + 1):
        w = dataclasses.replace(args.depth_base, blocks=blocks)
        rows += mlx_rows(w, [s for s in DEPTH_STRATEGIES if s in args.strategies], args.repeats, "depth")
        notes = save(done)
    if reports:
        print("\n".join(report.table(rows)))
        print("\n".join(notes))
        print(f"wrote results.json, results.md and plots into {args.out}")
    return rows
