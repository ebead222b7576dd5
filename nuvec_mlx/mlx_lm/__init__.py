"""Fine-tuning with mlx-lm, checkpointed by nuvec: :func:`train`, ``nuvec-mlx-lora`` and ``nuvec-mlx-plan``.

``nuvec-mlx-lora`` is ``mlx_lm.lora`` (its arguments, config files, datasets,
losses, LoRA conversion and adapter files) with :func:`train` in place of
``mlx_lm.tuner.trainer.train``, so switching is one word::

    mlx_lm.lora    --model ./model --train --data ./data --grad-checkpoint
    nuvec-mlx-lora --model ./model --train --data ./data --grad-checkpoint

The only part of nuvec_mlx that needs mlx-lm: ``pip install "nuvec-mlx[mlx-lm]"``.
"""

from .lora import PROG, main
from .losses import chunked_loss
from .trainer import checkpointed_blocks, train

__all__ = ["PROG", "checkpointed_blocks", "chunked_loss", "main", "train"]
