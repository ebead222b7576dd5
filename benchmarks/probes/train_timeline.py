"""Probe: where in a fine-tuning step does nuvec's staged evaluation peak?

Prints the memory timeline (``nv.memory.timeline``) of one warm step of a strategy of the
fine-tuning benchmark (``nuvec_mlx_bench.train.cases``), at the ``cpu`` suite's sizes (an
architecture at hidden 64, 4 layers, vocabulary 256, batch 2 x 128 tokens): active memory after
each stage and the peak during it, in MiB above the memory active before the step::

    python benchmarks/probes/train_timeline.py qwen3_moe full float32 [nuvec]
"""

from __future__ import annotations

import sys

import mlx.core as mx

import nuvec_mlx as nv
from nuvec_mlx_bench.train.cases import Case, TrainWorkload


def main(arch: str, mode: str, dtype: str, strategy: str = "nuvec") -> None:
    case = Case(TrainWorkload(arch, batch=2, seq=128, hidden=64, layers=4, vocab=256, dtype=dtype, mode=mode), strategy)
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
