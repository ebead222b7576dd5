"""Probe: the loss head's time alone, whole against in checkpointed chunks against each chunk's gradient
taken in its forward pass.

A frozen bf16 head ``nn.Linear(hidden, vocabulary)`` (as in LoRA), random hidden states and targets; the
gradient of the mean cross-entropy with respect to the hidden states, under ``mx.compile``, three ways:

- ``whole``: ``nn.losses.cross_entropy(head(h), targets)``, the logits of every token at once;
- ``chunked``: ``nv.losses.cross_entropy(head, h, targets)``, chunks of ``nv.losses.head_chunk`` tokens, each
  recomputed in the backward pass (what ``nuvec-mlx-lora`` runs);
- ``grad in forward``: each chunk's loss and its gradient computed together in the forward pass
  (``mx.vjp`` inside an ``mx.custom_function``, as Liger's fused linear cross-entropy does), the backward
  only scaling the gradients kept (the peak here is not staged: MLX may hold every chunk at once).

Medians (min–max) of ``--repeats`` after a warm-up, the variants interleaved; peaks after
``mx.synchronize()`` with the cache cleared first, above the memory active before; the largest difference
of each gradient from ``whole``'s::

    python benchmarks/probes/head_time.py                      # Llama 3's vocabulary on hidden 128, 512 tokens
    python benchmarks/probes/head_time.py --tokens 64 --vocab 1024 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

import nuvec_mlx as nv
from nuvec_mlx_bench.core import environment


def variants(head: nn.Module, targets: mx.array, chunk: int) -> dict[str, Callable[[mx.array], mx.array]]:
    """The three losses of the hidden states, by name."""

    def part(h: mx.array, t: mx.array) -> mx.array:
        return nn.losses.cross_entropy(head(h), t).astype(mx.float32).sum()

    @mx.custom_function
    def fused(h: mx.array) -> tuple[mx.array, mx.array]:
        losses, grads = [], []
        for s in range(0, h.shape[1], chunk):
            (loss,), (grad,) = mx.vjp(
                lambda x, s=s: part(x, targets[:, s : s + chunk]), [h[:, s : s + chunk]], [mx.array(1.0)]
            )
            losses.append(loss)
            grads.append(grad)
        return sum(losses), mx.concatenate(grads, axis=1)

    @fused.vjp
    def fused_vjp(primals: mx.array, cotangents: list[mx.array], outputs: list[mx.array]) -> mx.array:
        return (cotangents[0] * outputs[1]).astype(outputs[1].dtype)

    return {
        "whole": lambda h: part(h, targets) / targets.size,
        "chunked": lambda h: nv.losses.cross_entropy(head, h, targets, chunk=chunk),
        "grad in forward": lambda h: fused(h)[0] / targets.size,
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the probe on ``argv``; print and return each variant's median seconds, peak MiB and difference."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(environment.environment(environment.command_line("head_time.py", argv)))
    mx.random.seed(0)
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    head.set_dtype(mx.bfloat16)
    head.freeze()
    h = mx.random.normal((1, args.tokens, args.hidden)).astype(mx.bfloat16)
    targets = mx.random.randint(0, args.vocab, (1, args.tokens))
    mx.eval(head.parameters(), h, targets)
    chunk = nv.losses.head_chunk(args.tokens, args.hidden, args.vocab)
    grads = {name: mx.compile(mx.grad(fn)) for name, fn in variants(head, targets, chunk).items()}
    samples: dict[str, dict[str, list[float]]] = {name: {"seconds": [], "peak": []} for name in grads}
    results = {name: g(h) for name, g in grads.items()}
    mx.eval(results)  # compiled and warm
    for _ in range(args.repeats):
        for name, g in grads.items():
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            begin = time.perf_counter()
            mx.eval(g(h))
            mx.synchronize()
            samples[name]["seconds"].append(time.perf_counter() - begin)
            samples[name]["peak"].append((mx.get_peak_memory() - before) / 2**20)
    print(f"{args.tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab}, chunks of {chunk} tokens")
    summary = {}
    for name, s in samples.items():
        diff = mx.abs(results[name].astype(mx.float32) - results["whole"].astype(mx.float32)).max().item()
        summary[name] = {
            "seconds": statistics.median(s["seconds"]),
            "peak": statistics.median(s["peak"]),
            "difference": diff,
        }
        print(
            f"{name:16s} {summary[name]['seconds'] * 1e3:9.1f} ms ({min(s['seconds']) * 1e3:.1f}–"
            f"{max(s['seconds']) * 1e3:.1f})  x{summary[name]['seconds'] / summary['whole']['seconds']:.2f}  "
            f"peak {summary[name]['peak']:.1f} MiB  max |grad - whole's| {diff:.3g}"
        )
    return summary


if __name__ == "__main__":
    main()
