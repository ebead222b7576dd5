"""nuvec_mlx: gradient checkpointing for MLX that lowers peak memory, also under compile."""

from . import memory
from .checkpoint import checkpoint_flat
from .compile import CompiledFlat, compile_flat, grad_flat, value_and_grad_flat
from .evaluate import eval
from .tree import checkpoint
from .nn import checkpoint_layers, checkpoint_module, checkpoint_sequential, is_checkpointed

__version__ = "0.1.0"

__all__ = [
    "CompiledFlat",
    "checkpoint",
    "checkpoint_layers",
    "checkpoint_module",
    "checkpoint_sequential",
    "checkpoint_flat",
    "compile_flat",
    "eval",
    "is_checkpointed",
    "grad_flat",
    "memory",
    "value_and_grad_flat",
]
