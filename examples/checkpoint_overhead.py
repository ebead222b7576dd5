"""What checkpoints cost on the host: building an eager gradient step's graph.

Tiny mlx-lm models with random weights (8 layers, hidden 64, batch 2,
sequence 64) are differentiated eagerly with nn.value_and_grad, without
checkpoints and with nv.checkpoint_layers: a Llama, and a gemma4_text whose
KV-shared layers return (h, shared_kv, offset). Each step's graph is built,
then evaluated. Printed: the time to build the graph (for checkpoints: their
custom functions, the search for the modules each call reaches, the
recomputation's graph) and the whole step, median and min-max over 15 steps.
Under mx.compile the graph is built once per trace, so this is an eager
step's cost only.

Run: python examples/checkpoint_overhead.py [llama] [gemma4_text]
"""

import platform
import statistics
import sys
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text, llama

import nuvec_mlx as nv

STEPS, LAYERS, VOCAB = 15, 8, 128
SHARED = dict(hidden_size=64, num_hidden_layers=LAYERS, intermediate_size=128, vocab_size=VOCAB)
ARCHITECTURES = {
    "llama": lambda: llama.Model(
        llama.ModelArgs(model_type="llama", num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5, **SHARED)
    ),
    "gemma4_text": lambda: gemma4_text.Model(
        gemma4_text.ModelArgs(
            num_attention_heads=2,
            head_dim=16,
            global_head_dim=16,
            vocab_size_per_layer_input=VOCAB,
            num_key_value_heads=1,
            num_kv_shared_layers=LAYERS // 2,
            hidden_size_per_layer_input=8,
            sliding_window=32,
            sliding_window_pattern=2,
            **SHARED,
        )
    ),
}


def summary(seconds: list[float]) -> str:
    ms = [1e3 * s for s in seconds]
    return f"{statistics.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f})"


def measure(arch: str, checkpointed: bool) -> str:
    mx.random.seed(0)
    model = ARCHITECTURES[arch]()
    mx.eval(model.parameters())
    if checkpointed:
        nv.checkpoint_layers(model)
    x = mx.random.randint(0, VOCAB, (2, 65))
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
    return f"graph {summary(build)}, step {summary(step)}"


if __name__ == "__main__":
    print(f"MLX {mx.__version__}, {mx.default_device()}, {platform.machine()}, eager, {STEPS} steps")
    for arch in sys.argv[1:] or ARCHITECTURES:
        for checkpointed in (False, True):
            print(f"{arch:>12} {'checkpointed' if checkpointed else 'plain':>12}: {measure(arch, checkpointed)}")
