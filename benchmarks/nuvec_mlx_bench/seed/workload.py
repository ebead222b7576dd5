"""What the seed benchmark measures: one model at one shape and its values, described without a framework.

MLX (:mod:`.strategies`) and the PyTorch and JAX peers (:mod:`nuvec_mlx_bench.peers`,
whose processes must not import MLX) build their steps from the same
:class:`Workload` and take their weights and input from :func:`host_inputs`
(NumPy arrays that every framework copies), so that every framework takes the
very same step on the very same values; how each block is checkpointed (the
strategy) is given beside it. Every workload is ``blocks`` residual blocks in
float32 and one gradient step of ``sum(blocks(x))``, with respect to the input
``x`` (or, with ``weight_grads``, to every weight too). The blocks and their
values are :mod:`nuvec_mlx_bench.testing`'s: the same shapes and seeds
(:data:`WEIGHTS`, :data:`INPUT_SEED`), the values computed with NumPy's sine
here (``testing.filled`` computes them with MLX's, which may differ in the
last bit).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

#: The models: ``mlp`` the seed's block ``[B, D] -> [B, 4D] -> [B, D]``;
#: ``transformer`` a pre-norm decoder block on ``[B, T, D]``.
MODELS = ("mlp", "transformer")
#: Each block's weights per model: (rows, columns) in units of the width D, and a seed
#: (block ``i`` adds ``i`` to it): ``nuvec_mlx_bench.testing.WEIGHTS``, which cannot be imported
#: here (it imports MLX); a test holds the two equal.
WEIGHTS = {
    "mlp": [((1, 4), 0.11), ((4, 1), 0.23)],
    "transformer": [((1, 3), 0.13), ((1, 1), 0.17), ((1, 4), 0.11), ((4, 1), 0.23)],
}
#: The seed of the input (``nuvec_mlx_bench.testing.INPUT_SEED``).
INPUT_SEED = 0.37
#: Bytes per element (every workload is float32).
ITEMSIZE = 4


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model at one shape, and which gradients its step takes.

    Attributes:
        model: one of :data:`MODELS`.
        batch, dim, blocks: B, the width D and the number of blocks.
        seq: the transformer's sequence length T; the MLP has none and takes 1.
        weight_grads: also differentiate every weight (full fine-tuning).
        compiled: compile the step (MLX: :func:`nuvec_mlx.compile_flat`; the
            peers measure counterparts of the compiled step only).

    Raises:
        TypeError, ValueError: naming the field that is not of its kind or range.

    Example:
        >>> Workload("transformer", batch=8, dim=1024, blocks=8, seq=2048).block_input_bytes()
        67108864
    """

    model: str
    batch: int
    dim: int
    blocks: int
    seq: int = 1
    weight_grads: bool = False
    compiled: bool = True

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        for name in ("batch", "dim", "blocks", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("weight_grads", "compiled"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.model == "mlp" and self.seq != 1:
            raise ValueError(f"seq must be 1 for the mlp, which has no sequence, got {self.seq}")

    def input_shape(self) -> tuple[int, ...]:
        """The shape of the input, and of every block's input and output."""
        return (self.batch, self.dim) if self.model == "mlp" else (self.batch, self.seq, self.dim)

    def block_input_bytes(self) -> int:
        """Bytes of one block's input (the unit the depth sweep and the floor count in)."""
        return ITEMSIZE * self.batch * self.seq * self.dim

    def weight_shapes(self, i: int) -> list[tuple[tuple[int, int], float]]:
        """The (shape, seed) of each weight of block ``i``."""
        return [((rows * self.dim, cols * self.dim), seed + i) for (rows, cols), seed in WEIGHTS[self.model]]


#: The seed scenario: nuvec-compile 0.6.1's checkpoint memory test.
SEED = Workload("mlp", batch=4096, dim=256, blocks=8)
#: The full suite's larger shapes, beside the seed (sized for a GPU).
WIDE_MLP = Workload("mlp", batch=16384, dim=1024, blocks=8)
LONG_TRANSFORMER = Workload("transformer", batch=8, dim=1024, blocks=8, seq=2048)


def filled(shape: tuple[int, ...], seed: float) -> np.ndarray:
    """Well-scaled values, ``sin(arange * seed) * 0.05`` in float32 (NumPy's ``nuvec_mlx_bench.testing.filled``).

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
