"""The fine-tuning benchmark: mlx-lm architectures trained as mlx-lm trains them, none / mlx-lm / nuvec.

    nuvec-mlx-bench-train                          # small sizes for a CPU (minutes)
    nuvec-mlx-bench-train --suite h200             # the targets' sizes: a 1B Llama and an MoE, bf16
    python -m nuvec_mlx_bench.train ...            # the same, without the installed command

For each architecture and mode (full, LoRA, QLoRA) it builds one model per
strategy (:mod:`nuvec_mlx_bench.train_steps`) and measures, round-robin in one
process, each step's peak memory above what the model and optimizer hold and
its time (tokens per second); then the peak at each length of ``--seqs``, and
the largest sequence length whose step fits ``--memory`` (parameters, optimizer
state and the step's peak), found by measuring (:mod:`nuvec_mlx_bench.seq_search`).
Writes ``results.json``, ``results.md`` and ``peak_vs_seq.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path

import mlx_lm
from tqdm import tqdm

import nuvec_mlx as nv
from nuvec_mlx_bench import architectures, budgets, environment, measure, rounds, seq_search, train_report
from nuvec_mlx_bench.train_steps import MODES, STRATEGIES, Case, TrainWorkload

PROG = "nuvec-mlx-bench-train"
MiB = 1 << 20

#: The suites' sizes; every one can be overridden on the command line.
SUITES = {
    "cpu": dict(archs="llama", modes="full,lora,qlora", strategies=",".join(STRATEGIES), hidden=64, layers=4,
                batch=2, seq=128, vocab=256, dtype="bfloat16", memory=16, seqs="64,128,256,512", seq_step=64,
                max_seq=2048, repeats=3),
    "h200": dict(archs="llama,qwen3_moe", modes="full,lora,qlora", strategies="none,mlx-lm,nuvec,nuvec-mx-eval",
                 hidden=2048, layers=16, batch=4, seq=2048, vocab=32000, dtype="bfloat16", memory=16 * 1024,
                 seqs="512,1024,2048,4096", seq_step=256, max_seq=65536, repeats=5),
}


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a value no workload can take is an error."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=SUITES, default="cpu", help="default sizes (cpu: minutes on 2 cores)")
    p.add_argument("--archs", help=f"comma-separated from {', '.join(architectures.ARCHITECTURES)}")
    p.add_argument("--modes", help=f"comma-separated from {', '.join(MODES)}")
    p.add_argument("--strategies",
                   help=f"comma-separated from {', '.join(STRATEGIES)} (none included: the ratios' base)")
    for name in ("hidden", "layers", "batch", "seq", "vocab", "repeats"):
        p.add_argument(f"--{name}", type=int, help=f"override the suite's {name}")
    p.add_argument("--dtype", choices=architectures.DTYPES, help="the weights' dtype")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA's dropout (mlx-lm's default: 0)")
    p.add_argument("--memory", type=float, help="MiB the largest sequence must fit in; 0 skips the search")
    p.add_argument("--seqs", help="sequence lengths of the peak-against-length sweep; '' skips it")
    p.add_argument("--seq-step", type=int, help="the search's granularity, in tokens")
    p.add_argument("--max-seq", type=int, help="the longest sequence the search tries")
    p.add_argument("--budget", type=budgets.parse_budget, metavar="MIB",
                   help="nv.eval's budget for nuvec, MiB or 'inf' (default: nuvec_mlx's)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/train"), help="output folder")
    args = p.parse_args(argv)
    for k, v in SUITES[args.suite].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.archs, args.modes, args.strategies = _csv(args.archs), _csv(args.modes), _csv(args.strategies)
    args.seqs = [int(s) for s in _csv(args.seqs)]
    if not args.strategies or set(args.strategies) - set(STRATEGIES) or "none" not in args.strategies:
        p.error(f"--strategies: choose from {', '.join(STRATEGIES)}, none included")
    if args.budget is not None and "nuvec" not in args.strategies:
        p.error("--budget: only nuvec evaluates with nv.eval; add nuvec to --strategies")
    for name in ("repeats", "seq_step", "max_seq"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.memory < 0 or any(s < 1 for s in args.seqs):
        p.error("--memory must be >= 0 MiB and --seqs lengths >= 1")
    try:
        args.workloads = [TrainWorkload(a, args.hidden, args.layers, args.batch, args.seq, args.dtype, m, args.vocab,
                                        args.lora_rank, args.lora_dropout)
                          for a in args.archs for m in args.modes]
    except (TypeError, ValueError) as e:
        p.error(str(e))
    if not args.workloads:
        p.error("--archs and --modes must name at least one each")
    return args


def peak_at(case: Case, seq: int) -> int:
    """The step's peak at ``seq`` tokens (after a warm-up step at that length), above what the case holds."""
    batch = case.batch(seq)
    finish = measure.finished(case.evaluate)
    finish(case.step(batch))  # traces and compiles at this length
    return rounds.peak(lambda: case.step(batch), finish, measure.MlxProbe())


def measure_workload(w: TrainWorkload, args: argparse.Namespace) -> list[dict]:
    """One workload's rows: each strategy's peak, time, peaks along ``--seqs`` and largest fitting length."""
    cases = {s: Case(w, s) for s in args.strategies}
    batch = {s: c.batch(w.seq) for s, c in cases.items()}
    measured = measure.run_cases({s: (lambda c=c, b=batch[s]: c.step(b), c.evaluate) for s, c in cases.items()},
                                 args.repeats, desc=w.label())
    rows = [{"workload": dataclasses.asdict(w), "label": w.label(), "strategy": s, "resident": c.resident(),
             **measured[s], "tokens_per_s": w.batch * w.seq / measured[s]["time"]["median"], "sweep": {}}
            for s, c in cases.items()]
    by = {r["strategy"]: r for r in rows}
    steps = len(args.seqs) * len(cases)
    with tqdm(total=steps, desc=f"{w.label()}: peak against length", unit="step", disable=not steps) as bar:
        for seq in args.seqs:
            for s, c in cases.items():
                by[s]["sweep"][seq] = peak_at(c, seq)
                bar.update()
    if args.memory:
        memory = int(args.memory * MiB)
        for s, c in tqdm(cases.items(), desc=f"{w.label()}: largest length in {args.memory:g} MiB", unit="strategy"):
            probes = by[s]["search"] = {}

            def fits(seq: int, c: Case = c, probes: dict = probes) -> bool:
                probes[seq] = peak_at(c, seq)
                return c.resident() + probes[seq] <= memory

            by[s]["largest_seq"] = seq_search.largest_fitting(fits, w.seq, args.seq_step, args.max_seq)
    del cases, batch
    gc.collect()
    return train_report.add_ratios(rows)


def main(argv: list[str] | None = None) -> int:
    """The ``nuvec-mlx-bench-train`` command: run the benchmark, exit status 0."""
    run(argv)
    return 0


def run(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark that the command line ``argv`` asks for; write and return its rows.

    Example:
        >>> rows = run(["--hidden", "32", "--layers", "2", "--seq", "32", "--memory", "0", "--seqs", ""])
    """
    args = parse_args(argv)
    env = {**environment.environment(environment.command_line(PROG, argv)), "mlx_lm": mlx_lm.__version__,
           "nv.eval budget": budgets.budget_text(args.budget)}
    rows: list[dict] = []
    for done, w in enumerate(args.workloads, 1):
        if args.budget is None:
            rows += measure_workload(w, args)
        else:
            with nv.memory.budget(args.budget):
                rows += measure_workload(w, args)
        partial = done < len(args.workloads)
        train_report.write(args.out, env, rows, args, partial)
    print("\n".join(train_report.table(rows)))
    print("\n".join(train_report.notes(rows, args)))
    print(f"wrote results.json, results.md and peak_vs_seq.png into {args.out}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
