"""Probe: the loss head's time alone, whole against in checkpointed chunks, each chunk recomputed in the
backward pass or its gradient taken in the forward pass.

A bf16 head ``nn.Linear(hidden, vocabulary)``, frozen as in LoRA (or trained, ``--trainable``, as in full
fine-tuning), random hidden states and targets; the mean cross-entropy and its gradient with respect to the
hidden states (and the head's weight, ``--trainable``), compiled, in these ways (the value too, as a training
step needs it: a gradient alone would let MLX skip the forward pass of the chunks):

- ``whole``: ``nn.losses.cross_entropy(head(h), targets)`` under ``mx.value_and_grad``, the logits of every
  token at once;
- ``recomputed N``: ``nv.losses.cross_entropy(head, h, targets, chunk=N)`` under ``mx.value_and_grad``: each
  chunk recomputed in the backward pass, one stage each (``nv.compile``, ``nv.eval``);
- ``nuvec N``: the same under nuvec's gradient (``nv.value_and_grad_flat``): each chunk's gradient taken
  in its forward pass with its value, one stage each, the backward only scaling them (what
  ``nuvec-mlx-lora`` runs);
- ``unstaged N``: that computation written by hand (``mx.value_and_grad`` per chunk inside an
  ``mx.custom_function``, as Liger's fused linear cross-entropy does) under ``mx.compile`` and ``mx.eval``:
  no stages, so MLX may hold several chunks at once: what the stages cost.

``--chunks`` lists the chunk lengths in tokens (``auto`` is ``nv.chunking.head_tokens``'s). Medians (min–max)
of ``--repeats`` after a warm-up, the variants interleaved; peaks after ``mx.synchronize()`` with the cache
cleared first, above the memory active before; the largest difference of each gradient from ``whole``'s::

    python benchmarks/probes/head_time.py                      # Llama 3's vocabulary on hidden 128, 512 tokens
    python benchmarks/probes/head_time.py --tokens 64 --vocab 1024 --repeats 2
    python benchmarks/probes/head_time.py --batch 4 --tokens 2048 --hidden 1152 --vocab 262144 \\
        --chunks auto,1024 --trainable                          # Gemma 3 1B's head, full fine-tuning
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import nuvec_mlx as nv
from nuvec_mlx_bench.core import environment

Loss = Callable[[list[mx.array]], mx.array]
ValueAndGrad = Callable[[list[mx.array]], Any]


def variants(head: nn.Module, targets: mx.array, chunks: list[int], trainable: bool) -> dict[str, ValueAndGrad]:
    """Each way's compiled ``xs -> (loss, gradients)``, ``xs`` the head's weight (``trainable``) and the
    hidden states, by name."""
    argnums = [0, 1] if trainable else [0]

    def of(loss: Callable[[mx.array], mx.array]) -> Loss:
        def run(xs: list[mx.array]) -> mx.array:
            if trainable:
                head.weight = xs[0]
            return loss(xs[-1])

        return run

    def with_mx(loss: Loss) -> ValueAndGrad:
        vg = mx.value_and_grad(lambda *xs: loss(list(xs)), argnums=argnums)
        return lambda xs: vg(*xs)

    def part(h: mx.array, w: mx.array, t: mx.array) -> mx.array:
        return nn.losses.cross_entropy(h @ w.T, t).astype(mx.float32).sum()

    def by_hand(chunk: int) -> Callable[[mx.array], mx.array]:
        @mx.custom_function
        def run(h: mx.array, w: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            losses, dh, dw = [], [], mx.zeros_like(w)
            for s in range(0, h.shape[1], chunk):
                loss, grads = mx.value_and_grad(
                    lambda x, v, s=s: part(x, v, targets[:, s : s + chunk]), argnums=[0, 1] if trainable else 0
                )(h[:, s : s + chunk], w)
                losses.append(loss)
                dh.append(grads[0] if trainable else grads)
                dw = dw + grads[1] if trainable else dw
            return sum(losses), mx.concatenate(dh, axis=1), dw

        @run.vjp
        def run_vjp(primals: Any, cotangents: Sequence[mx.array], outputs: Sequence[mx.array]) -> Any:
            return tuple((cotangents[0] * g).astype(g.dtype) for g in outputs[1:])

        return lambda h: run(h, head.weight)[0]

    out = {"whole": mx.compile(with_mx(of(lambda h: part(h, head.weight, targets) / targets.size)))}
    for c in chunks:
        chunked = of(lambda h, c=c: nv.losses.cross_entropy(head, h, targets, chunk=c))
        out[f"recomputed {c}"] = nv.compile(with_mx(chunked))
        out[f"nuvec {c}"] = nv.compile(nv.value_and_grad_flat(chunked, argnums))
        out[f"unstaged {c}"] = mx.compile(with_mx(of(lambda h, c=c: by_hand(c)(h) / targets.size)))
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the probe on ``argv``; print and return each variant's median seconds, peak MiB and difference."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--chunks", default="auto", help="chunk lengths in tokens, comma-separated ('auto': head_tokens's)")
    p.add_argument("--trainable", action="store_true", help="also the head weight's gradient (full fine-tuning)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(environment.environment(environment.command_line("head_time.py", argv)))
    mx.random.seed(0)
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    head.set_dtype(mx.bfloat16)
    if not args.trainable:
        head.freeze()
    h = mx.random.normal((args.batch, args.tokens, args.hidden)).astype(mx.bfloat16)
    targets = mx.random.randint(0, args.vocab, (args.batch, args.tokens))
    mx.eval(head.parameters(), h, targets)
    xs = [head.weight, h] if args.trainable else [h]
    auto = nv.chunking.head_tokens(args.tokens, args.hidden, args.vocab, args.batch)
    chunks = list(dict.fromkeys(auto if c == "auto" else int(c) for c in args.chunks.split(",")))
    steps = variants(head, targets, chunks, args.trainable)
    samples: dict[str, dict[str, list[float]]] = {name: {"seconds": [], "peak": []} for name in steps}

    def run(name: str) -> Any:
        out = steps[name](xs)
        nv.eval(out)  # staged where the step has stages, mx.eval's where it has none
        return out

    results = {name: run(name) for name in steps}  # compiled and warm
    for _ in range(args.repeats):
        for name in steps:
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            begin = time.perf_counter()
            run(name)
            mx.synchronize()
            samples[name]["seconds"].append(time.perf_counter() - begin)
            samples[name]["peak"].append((mx.get_peak_memory() - before) / 2**20)
    what = "hidden states and head weight" if args.trainable else "hidden states"
    print(
        f"batch {args.batch} x {args.tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab}, gradient of "
        f"the {what}; chunks of {', '.join(map(str, chunks))} tokens (head_tokens: {auto})"
    )
    summary = {}
    whole = [a.astype(mx.float32) for _, a in tree_flatten(results["whole"][1])]
    for name, s in samples.items():
        got = [a.astype(mx.float32) for _, a in tree_flatten(results[name][1])]
        diff = max(mx.abs(a - b).max().item() for a, b in zip(got, whole, strict=True))
        summary[name] = {
            "seconds": statistics.median(s["seconds"]),
            "peak": statistics.median(s["peak"]),
            "difference": diff,
        }
        print(
            f"{name:16s} {summary[name]['seconds'] * 1e3:9.1f} ms ({min(s['seconds']) * 1e3:.1f}–"
            f"{max(s['seconds']) * 1e3:.1f})  x{summary[name]['seconds'] / summary['whole']['seconds']:.2f}  "
            f"peak {summary[name]['peak']:.1f} MiB  max |grad - whole's| {diff:.3g}",
            flush=True,
        )
    return summary


if __name__ == "__main__":
    main()
