"""The benchmark's blocks written once for PyTorch and JAX, through the few operations they need.

Each block is the counterpart of the MLX block of :data:`nuvec_mlx_bench.testing.BLOCK_FUNCTIONS`;
:class:`Ops` supplies one framework's operations, and :func:`loss` chains the
blocks of a :class:`~nuvec_mlx_bench.seed.workload.Workload`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from ..seed.workload import Workload

#: The layer norms' epsilon (MLX's blocks use the same).
LN_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class Ops:
    """The few operations the blocks need, in one framework; arrays use ``@``, ``+`` and ``*``."""

    tanh: Callable[[Any], Any]
    layer_norm: Callable[[Any], Any]  # over the last axis, no affine, eps LN_EPS
    split3: Callable[[Any], tuple[Any, Any, Any]]  # the last axis in three
    causal_attention: Callable[[Any, Any, Any], Any]  # single head on [B, T, D], scale D**-0.5
    gelu: Callable[[Any], Any]  # exact (erf), as mlx.nn.gelu


def mlp_block(ops: Ops, x: Any, w1: Any, w2: Any) -> Any:
    """nuvec_mlx_bench.testing.mlp_block: a wide two-layer MLP with a residual."""
    h = ops.tanh(x @ w1)
    h = ops.tanh(h * h)
    return x + ops.tanh(h @ w2)


def transformer_block(ops: Ops, x: Any, wqkv: Any, wo: Any, w1: Any, w2: Any) -> Any:
    """nuvec_mlx_bench.testing.transformer_block: pre-norm causal single-head attention, then a 4x gelu MLP."""
    q, k, v = ops.split3(ops.layer_norm(x) @ wqkv)
    x = x + ops.causal_attention(q, k, v) @ wo
    return x + ops.gelu(ops.layer_norm(x) @ w1) @ w2


BLOCKS = {"mlp": mlp_block, "transformer": transformer_block}


def loss(
    ops: Ops, workload: Workload, strategy: str, remat: Callable[[Callable], Callable], x: Any, weights: Sequence[Any]
) -> Any:
    """``sum(blocks(x))``, each block wrapped by ``remat`` under strategy ``checkpoint``.

    Example:
        >>> loss(ops, Workload("mlp", 8, 16, 3), "checkpoint", jax.checkpoint, x, weights)
    """
    block = functools.partial(BLOCKS[workload.model], ops)
    if strategy == "checkpoint":
        block = remat(block)
    per = len(weights) // workload.blocks
    h = x
    for i in range(workload.blocks):
        h = block(h, *weights[per * i : per * (i + 1)])
    return h.sum()
