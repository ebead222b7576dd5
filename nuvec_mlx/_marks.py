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
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import mlx.core as mx

from . import _depends, _pytree, _validate

_collector: contextvars.ContextVar[list[mx.array] | None] = contextvars.ContextVar("nuvec_mlx_stages", default=None)


class _Backward(NamedTuple):
    """A backward stage's modules (the ids of those its checkpoint held) and its arrays' bytes."""

    modules: frozenset[int]
    nbytes: int


class NotStagedWarning(UserWarning):
    """Part of a checkpointed step runs unstaged: several blocks' memory alive at once, silently otherwise."""


@dataclasses.dataclass
class _Step:
    """What the outermost collector learns while a step is built, besides its stages."""

    #: Each backward stage that ends some modules' gradients (see :func:`holding`), by
    #: the id of its mark, so that an optimizer's update can follow it (:func:`update_stages`).
    backward: dict[int, _Backward] = dataclasses.field(default_factory=dict)
    #: The optimizers whose update was staged (:func:`updating`): their state is the step's.
    optimizers: list[Any] = dataclasses.field(default_factory=list)
    #: The modules whose gradients a backward stage ends, and their parameters' ids then.
    parameters: dict[int, tuple[Any, list[int]]] = dataclasses.field(default_factory=dict)
    #: The segments of checkpointed blocks being built, by their link's segment (see :func:`segments`).
    segments: dict[object, Any] = dataclasses.field(default_factory=dict)


_step: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("nuvec_mlx_step", default=None)
_held: contextvars.ContextVar[tuple[object, ...]] = contextvars.ContextVar("nuvec_mlx_stage_held", default=())
_recomputing: contextvars.ContextVar[bool] = contextvars.ContextVar("nuvec_mlx_recomputing", default=False)


@contextlib.contextmanager
def collecting() -> Iterator[list[mx.array]]:
    """Collect the stages marked inside (fresh: enclosing collectors see none of them).

    The outermost collector also says, once, when the step replaced the
    parameters of checkpointed blocks without :func:`updating` (an
    ``optimizer.update`` inside ``nv.compile``): that update is not staged.
    """
    stages: list[mx.array] = []
    token = _collector.set(stages)
    step = _Step() if _step.get() is None else None  # made by the outermost collector only
    step_token = _step.set(step) if step is not None else None
    try:
        yield stages
        if step is not None:
            _warn_if_updated_unstaged(step)
    finally:
        _collector.reset(token)
        if step_token is not None:
            _step.reset(step_token)


def _warn_if_updated_unstaged(step: _Step) -> None:
    if step.optimizers:
        return
    for module, before in step.parameters.values():
        if [id(a) for _, a in _pytree.flatten(module.trainable_parameters())] != before:
            _validate.warn(
                "the step replaced the parameters of checkpointed blocks outside nv.update (optimizer.update "
                "inside nv.compile?): that update runs after the whole backward pass, with every gradient alive "
                "(in full fine-tuning one more copy of the weights at the peak). Call nv.update(optimizer, model, "
                "grads), which makes each block's update a stage after its backward, or use nv.TrainingStep",
                NotStagedWarning,
            )
            return


@contextlib.contextmanager
def updating(optimizer: Any) -> Iterator[None]:
    """Inside, ``optimizer`` updates the step being built, staged per block (:func:`update_stages`)."""
    step = _step.get()
    if step is not None:
        step.optimizers.append(optimizer)
    yield


def optimizers() -> list[Any]:
    """The optimizers whose update the step being built staged (their state is the step's)."""
    step = _step.get()
    return list(step.optimizers) if step is not None else []


def segments() -> dict[object, Any] | None:
    """The segments of consecutive checkpointed blocks the step being built has made so far (each block
    of a segment but the first recomputes its input from the first's), or ``None`` outside a step."""
    step = _step.get()
    return step.segments if step is not None else None


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


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Inside, a checkpoint's backward pass recomputes its forward pass: only what its vjps read is needed."""
    token = _recomputing.set(True)
    try:
        yield
    finally:
        _recomputing.reset(token)


def in_recomputation() -> bool:
    """Whether the code running is a checkpoint's recomputation (see :func:`recomputing`)."""
    return _recomputing.get()


#: The kinds of stage, told apart by the mark's dtype (which survives compile): a block's
#: forward pass, its backward pass, the update of its parameters, and a chunk of a chunked
#: checkpoint (its forward or its backward, inside a block or between blocks).
FORWARD, BACKWARD, UPDATE, CHUNK = "forward", "backward", "update", "chunk"
_DTYPES = {FORWARD: mx.bool_, BACKWARD: mx.uint8, UPDATE: mx.int8, CHUNK: mx.uint16}


def kind(stage: mx.array) -> str:
    """Which of :data:`FORWARD`, :data:`BACKWARD`, :data:`UPDATE` or :data:`CHUNK` ``stage`` ends."""
    return next(k for k, dtype in _DTYPES.items() if stage.dtype == dtype)


def chained(arrays: Sequence[mx.array]) -> list[mx.array]:
    """Make ``arrays`` (a block's gradients) depend on one another: none is done before all are."""
    return _depends.depends(list(arrays), list(arrays)) if len(arrays) > 1 else list(arrays)


def finished(arrays: Sequence[mx.array], stage_kind: str, modules: Sequence[object] = ()) -> list[mx.array]:
    """``arrays`` (a block's or a chunk's gradients) finished together: none is done before all are.

    Inside a collector they are marked as a stage (:func:`mark`): reading
    them through the mark, which depends on all of them, ties them together.
    Outside one they are :func:`chained`, so that a block's gradients are done
    before the cotangent moves on to the previous block, also in one
    :func:`mlx.core.eval`.
    """
    if _collector.get() is None or not arrays:
        return chained(arrays)
    return mark(arrays, stage_kind, modules)


def mark(arrays: Sequence[mx.array], stage_kind: str, modules: Sequence[object] = ()) -> list[mx.array]:
    """Mark a stage that ends once ``arrays`` are computed; use what it returns in their place.

    Args:
        arrays: a block's forward outputs, or the gradients its backward returns.
        stage_kind: :data:`FORWARD`, :data:`BACKWARD` or :data:`CHUNK`.
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
        step = _step.get()
        assert step is not None  # set with the collector, by the outermost collecting()
        step.backward[id(marker)] = _Backward(frozenset(map(id, modules)), _nbytes(arrays))
        for m in modules:
            params = getattr(m, "trainable_parameters", None)
            if params is not None and id(m) not in step.parameters:
                step.parameters[id(m)] = (m, [id(a) for _, a in _pytree.flatten(params())])
    return _through(arrays, marker)


def last_backward() -> dict[int, int]:
    """For each module a block held, by id: where its last backward stage is in the collector in force."""
    stages, step = _collector.get() or [], _step.get()
    backward = step.backward if step is not None else {}
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
    stages, step = _collector.get(), _step.get()
    assert stages is not None and step is not None  # called inside collecting(), which sets both
    backward = step.backward
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
