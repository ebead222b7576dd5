"""The benchmark's deterministic inputs, as NumPy arrays that every framework copies.

MLX and the peers take their weights and input from :func:`host_inputs`, so
that every framework takes the very same step on the very same values.
"""

from __future__ import annotations

import math

import numpy as np

from nuvec_mlx_bench.workload import INPUT_SEED, Workload


def filled(shape: tuple[int, ...], seed: float) -> np.ndarray:
    """Well-scaled values, ``sin(arange * seed) * 0.05`` in float32.

    Example:
        >>> filled((2, 2), 0.5).dtype
        dtype('float32')
    """
    n = math.prod(shape)
    return (np.sin(np.arange(n, dtype=np.float32) * np.float32(seed)) * np.float32(0.05)).reshape(shape)


def block_weights(workload: Workload, i: int) -> list[np.ndarray]:
    """The weights of block ``i``; every block has its own values."""
    return [filled(shape, seed) for shape, seed in workload.weight_shapes(i)]


def host_inputs(workload: Workload) -> tuple[list[np.ndarray], np.ndarray]:
    """The weights (block by block, in each block's order) and the input.

    Example:
        >>> weights, x = host_inputs(Workload("mlp", batch=4, dim=8, blocks=2))
        >>> len(weights), x.shape
        (4, (4, 8))
    """
    weights = [w for i in range(workload.blocks) for w in block_weights(workload, i)]
    return weights, filled(workload.input_shape(), INPUT_SEED)
