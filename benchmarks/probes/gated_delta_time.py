"""Probe: one gated-delta layer's recurrence alone, its forward and backward pass, nuvec's against mlx-lm's.

The gated delta rule of Qwen3.5's linear-attention blocks on random inputs (batch 1, ``--heads`` heads of
``--dim`` for keys and values, one gate per head), the loss ``sum(y ** 2)`` and its gradient with respect to
the queries, keys and values, in one of two ways:

- ``nuvec``: :func:`nuvec_mlx.mlx_lm.gated_delta.make_gated_delta_update` (``--chunk`` tokens per chunk:
  the chunkwise-parallel form inside checkpointed chunks), what ``nuvec-mlx-lora`` trains with;
- ``mlx-lm``: mlx-lm's ``gated_delta_ops``, its per-token loop, what ``mlx_lm.lora`` trains with off Metal.

Eager (``mx.value_and_grad``, ``mx.eval``) or ``--compile`` (under ``mx.compile``). Prints each repeat's
seconds (the first also compiles MLX's kernels: on CUDA, minutes for a fresh process), the peak
(``mx.get_peak_memory()`` after ``mx.synchronize()``, the cache not cleared, the inputs included) and the
operations per token of the loss and its gradient (the primitives ``mx.export_to_dot`` draws, of the eager
graph: each is a kernel launched, on a GPU)::

    python benchmarks/probes/gated_delta_time.py --tokens 4096 --way nuvec
    python benchmarks/probes/gated_delta_time.py --tokens 1024 --way mlx-lm --heads 4 --repeats 2
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_ops

from nuvec_mlx.mlx_lm.gated_delta import make_gated_delta_update
from nuvec_mlx_bench.core import environment


def _operations(*outputs: mx.array) -> int:
    """The primitives of the graph that computes ``outputs`` (the rectangles of ``mx.export_to_dot``)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "graph.dot"
        mx.export_to_dot(str(path), *outputs)
        return len(re.findall(r"shape=rectangle", path.read_text()))


def main(argv: list[str] | None = None) -> list[float]:
    """Run the probe on ``argv``; print each repeat's seconds, the peak and the operations per token, and
    return the seconds."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--way", choices=("nuvec", "mlx-lm"), default="nuvec")
    p.add_argument("--chunk", type=int, default=None, help="nuvec's tokens per chunk (default: its own)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(environment.environment(environment.command_line("gated_delta_time.py", argv)))
    shape = (1, args.tokens, args.heads, args.dim)
    keys = mx.random.split(mx.random.key(0), 5)
    q, k = (mx.random.normal(shape, key=key) * 0.05 for key in keys[:2])
    v = mx.random.normal(shape, key=keys[2])
    a, b = (mx.random.normal(shape[:3], key=key) for key in keys[3:])
    a_log, dt_bias = mx.zeros((args.heads,)), mx.zeros((args.heads,))
    update = make_gated_delta_update(chunk=args.chunk)

    def loss(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        if args.way == "nuvec":
            y, _ = update(q, k, v, a, b, a_log, dt_bias)
        else:
            g = mx.exp(-mx.exp(a_log) * nn.softplus(a + dt_bias))
            y, _ = gated_delta_ops(q, k, v, g, mx.sigmoid(b), mx.zeros((1, args.heads, args.dim, args.dim)), None)
        return (y.astype(mx.float32) ** 2).sum()

    step = mx.value_and_grad(loss, argnums=(0, 1, 2))
    value, gradients = step(q, k, v)
    operations = _operations(value, *gradients)
    step = mx.compile(step) if args.compile else step
    seconds = []
    for i in range(args.repeats):
        begin = time.perf_counter()
        mx.eval(step(q, k, v))
        mx.synchronize()
        seconds.append(time.perf_counter() - begin)
        print(f"{args.way} T={args.tokens} {'compiled' if args.compile else 'eager'} repeat {i}: {seconds[-1]:.3f} s")
    print(f"peak {mx.get_peak_memory() / 2**20:.1f} MiB; {operations / args.tokens:.2f} operations per token")
    return seconds


if __name__ == "__main__":
    main()
