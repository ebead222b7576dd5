"""Probe: where in a fine-tuning step does nuvec's staged evaluation peak?

Prints the memory timeline (``nv.memory.timeline``) of one warm step of a strategy of the
fine-tuning benchmark (``nuvec_mlx_bench.train.cases``): active memory after each stage and the
peak during it, in MiB above the memory active before the step (the cache cleared first). By
default an architecture at the ``cpu`` suite's sizes (hidden 64, 4 layers, vocabulary 256, batch
2 x 128 tokens); or a public configuration, as deep as ``--layers`` says::

    python benchmarks/probes/train_timeline.py qwen3_moe full float32 --strategy nuvec
    python benchmarks/probes/train_timeline.py llama-3.2-1b lora bfloat16 --layers 2 --batch 1 --seq 256 \\
        --strategy nuvec-mlp-chunks
    python benchmarks/probes/train_timeline.py llama-3.1-8b qlora bfloat16 --layers 2 --batch 1 --seq 8192 \\
        --chunks mlp=1024,projections=1024

``--chunks`` sets the nuvec step's ``nv.Chunks`` as ``nuvec-mlx-bench-train --suite long --chunks`` does
(a size in tokens, ``auto``, or 0 for off; the parts not named keep their defaults: ``norms=0`` leaves the
blocks' norms whole where the CPU's default chunks them). Inside the timeline no stage is queued ahead
(``ahead=0``), so a stage's peak is its own.

A shallow timeline stands for a deeper step: every block keeps its input until its backward pass, so at
``--depth N`` blocks (a public configuration's own depth by default) the step at ``ahead=0`` peaks at most at
the timeline's highest stage plus the other blocks' inputs, from a timeline of 2 or more blocks (one block
has no block before or after it), and at exactly that where the highest stage is the deepest block's, the
loss head's or a forward one. Two blocks have no middle one (with LoRA the first block's input needs no
gradient): where a middle block's stage is the highest, take 3. The bound leaves out the adapters'
gradients of the blocks done, which at training lengths are far smaller than the inputs freed. The probe
prints it; its check against a whole model's step is in ``benchmarks/results/h100/2026-12-07-8k-chunk-levers/``.
"""

from __future__ import annotations

import argparse
import dataclasses

import mlx.core as mx

import nuvec_mlx as nv
from nuvec_mlx_bench import testing
from nuvec_mlx_bench.core import environment, options
from nuvec_mlx_bench.train.cases import MODES, NUVEC_STEPS, STRATEGIES, Case, TrainWorkload, add_size_arguments


def main(argv: list[str] | None = None) -> nv.memory.Timeline:
    """Run the probe on ``argv``; print the step's timeline and return it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="an architecture (llama, qwen3_moe, ...) or a public configuration (qwen3-0.6b)")
    p.add_argument("mode", choices=MODES)
    p.add_argument("dtype", help="the weights' dtype (float32, bfloat16)")
    p.add_argument("--strategy", choices=STRATEGIES, default="nuvec")
    p.add_argument("--chunks", default="", help="the nuvec step's chunks, e.g. mlp=1024,projections=0")
    p.add_argument("--depth", type=options.positive, help="the blocks of the step to bound (a configuration's own)")
    add_size_arguments(p, batch=2, seq=128)  # an architecture's hidden, layers, vocab: 64, 4, 256 unless given
    args = p.parse_args(argv)
    print(environment.environment(environment.command_line("train_timeline.py", argv)))
    if args.model in testing.PUBLIC_CONFIGS:
        sizes = {"layers": args.layers}
    else:
        sizes = {"hidden": args.hidden or 64, "layers": args.layers or 4, "vocab": args.vocab or 256}
    w = TrainWorkload(args.model, args.batch, args.seq, mode=args.mode, dtype=args.dtype, **sizes)
    config = w.config()
    layers = config["num_hidden_layers"]
    if args.depth is not None and not 2 <= layers <= args.depth:
        p.error(f"--depth needs a timeline of 2 or more blocks, and at most --depth: got {layers} blocks")
    own = testing.PUBLIC_CONFIGS[args.model]["num_hidden_layers"] if w.public and layers >= 2 else None
    depth = args.depth or own
    how, label = NUVEC_STEPS.get(args.strategy), args.strategy
    if args.chunks:
        if how is None:
            p.error(f"--chunks is a nuvec strategy's setting, not {args.strategy}'s")
        try:
            how = dataclasses.replace(how, chunks=nv.Chunks.from_settings(**options.chunk_settings(args.chunks)))
        except (TypeError, ValueError) as e:
            p.error(str(e))
        label += f" --chunks {args.chunks}"
    case = Case(w, args.strategy, how)
    batch = case.batch(args.seq)
    case.evaluate(case.step(batch))  # compiles
    mx.synchronize()
    mx.clear_cache()
    start = mx.get_active_memory()
    with nv.memory.timeline() as t:
        case.evaluate(case.step(batch))
    print(f"{w.label()} {label}: held {case.resident() / 2**20:.2f} MiB, MLX {mx.__version__}")
    for r in t.readings:
        print(f"  {r.name():36s} active {(r.active - start) / 2**20:8.2f}  peak {(r.peak - start) / 2**20:8.2f}")
    print(t.describe())
    if depth is not None:
        print(_deeper(t, start, layers, depth, args.batch * args.seq, config["hidden_size"], args.dtype))
    return t


def _deeper(t: nv.memory.Timeline, start: int, layers: int, depth: int, tokens: int, hidden: int, dtype: str) -> str:
    """The bound on the step's peak at ``depth`` blocks from a timeline of ``layers``, as a sentence."""
    block = nv.chunking.blocks_inputs(tokens, hidden, itemsize=getattr(mx, dtype).size)
    bound = t.peak().peak - start + (depth - layers) * block
    return (
        f"at {depth} blocks and ahead=0: at most {bound / 2**20:.2f} MiB "
        f"({bound / (depth * block):.2f}x the blocks' inputs, {depth * block / 2**20:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
