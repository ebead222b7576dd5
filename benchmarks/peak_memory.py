"""The peak-memory benchmark: the seed scenario, plain against checkpointed.

    python benchmarks/peak_memory.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx

from benchmarks import seed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=8)
    args = p.parse_args(argv)
    peaks = {}
    for strategy in ("none", "nuvec"):
        sc = seed.build(strategy, args.batch, args.dim, args.blocks)
        peaks[strategy] = seed.peak(sc)
    print(f"backend: {mx.default_device()}, MLX {mx.__version__}")
    for strategy, p_ in peaks.items():
        print(f"{strategy:>6}: peak {p_ / 2**20:8.1f} MiB")
    print(f" ratio: {peaks['nuvec'] / peaks['none']:.3f}")


if __name__ == "__main__":
    main()
