"""Probe: the peak of MLX's causal attention and its gradient alone, at the sizes given, or what it raises.

For each ``--shapes`` entry ``QUERIES:KEYS:HEADS:KV_HEADS`` (batch 1, ``--head-dim`` per head, bfloat16,
random inputs): the gradient of ``sum(mx.fast.scaled_dot_product_attention(q, k, v, mask="causal"))`` with
respect to the queries, keys and values, evaluated once. Prints the peak above the inputs
(``mx.get_peak_memory()`` after ``mx.synchronize()``, the cache cleared before each shape) and the seconds,
or the exception MLX raised (on CUDA, cuDNN's fused backward runs out of memory past a size of its own:
``nuvec_mlx._attention.FUSED_LIMIT``). With ``--chunks``, each shape also in nuvec's query chunks of each size
(``nv.scaled_dot_product_attention(..., chunk=N)``, its gradient through ``nv.grad_flat`` and evaluated by
``nv.eval``, one chunk at a time; 0: MLX's call whole, as without the flag): what chunks of the fused
attention save of its backward's memory, alone. On the CPU and Metal, attention under a gradient is unfused:
the scores take queries x keys x heads, so keep the shapes small there::

    python benchmarks/probes/attention_backward.py --shapes 57344:57344:32:8,65536:65536:32:8,32768:65536:32:8
    python benchmarks/probes/attention_backward.py --shapes 32768:32768:32:8 --chunks 0,16384,8192,4096
    python benchmarks/probes/attention_backward.py --shapes 256:256:4:1 --head-dim 64
"""

from __future__ import annotations

import argparse
import itertools
import time

import mlx.core as mx

import nuvec_mlx as nv
from nuvec_mlx_bench.core import environment, options


def _shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split(":")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is QUERIES:KEYS:HEADS:KV_HEADS of positive ints, got {text!r}")
    queries, keys, heads, kv_heads = (int(p) for p in parts)
    if queries > keys or heads % kv_heads:
        raise argparse.ArgumentTypeError(f"queries <= keys and heads a multiple of kv_heads, got {text!r}")
    return queries, keys, heads, kv_heads


def _gradient_peak(
    queries: int, keys: int, heads: int, kv_heads: int, head_dim: int, chunk: int
) -> tuple[float, float]:
    """The peak above the inputs, in MiB, and the seconds of one evaluation of the attention's gradient: MLX's
    call whole (``chunk`` 0), or nuvec's in chunks of ``chunk`` queries, evaluated a chunk at a time."""
    key = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((1, heads, queries, head_dim), key=key[0]).astype(mx.bfloat16)
    k, v = (mx.random.normal((1, kv_heads, keys, head_dim), key=s).astype(mx.bfloat16) for s in key[1:])
    mx.eval(q, k, v)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    held = mx.get_active_memory()

    def loss(xs: list[mx.array]) -> mx.array:
        q, k, v = xs
        if chunk:
            out = nv.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, mask="causal", chunk=chunk)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, mask="causal")
        return out.astype(mx.float32).sum()

    begin = time.perf_counter()
    if chunk:
        nv.eval(nv.grad_flat(loss, [0, 1, 2])([q, k, v]))
    else:
        mx.eval(mx.grad(lambda q, k, v: loss([q, k, v]), argnums=(0, 1, 2))(q, k, v))
    mx.synchronize()
    return (mx.get_peak_memory() - held) / 2**20, time.perf_counter() - begin


def main(argv: list[str] | None = None) -> dict[str, str]:
    """Run the probe on ``argv``; print and return each shape's peak and seconds, or what MLX raised."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=lambda s: [_shape(t) for t in s.split(",")], required=True)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--chunks",
        type=lambda s: [int(c) for c in options.csv(s)],
        default=[0],
        help="query chunks of nuvec's attention, comma-separated; 0: MLX's call whole (default: 0 only)",
    )
    args = p.parse_args(argv)
    if any(c < 0 for c in args.chunks):
        p.error(f"--chunks: sizes >= 1, or 0 for MLX's call whole, got {args.chunks}")
    print(environment.environment(environment.command_line("attention_backward.py", argv)))
    found = {}
    for (queries, keys, heads, kv_heads), chunk in itertools.product(args.shapes, args.chunks):
        label = f"queries {queries} keys {keys} heads {heads} kv {kv_heads} dim {args.head_dim}"
        label += f" chunks {chunk}" if chunk else ""
        try:
            peak, seconds = _gradient_peak(queries, keys, heads, kv_heads, args.head_dim, chunk)
            found[label] = f"peak {peak:,.0f} MiB, {seconds:.2f} s"
        except RuntimeError as error:  # MLX's allocation failures are RuntimeErrors
            found[label] = f"raised {str(error)[:100]}"
        mx.synchronize()
        mx.clear_cache()
        print(f"{label}: {found[label]}", flush=True)
    return found


if __name__ == "__main__":
    main()
