"""The fine-tuning benchmark: mlx-lm models trained as mlx-lm trains them, with mlx-lm's, nuvec's or no checkpoints.

    nuvec-mlx-bench-train                          # small sizes for a CPU (minutes)
    nuvec-mlx-bench-train --suite h200             # public models' configurations, bf16, batch 4 x 2048
    nuvec-mlx-bench-train --configs qwen3-0.6b --layers 2 --seq 256     # a public configuration, 2 layers deep
    nuvec-mlx-bench-train --suite long             # long sequences, each trainer in its own process (:mod:`.long`)
    python -m nuvec_mlx_bench.train ...            # the same, without the installed command

The models are public configurations (``--configs``: :data:`nuvec_mlx_bench.testing.PUBLIC_CONFIGS`,
every field as published, random weights, optionally fewer layers) or
architectures scaled to a width and depth (``--archs``). For each model and
mode (full, LoRA, QLoRA) it builds one model per strategy (:mod:`.cases`) and
measures, round-robin in one process, each step's peak memory above what the
model and optimizer hold, its time (tokens per second), and the time's two
parts: the host's dispatch and the evaluation. Then the peak at each length of
``--seqs``, fitted as what grows with the length and with its square, and the
largest sequence whose step fits each of ``--memory`` (parameters, optimizer
state and the step's peak), found by measuring (:mod:`.lengths`). Writes
``results.json``, ``results.md`` and ``peak_vs_seq.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
from pathlib import Path

import mlx.core as mx
import mlx_lm
from tqdm import tqdm

import nuvec_mlx as nv

from .. import testing
from ..core import environment, mlx_measure, options, rounds, throttle
from . import lengths, long, report
from .cases import MODES, NUVEC_STEPS, STRATEGIES, Case, TrainWorkload

PROG = "nuvec-mlx-bench-train"

#: The suites' settings; every one can be overridden on the command line. ``layers`` is the
#: architectures' depth; public configurations keep theirs unless ``--layers`` is given.
SUITES = {
    "cpu": dict(
        configs="",
        archs="llama",
        modes="full,lora,qlora",
        strategies=",".join(STRATEGIES),
        hidden=64,
        layers=4,
        batch=2,
        seq=128,
        vocab=256,
        dtype="bfloat16",
        memory="16MiB",
        seqs="64,128,256,512",
        seq_step=64,
        max_seq=2048,
        repeats=3,
    ),
    "h200": dict(
        configs="llama-3.2-1b,qwen3-0.6b,gemma-3-1b",
        archs="",
        modes="full,lora",
        strategies="none,mlx-lm,nuvec,nuvec-unchunked",
        hidden=2048,
        layers=16,
        batch=4,
        seq=2048,
        vocab=32000,
        dtype="bfloat16",
        memory="8GiB,16GiB,32GiB",
        seqs="512,1024,2048,4096,8192",
        seq_step=256,
        max_seq=65536,
        repeats=5,
    ),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a value no workload can take is an error."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument(
        "--suite",
        choices=[*SUITES, "long"],
        default="cpu",
        help="default settings (cpu: minutes on 2 cores); long: long sequences, each trainer in a process of its "
        "own through its own train(), with options of its own (nuvec-mlx-bench-train --suite long --help)",
    )
    p.add_argument("--configs", help=f"public configurations, comma-separated from {', '.join(testing.PUBLIC_CONFIGS)}")
    p.add_argument(
        "--archs",
        help=f"architectures at --hidden, --layers, --vocab, comma-separated from "
        f"{', '.join(testing.ARCHITECTURES)} (given alone, --configs defaults to none, "
        "and the other way round)",
    )
    p.add_argument("--modes", help=f"comma-separated from {', '.join(MODES)}")
    p.add_argument(
        "--strategies", help=f"comma-separated from {', '.join(STRATEGIES)} (none included: the ratios' base)"
    )
    p.add_argument(
        "--layers",
        type=options.positive,
        help="the architectures' depth; for public configurations, fewer layers than theirs",
    )
    for name in ("hidden", "vocab"):
        p.add_argument(f"--{name}", type=options.positive, help=f"the architectures' {name} (the suite's by default)")
    for name in ("batch", "seq", "repeats"):
        p.add_argument(f"--{name}", type=options.positive, help=f"override the suite's {name}")
    p.add_argument("--dtype", choices=testing.DTYPES, help="the weights' dtype")
    p.add_argument("--lora-rank", type=options.positive, default=8)
    p.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA's dropout (mlx-lm's default: 0)")
    p.add_argument(
        "--memory",
        help="memories the largest sequence must fit in, comma-separated (16GiB, 512MiB, "
        "or a bare number of MiB); '' or 0 skips the search",
    )
    p.add_argument("--seqs", help="sequence lengths of the peak-against-length sweep; '' skips it")
    p.add_argument("--seq-step", type=options.positive, help="the search's granularity, in tokens")
    p.add_argument("--max-seq", type=options.positive, help="the longest sequence the search tries")
    p.add_argument(
        "--throttle",
        "--budget",
        type=throttle.parse_throttle,
        metavar="MIB",
        help="nv.eval's throttle for nuvec's steps, MiB or 'inf' (default: nuvec_mlx's; --budget is its former name)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/train"), help="output folder")
    args = p.parse_args(argv)
    if args.suite == "long":
        p.error("--suite long has options of its own: run it through main() (nuvec-mlx-bench-train --suite long)")
    suite = SUITES[args.suite]
    layers, arch_layers = args.layers, args.layers or suite["layers"]  # configurations keep their depth
    if args.archs is not None or args.configs is not None:  # one given: the other is none unless given too
        args.archs, args.configs = args.archs or "", args.configs or ""
    for k, v in suite.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.layers = layers
    args.archs, args.configs = options.csv(args.archs), options.csv(args.configs)
    args.modes, args.strategies = options.csv(args.modes), options.csv(args.strategies)
    try:
        args.seqs = [options.positive(s) for s in options.csv(args.seqs)]
        args.memory = sorted({options.memory_size(m) for m in options.csv(args.memory)} - {0})
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(f"--seqs must be lengths >= 1 and --memory sizes: {e}")
    if not args.strategies or set(args.strategies) - set(STRATEGIES) or "none" not in args.strategies:
        p.error(f"--strategies: choose from {', '.join(STRATEGIES)}, none included")
    if args.throttle is not None and not set(NUVEC_STEPS) & set(args.strategies):
        p.error(f"--throttle: only nuvec's steps evaluate with nv.eval; add one of {', '.join(NUVEC_STEPS)}")
    unknown = set(args.configs) - set(testing.PUBLIC_CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {', '.join(testing.PUBLIC_CONFIGS)}")
    try:
        common = dict(
            batch=args.batch, seq=args.seq, dtype=args.dtype, lora_rank=args.lora_rank, lora_dropout=args.lora_dropout
        )
        args.workloads = [
            TrainWorkload(c, layers=args.layers, mode=m, **common) for c in args.configs for m in args.modes
        ]
        args.workloads += [
            TrainWorkload(a, hidden=args.hidden, layers=arch_layers, vocab=args.vocab, mode=m, **common)
            for a in args.archs
            for m in args.modes
        ]
    except (TypeError, ValueError) as e:
        p.error(str(e))
    if not args.workloads:
        p.error("--configs or --archs, and --modes, must name at least one each")
    return args


def peak_at(case: Case, seq: int, steps: int = 1) -> int:
    """The step's peak at ``seq`` tokens (after a warm-up step at that length), above what the case holds: the
    highest of ``steps`` steps, since a length fits a run only if every step of it does."""
    batch = case.batch(seq)
    finish = mlx_measure.finished(case.evaluate)
    finish(case.step(batch))  # traces and compiles at this length
    return max(rounds.peak(lambda: case.step(batch), finish, mlx_measure.MlxProbe()) for _ in range(steps))


def _rebuild(cases: dict[str, Case], strategy: str) -> None:
    """Build ``cases[strategy]`` afresh: a step stopped by running out of device memory leaves its model
    and optimizer state unevaluated (the step's outputs, which no later step can compute either)."""
    w = cases.pop(strategy).workload
    gc.collect()
    mx.clear_cache()
    cases[strategy] = Case(w, strategy)


def _searched_peak(cases: dict[str, Case], strategy: str, seq: int, row: dict, steps: int) -> float:
    """The length search's peak of ``strategy`` at ``seq`` tokens, the highest of ``steps`` steps (a step's
    peak can vary from step to step: mlx-lm's LoRA step's by up to 1.7x on CUDA), also kept in
    ``row["search"]``; infinite, so that it does not fit, where the step is not run (:meth:`Case.runs_at`,
    listed in ``row["not_run"]``) or the device cannot hold it at all (``row["out_of_memory"]``; the case
    is rebuilt for the next length)."""
    if not cases[strategy].runs_at(seq):
        row.setdefault("not_run", []).append(seq)
        return math.inf
    try:
        row["search"][seq] = peak_at(cases[strategy], seq, steps)
    except RuntimeError as e:
        if "out of memory" not in str(e):
            raise
        row.setdefault("out_of_memory", []).append(seq)
        _rebuild(cases, strategy)
        return math.inf
    return row["search"][seq]


def measure_workload(w: TrainWorkload, args: argparse.Namespace) -> list[dict]:
    """One workload's rows: each strategy's peak, time and its parts, peaks along ``--seqs`` and the
    largest length that fits each of ``--memory``."""
    cases = {s: Case(w, s) for s in args.strategies}
    measured = mlx_measure.run_cases(
        {s: c.timed(c.batch(w.seq)) for s, c in cases.items()},
        args.repeats,
        desc=w.label(),
        parts={s: c.parts for s, c in cases.items()},
    )
    rows = [
        {
            "workload": dataclasses.asdict(w),
            "label": w.label(),
            "strategy": s,
            "resident": c.resident(),
            **measured[s],
            "tokens_per_s": w.batch * w.seq / measured[s]["time"]["median"],
            "sweep": {},
            "search": {},
        }
        for s, c in cases.items()
    ]
    by = {r["strategy"]: r for r in rows}
    steps = len(args.seqs) * len(cases)
    with tqdm(total=steps, desc=f"{w.label()}: peak against length", unit="step", disable=not steps) as bar:
        for seq in args.seqs:
            for s, c in cases.items():
                if c.runs_at(seq):
                    by[s]["sweep"][seq] = peak_at(c, seq)
                else:
                    by[s].setdefault("not_run", []).append(seq)
                bar.update()
    searched_cases = list(cases) if args.memory else []
    for s in tqdm(searched_cases, desc=f"{w.label()}: largest lengths", unit="strategy", disable=not args.memory):
        measured_peaks = {**by[s]["sweep"]}
        row, resident = by[s], cases[s].resident()

        def fits(
            seq: int, memory: int, s: str = s, seen: dict = measured_peaks, row: dict = row, resident: int = resident
        ) -> bool:
            if seq not in seen:
                seen[seq] = _searched_peak(cases, s, seq, row, args.repeats)
            return resident + seen[seq] <= memory

        by[s]["largest_seq"] = {
            options.size_text(m): lengths.largest_fitting(
                lambda seq, m=m: fits(seq, m), w.seq, args.seq_step, args.max_seq
            )
            for m in args.memory
        }
    for r in rows:
        r["growth"] = lengths.growth({int(k): v for k, v in {**r["sweep"], **r["search"]}.items()})
    cases.clear()  # the models, before the next workload builds its own
    gc.collect()
    return report.add_ratios(rows)


def main(argv: list[str] | None = None) -> int:
    """The ``nuvec-mlx-bench-train`` command: run the benchmark, exit status 0 (``--suite long``: see :mod:`.long`)."""
    if suite(argv) == "long":
        return long.main(argv)
    run(argv)
    return 0


def suite(argv: list[str] | None) -> str | None:
    """The ``--suite`` that ``argv`` names (``sys.argv``'s by default), or ``None``.

    Example:
        >>> suite(["--suite", "long", "--steps", "3"])
        'long'
    """
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--suite")
    return p.parse_known_args(argv)[0].suite


def run(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark that the command line ``argv`` asks for; write and return its rows.

    Example:
        >>> rows = run(["--hidden", "32", "--layers", "2", "--seq", "32", "--memory", "0", "--seqs", ""])
    """
    args = parse_args(argv)
    env = {
        **environment.environment(environment.command_line(PROG, argv)),
        "mlx_lm": mlx_lm.__version__,
        "nv.eval throttle": throttle.throttle_text(args.throttle),
    }
    rows: list[dict] = []
    written: list[Path] = []
    for done, w in enumerate(args.workloads, 1):
        if args.throttle is None:
            rows += measure_workload(w, args)
        else:
            with nv.memory.throttle(args.throttle):
                rows += measure_workload(w, args)
        partial = done < len(args.workloads)
        written = report.write(args.out, env, rows, args, partial)
    print("\n".join(report.table(rows, args.memory)))
    print("\n".join(report.notes(rows, args)))
    print(f"wrote {', '.join(p.name for p in written)} into {args.out}")
    return rows
