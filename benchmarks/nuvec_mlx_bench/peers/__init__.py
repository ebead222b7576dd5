"""The benchmark's models in PyTorch and JAX, each measured in a process of its own.

    python -m nuvec_mlx_bench.peers --peer torch-eager --model mlp --batch 512 --dim 64 --blocks 8 --strategy checkpoint
    python -m nuvec_mlx_bench.peers --peer jax-jit --check --model transformer --batch 8 --dim 16 --blocks 3 --seq 4
    python -m nuvec_mlx_bench.peers --peer torch-compile --calibrate 64     # a known 64 MiB step

Each prints one JSON line (:mod:`.process`, which also launches them: the
peers' processes get :data:`.peak_probes.ENV` and never import MLX). The
peers build the :class:`~nuvec_mlx_bench.seed.workload.Workload`'s models
(:mod:`.models`, written once for both frameworks; same blocks, shapes and
values as MLX) and take the same step: the gradients of ``sum(blocks(x))``
with respect to the input (or the input and every weight), followed by the
loss. Strategy ``none`` runs the blocks as they are, ``checkpoint`` wraps each
block in the framework's own checkpoint
(``torch.utils.checkpoint.checkpoint(use_reentrant=False)``,
``jax.checkpoint``). The frameworks: :mod:`.torch_peer` (eager, or under
``torch.compile``) and :mod:`.jax_peer` (under ``jax.jit``); their peaks are
read as :mod:`.peak_probes` says.
"""

from __future__ import annotations

import importlib.util

#: The peers, and the module each needs.
FRAMEWORKS = {"torch-eager": "torch", "torch-compile": "torch", "jax-jit": "jax"}
PEERS = tuple(FRAMEWORKS)
#: How a peer's blocks are checkpointed.
STRATEGIES = ("none", "checkpoint")


def available() -> list[str]:
    """The peers whose framework this interpreter can import (without importing it).

    Example:
        >>> available()
        ['torch-eager', 'torch-compile', 'jax-jit']
    """
    return [p for p in PEERS if importlib.util.find_spec(FRAMEWORKS[p]) is not None]
