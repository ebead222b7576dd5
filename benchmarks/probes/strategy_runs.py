"""Probe: does one strategy of the fine-tuning benchmark train a public configuration at a length?

One step of :class:`nuvec_mlx_bench.train.cases.Case` per length, evaluated as its trainer does; prints the
loss, or the error MLX raised. Written to check, on the H200, two things the fine-tuning benchmark met on
Gemma 3 (``benchmarks/results/h200/2026-12-05-train/``): whether mlx-lm's ``--grad-checkpoint`` raises past
the 512-token sliding window (an earlier probe saw it raise; at MLX 0.32.4 CUDA it ran at 512-2048 tokens),
and where the unchecked step stops (its logits at batch 4 x 4096 are 2**32 elements: MLX's CUDA backend
ends the process with a divide-by-zero, which no ``except`` catches)::

    python benchmarks/probes/strategy_runs.py --config gemma-3-1b --strategy mlx-lm --seqs 512 1024 2048
    python benchmarks/probes/strategy_runs.py --config gemma-3-1b --strategy none --batch 1 --seqs 4096
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from nuvec_mlx_bench.core import environment
from nuvec_mlx_bench.train.cases import MODES, STRATEGIES, Case, TrainWorkload


def main(argv: list[str] | None = None) -> list[str]:
    """Run the probe on the command line ``argv`` (``sys.argv``'s by default); return the lines it printed
    after the environment, one per length."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gemma-3-1b")
    p.add_argument("--strategy", choices=STRATEGIES, default="mlx-lm")
    p.add_argument("--mode", choices=MODES, default="lora")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, help="fewer layers than the configuration's")
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    args = p.parse_args(argv)
    print(environment.environment(environment.command_line("strategy_runs.py", argv)))
    case = Case(
        TrainWorkload(args.config, batch=args.batch, seq=max(args.seqs), layers=args.layers, mode=args.mode),
        args.strategy,
    )
    lines = []
    for seq in args.seqs:
        try:
            outputs = case.step(case.batch(seq))
            case.evaluate(outputs)
            mx.synchronize()
            what = f"ran, loss {outputs[0].item():.5f}"
        except (RuntimeError, ValueError) as e:
            what = f"raised {type(e).__name__}: {e}"
        lines.append(f"{args.config} {args.mode} {args.strategy} B={args.batch} T={seq}: {what}")
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    main()
