"""Stage marks: the points of a step's graph at which :func:`nuvec_mlx.eval` waits for the device.

MLX's evaluator runs up to ten tasks (CUDA graphs, Metal command buffers, CPU
task groups) ahead of the device, and every queued op keeps its buffers alive.
In a checkpointed backward pass that window spans several blocks, so several
blocks' recomputed activations are alive at once, by an amount that depends on
timing. Evaluating the backward pass one checkpointed block at a time bounds
the window to one block, at the cost of one host wait per block.

While a gradient is built, each checkpoint *marks* two stages: after its
forward output, and after the gradients its backward pass returns. A mark is
a one-element array that depends on those arrays and shares no buffer with
them; the block's consumers then read the arrays through the mark
(:func:`nuvec_mlx._depends.depends`), so that whatever evaluates them, also a
plain :func:`mlx.core.eval`, evaluates the mark right after them and lets it
go: a mark never keeps memory alive. A *collector* (a flat gradient, a
compiled step) gathers the marks made inside it in the order the graph was
built: forward stages in forward order, then backward stages in the order the
backward pass reaches the blocks. An optimizer's update inside the step can
add an *update* stage per block (:func:`update_stages`), right after the
block's backward stage, or, for a block whose parameters are small beside its
backward stage (LoRA's adapters), compute it in the stage after that one.
What a collector gathered is handed on to the registry
(:mod:`nuvec_mlx._registry`), from which :func:`nuvec_mlx.eval` takes it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import mlx.core as mx

from . import _depends

_collector: contextvars.ContextVar[list[mx.array] | None] = contextvars.ContextVar(
    "nuvec_mlx_stages", default=None
)


class _Backward(NamedTuple):
    """A backward stage's modules (the ids of those its checkpoint held) and its arrays' bytes."""

    modules: frozenset[int]
    nbytes: int


# While the outermost collector collects: each backward stage that ends some
# modules' gradients (see :func:`holding`), by id, so that an optimizer's
# update can follow the stage (:func:`update_stages`).
_backward: contextvars.ContextVar[dict[int, _Backward] | None] = contextvars.ContextVar(
    "nuvec_mlx_backward_stages", default=None
)
_held: contextvars.ContextVar[tuple[object, ...]] = contextvars.ContextVar("nuvec_mlx_stage_held", default=())


@contextlib.contextmanager
def collecting() -> Iterator[list[mx.array]]:
    """Collect the stages marked inside (fresh: enclosing collectors see none of them)."""
    token = _collector.set([])
    backward_token = _backward.set({}) if _backward.get() is None else None
    try:
        yield _collector.get()
    finally:
        _collector.reset(token)
        if backward_token is not None:
            _backward.reset(backward_token)


def collector() -> list[mx.array] | None:
    """The stages the innermost collector has gathered so far, or ``None`` outside one."""
    return _collector.get()


@contextlib.contextmanager
def holding(modules: Sequence[object]) -> Iterator[None]:
    """Checkpoints made inside hold ``modules``: their backward stages end those modules' gradients."""
    token = _held.set(tuple(modules))
    try:
        yield
    finally:
        _held.reset(token)


def held() -> tuple[object, ...]:
    """The modules that a checkpoint made here holds (see :func:`holding`)."""
    return _held.get()


#: The kinds of stage, told apart by the mark's dtype (which survives compile).
FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
_DTYPES = {FORWARD: mx.bool_, BACKWARD: mx.uint8, UPDATE: mx.int8}


def kind(stage: mx.array) -> str:
    """Whether ``stage`` ends a block's forward pass, its backward pass, or the update of its parameters."""
    return next(k for k, dtype in _DTYPES.items() if stage.dtype == dtype)


def chained(arrays: Sequence[mx.array]) -> list[mx.array]:
    """Make ``arrays`` (a block's gradients) depend on one another: none is done before all are."""
    return _depends.depends(list(arrays), list(arrays)) if len(arrays) > 1 else list(arrays)


def mark(arrays: Sequence[mx.array], stage_kind: str, modules: Sequence[object] = ()) -> list[mx.array]:
    """Mark a stage that ends once ``arrays`` are computed; use what it returns in their place.

    Args:
        arrays: a block's forward outputs, or the gradients its backward returns.
        stage_kind: :data:`FORWARD` or :data:`BACKWARD`.
        modules: for a backward stage, the modules the block held, whose
            parameters' gradients are then done (see :func:`update_stages`).

    Outside a collector this does nothing and returns ``arrays``.
    """
    stages = _collector.get()
    if stages is None or not arrays:
        return list(arrays)
    marker = _stage(stage_kind, arrays)
    stages.append(marker)
    if modules:
        _backward.get()[id(marker)] = _Backward(frozenset(map(id, modules)), _nbytes(arrays))
    return _through(arrays, marker)


def last_backward() -> dict[int, int]:
    """For each module a block held, by id: where its last backward stage is in the collector in force."""
    stages, backward = _collector.get() or [], _backward.get() or {}
    return {module: i for i, s in enumerate(stages) if id(s) in backward for module in backward[id(s)].modules}


#: An update whose arrays have less than 1/FOLD of the bytes of the backward
#: stage it follows has no stage of its own: it is computed in the stage after
#: (the next block's backward, or the outputs). A stage costs a wait on the
#: device and, with stages queued ahead, one of them, for little work there;
#: folded, the update keeps a few times its bytes (gradients, new values, the
#: optimizer's temporaries) alive one stage longer, a fraction of that stage's.
FOLD = 8


def update_stages(groups: dict[int, list[mx.array]]) -> dict[int, list[mx.array]]:
    """For each backward stage index in ``groups``, an update stage right after it computing its arrays.

    Made for an optimizer's update inside a compiled step: the arrays are the
    new values of the parameters whose gradients that stage completes. Each
    block's gradients are then spent on its update before the next block's
    are made, instead of all being alive when the update runs. An update
    small beside its backward stage is folded into the stage after (:data:`FOLD`).

    Returns:
        The arrays of each group read through its stage: use them in their place.
    """
    stages, backward = _collector.get(), _backward.get()
    out = {}
    for index in sorted(groups, reverse=True):  # the latest first: earlier indices stay valid
        arrays = groups[index]
        if FOLD * _nbytes(arrays) >= backward[id(stages[index])].nbytes:
            marker = _stage(UPDATE, arrays)
            stages.insert(index + 1, marker)
        elif index + 1 < len(stages):
            after = stages[index + 1]
            marker = _stage(kind(after), [after, *arrays])
            if id(after) in backward:
                backward[id(marker)] = backward.pop(id(after))
            stages[index + 1] = marker
        else:  # the last stage: computed with the outputs
            out[index] = list(arrays)
            continue
        out[index] = _through(arrays, marker)
    return out


def _nbytes(arrays: Sequence[mx.array]) -> int:
    return sum(a.nbytes for a in arrays)


def _stage(stage_kind: str, arrays: Sequence[mx.array]) -> mx.array:
    """A one-element array of ``stage_kind``'s dtype that depends on ``arrays`` and shares no buffer with them."""
    return _depends.depends([mx.zeros((1,), dtype=_DTYPES[stage_kind])], list(arrays))[0]


def _through(arrays: Sequence[mx.array], marker: mx.array) -> list[mx.array]:
    """``arrays`` read through ``marker``: any evaluation of them evaluates it, right after them, and lets it go."""
    return _depends.depends(list(arrays), [marker])


