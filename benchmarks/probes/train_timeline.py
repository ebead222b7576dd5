"""Throw-away probe: where in a fine-tuning step does nuvec's staged evaluation peak?

Prints the memory timeline (``nv.memory.timeline``) of one warm step of a strategy of the
fine-tuning benchmark (``benchmarks/train_steps.py``), at the ``cpu`` suite's sizes unless told:
active memory after each stage and the peak during it, in MiB above the memory active before
the step. Ran at the commit named in ``../results/cpu/train/README.md``::

    python benchmarks/probes/train_timeline.py qwen3_moe full float32 [nuvec-inf]
"""

from __future__ import annotations

import sys

import mlx.core as mx

import nuvec_mlx as nv
from nuvec_mlx_bench.train_steps import Case, TrainWorkload


def main(arch: str, mode: str, dtype: str, strategy: str = "nuvec-inf") -> None:
    case = Case(TrainWorkload(arch, 64, 4, batch=2, seq=128, dtype=dtype, mode=mode, vocab=256), strategy)
    batch = case.batch(128)
    case.evaluate(case.step(batch))  # compiles
    mx.synchronize()
    mx.clear_cache()
    start = mx.get_active_memory()
    with nv.memory.timeline() as t:
        case.evaluate(case.step(batch))
    print(f"{arch} {mode} {dtype} {strategy}: held {case.resident() / 2**20:.2f} MiB, MLX {mx.__version__}")
    for r in t.readings:
        print(f"  {r.name():36s} active {(r.active - start) / 2**20:6.2f}  peak {(r.peak - start) / 2**20:6.2f}")
    print(t.describe())


if __name__ == "__main__":
    main(*sys.argv[1:])
