"""The benchmark's models as ``mlx.nn`` modules, for the planner (:func:`nuvec_mlx.plan`).

The same blocks as :mod:`nuvec_mlx_bench.workloads` (the seed's MLP block, the
pre-norm decoder block) with the same weights, written with ``nn.Linear``
layers (no bias; ``nn.Linear`` computes ``x @ weight.T``), so that the
``save_matmuls`` policy sees their matrix multiplies, and held in a model's
``layers``. The loss is the workload's, ``sum(blocks(x))``; a module's step
differentiates every weight (the workload's ``weight_grads``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from nuvec_mlx_bench import inputs
from nuvec_mlx_bench.workload import INPUT_SEED, Workload


def _linear(weight: mx.array) -> nn.Linear:
    """An ``nn.Linear`` without bias computing ``x @ weight``."""
    layer = nn.Linear(weight.shape[0], weight.shape[1], bias=False)
    layer.weight = weight.T
    return layer


class MLPBlock(nn.Module):
    """The seed's block: ``x + tanh(tanh(tanh(x @ w1)²) @ w2)``."""

    def __init__(self, w1: mx.array, w2: mx.array):
        super().__init__()
        self.up, self.down = _linear(w1), _linear(w2)

    def __call__(self, x: mx.array) -> mx.array:
        h = mx.tanh(self.up(x))
        return x + mx.tanh(self.down(mx.tanh(h * h)))


class TransformerBlock(nn.Module):
    """The pre-norm decoder block: causal single-head attention, then a 4x gelu MLP."""

    def __init__(self, wqkv: mx.array, wo: mx.array, w1: mx.array, w2: mx.array):
        super().__init__()
        self.qkv, self.out, self.up, self.down = _linear(wqkv), _linear(wo), _linear(w1), _linear(w2)

    def __call__(self, x: mx.array) -> mx.array:
        h = mx.fast.layer_norm(x, None, None, 1e-5)
        q, k, v = mx.split(self.qkv(h)[:, None], 3, axis=-1)
        a = mx.fast.scaled_dot_product_attention(q, k, v, scale=x.shape[-1] ** -0.5, mask="causal")
        x = x + self.out(a[:, 0])
        h = mx.fast.layer_norm(x, None, None, 1e-5)
        return x + self.down(nn.gelu(self.up(h)))


class Model(nn.Module):
    """A workload's blocks in ``layers``, applied in turn."""

    def __init__(self, workload: Workload):
        super().__init__()
        block = MLPBlock if workload.model == "mlp" else TransformerBlock
        self.layers = [block(*(mx.array(w) for w in inputs.block_weights(workload, i)))
                       for i in range(workload.blocks)]

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x)
        return x


def loss(model: Model, x: mx.array) -> mx.array:
    """The workload's loss: the sum of the last block's output."""
    return model(x).sum()


def build(workload: Workload) -> tuple[Model, mx.array]:
    """The module and its input for ``workload``, evaluated.

    Example:
        >>> model, x = build(Workload("transformer", batch=2, dim=64, blocks=4, seq=128))
        >>> nv.plan(model, loss, x, budget=64 << 20)
    """
    model = Model(workload)
    x = mx.array(inputs.filled(workload.input_shape(), INPUT_SEED))
    mx.eval(model.parameters(), x)
    return model, x
