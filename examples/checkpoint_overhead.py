"""What a checkpoint costs on the host: building a gradient step's graph, eagerly.

An 8-layer mlx-lm Llama (hidden 64, batch 2, sequence 64, random weights) is
differentiated eagerly with nn.value_and_grad, without checkpoints and with
nv.checkpoint_layers; each step's graph is built, then evaluated. Printed:
the time to build the graph (for checkpoints: their custom functions, the
search for the modules each call reaches, the recomputation's graph) and the
whole step, median and min-max over 15 steps. Under mx.compile the graph is
built once per trace, so this is an eager step's cost only.

Run: python examples/checkpoint_overhead.py
"""

import platform
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

import nuvec_mlx as nv

STEPS = 15


def summary(seconds: list[float]) -> str:
    ms = [1e3 * s for s in seconds]
    return f"{statistics.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f})"


def run(checkpointed: bool) -> None:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=8, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=128))
    mx.eval(model.parameters())
    if checkpointed:
        nv.checkpoint_layers(model)
    x = mx.random.randint(0, 128, (2, 65))
    vg = nn.value_and_grad(model, lambda m, x: nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean())
    for _ in range(3):
        mx.eval(vg(model, x))
    build, step = [], []
    for _ in range(STEPS):
        start = time.perf_counter()
        out = vg(model, x)
        build.append(time.perf_counter() - start)
        mx.eval(out)
        step.append(time.perf_counter() - start)
    print(f"{'checkpointed' if checkpointed else 'plain':>12}: graph {summary(build)}, step {summary(step)}")


if __name__ == "__main__":
    print(f"MLX {mx.__version__}, {mx.default_device()}, {platform.machine()}, eager, {STEPS} steps")
    run(False)
    run(True)
