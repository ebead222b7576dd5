"""The benchmark's deterministic inputs, described without a framework.

``benchmarks/workloads.py`` (MLX) and ``benchmarks/peers.py`` (PyTorch, JAX,
which must not import MLX) fill the same shapes with the same
``sin(arange * seed) * 0.05`` values, so that every framework takes the very
same step.
"""

from __future__ import annotations

#: Each block's weights per model: (rows, columns) in units of the width D, and a seed
#: (block ``i`` adds ``i`` to it, so that every block has its own values).
WEIGHTS = {
    "mlp": [((1, 4), 0.11), ((4, 1), 0.23)],
    "transformer": [((1, 3), 0.13), ((1, 1), 0.17), ((1, 4), 0.11), ((4, 1), 0.23)],
}
#: The seed of the input.
INPUT_SEED = 0.37


def block_weights(model: str, dim: int, i: int) -> list[tuple[tuple[int, int], float]]:
    """The (shape, seed) of each weight of block ``i``."""
    return [((rows * dim, cols * dim), seed + i) for (rows, cols), seed in WEIGHTS[model]]
