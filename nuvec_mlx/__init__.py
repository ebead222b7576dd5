"""nuvec_mlx: gradient checkpointing for MLX that lowers peak memory, also under compile.

This module only re-exports. Where a public function and the module that
defines it share a name (``checkpoint``, ``compile``), ``nuvec_mlx.<name>``
is the function; the module is its home (``sys.modules["nuvec_mlx.checkpoint"]
.checkpoint`` is the same object).
"""

from . import chunking, losses, memory, policies
from ._attention import scaled_dot_product_attention
from ._marks import NotStagedWarning
from ._policies import checkpoint_name
from .checkpoint import checkpoint, checkpoint_flat
from .chunking import Chunks, chunk_layers
from .chunks import checkpoint_chunks
from .compile import Compiled, CompiledFlat, compile, compile_flat
from .evaluate import default_ahead, eval
from .grad import grad_flat, value_and_grad, value_and_grad_flat
from .nn import checkpoint_layers, checkpoint_module, checkpoint_sequential, is_checkpointed
from .planner import Fit, Plan, Planner, SavedActivations, largest_fit, plan, saved_activations
from .scan import scan
from .step import TrainingStep, update

__version__ = "0.1.0"

__all__ = [
    "Chunks",
    "Compiled",
    "NotStagedWarning",
    "TrainingStep",
    "CompiledFlat",
    "Fit",
    "Plan",
    "Planner",
    "SavedActivations",
    "checkpoint",
    "checkpoint_chunks",
    "checkpoint_flat",
    "checkpoint_layers",
    "checkpoint_module",
    "checkpoint_name",
    "checkpoint_sequential",
    "chunk_layers",
    "chunking",
    "compile",
    "compile_flat",
    "default_ahead",
    "eval",
    "grad_flat",
    "is_checkpointed",
    "largest_fit",
    "losses",
    "memory",
    "plan",
    "policies",
    "saved_activations",
    "scaled_dot_product_attention",
    "scan",
    "update",
    "value_and_grad",
    "value_and_grad_flat",
]
