"""Probe: does one strategy of the fine-tuning benchmark train a public configuration at a length?

One step of :class:`nuvec_mlx_bench.train.cases.Case` per length, evaluated as its trainer does; prints the
loss or the error MLX raised. Written for mlx-lm's ``--grad-checkpoint`` on Gemma 3, which on CUDA raises
past the 512-token sliding window (``mx.checkpoint`` differentiates the array mask, and MLX's fused
attention has no VJP for it), so the benchmark measures Gemma 3 without that strategy::

    python benchmarks/probes/strategy_runs.py --config gemma-3-1b --strategy mlx-lm --seqs 512 1024 2048
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from nuvec_mlx_bench.core import environment
from nuvec_mlx_bench.train.cases import MODES, STRATEGIES, Case, TrainWorkload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gemma-3-1b")
    p.add_argument("--strategy", choices=STRATEGIES, default="mlx-lm")
    p.add_argument("--mode", choices=MODES, default="lora")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, help="fewer layers than the configuration's")
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    args = p.parse_args()
    print(environment.environment(environment.command_line("strategy_runs.py", None)))
    case = Case(
        TrainWorkload(args.config, batch=args.batch, seq=max(args.seqs), layers=args.layers, mode=args.mode),
        args.strategy,
    )
    for seq in args.seqs:
        try:
            outputs = case.step(case.batch(seq))
            case.evaluate(outputs)
            mx.synchronize()
            print(
                f"{args.config} {args.mode} {args.strategy} B={args.batch} T={seq}: ran, loss {outputs[0].item():.5f}"
            )
        except (RuntimeError, ValueError) as e:
            print(f"{args.config} {args.mode} {args.strategy} B={args.batch} T={seq}: raised {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
