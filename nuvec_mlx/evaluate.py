"""Evaluation that keeps MLX's in-flight work within a memory budget.

MLX's evaluator dispatches ahead of the device: on CPU about a hundred ops can
be queued, on CUDA and Metal a whole command buffer, and every queued op keeps
its buffers alive until it has run. A checkpointed backward pass then holds
several blocks' recomputed activations at once. The evaluator does wait for
queued work whenever active memory exceeds MLX's memory limit, so a limit set
just above the memory the evaluation starts with turns that limit into a
throttle: the evaluator runs ahead only while memory is low.

On CUDA that throttle acts only between CUDA graphs, and MLX frees a graph's
buffers only once the whole graph has run (up to 100 ops on an H100 or H200).
So, when the CUDA backend is present, importing nuvec_mlx asks MLX for one op
per graph (``MLX_MAX_OPS_PER_BUFFER=1``) unless that variable is already set.
MLX reads it once, when it first uses the GPU: import nuvec_mlx before that,
or set the variable yourself.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from . import _stages, _validate, memory

# mx.set_memory_limit is process-wide: evaluations that set it take turns.
_limit_lock = threading.RLock()

if mx.cuda.is_available():
    os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "1")


def eval(*arrays: Any, budget: int | float | None = None) -> None:
    """Evaluate arrays as :func:`mlx.core.eval` does, within a memory budget.

    Args:
        arrays: what :func:`mlx.core.eval` takes: arrays, or lists, tuples and
            dicts of them nested as deep as you like (``nn.Module`` state,
            ``mx.random.state`` included); leaves that are not arrays are
            ignored.
        budget: bytes above the currently active memory that the evaluation
            may use before the evaluator waits for queued work; ``None`` uses
            the budget in force (:func:`nuvec_mlx.memory.budget`), ``math.inf``
            evaluates exactly as :func:`mlx.core.eval`.

    The memory limit is restored afterwards, also when evaluation raises.

    Example:
        >>> nv.eval(loss, grads)
        >>> nv.eval({"loss": loss, "grads": grads}, budget=64 << 20)
    """
    if budget is not None:
        _validate.check_budget(budget, "budget")
    taken = _stages.take(arrays)
    stages = taken.stages
    nbytes = memory.current_budget(staged=bool(stages)) if budget is None else budget
    try:
        with _throttle(nbytes):
            for i, stage in enumerate(stages):
                mx.eval(stage)
                _stages.evaluated(i, len(stages), _stages.kind(stage))
            mx.eval(*arrays)
            _stages.evaluated(len(stages), len(stages), "outputs")
    except BaseException:
        for undo in taken.undos:
            undo()
        raise


@contextlib.contextmanager
def _throttle(nbytes: float) -> Iterator[None]:
    """Hold MLX's memory limit at the active memory plus ``nbytes`` inside."""
    if nbytes == math.inf:
        yield
        return
    with _limit_lock:
        mx.synchronize()
        previous = mx.get_memory_limit()
        # Never loosen a tighter limit the user set.
        mx.set_memory_limit(min(previous, mx.get_active_memory() + int(nbytes)))
        try:
            yield
        finally:
            mx.set_memory_limit(previous)
