"""Stages: the points of a step at which :func:`nuvec_mlx.eval` waits for the device.

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
(:func:`mlx.core.depends`), so that whatever evaluates them, also a plain
:func:`mlx.core.eval`, evaluates the mark right after them and lets it go: a
mark never keeps memory alive. A *collector* (a flat gradient, a compiled
step) gathers the marks made inside it in the order the graph was built:
forward stages in forward order, then backward stages in the order the
backward pass reaches the blocks. An optimizer's update inside the step can
add an *update* stage per block (:func:`update_stages`), right after the
block's backward stage, or, for a block whose parameters are small beside its
backward stage (LoRA's adapters), compute it in the stage after that one. The outermost collector *registers* them
with the arrays it returns; :func:`nuvec_mlx.eval` then evaluates the stages
of the arrays it is given, one by one, before the arrays themselves. The registry holds the
arrays weakly and forgets an entry when they are gone, or when the entry is
among the oldest of more than :data:`REMEMBERED` in the thread.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import mlx.core as mx
from mlx.utils import tree_flatten

from . import _depends

#: Registered steps remembered per thread: older ones are evaluated unstaged.
REMEMBERED = 16


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


class _Entry:
    """The stages of one step, weak references to its arrays, and how to undo the step."""

    def __init__(self, arrays: Sequence[mx.array], stages: Sequence[mx.array], undo: Callable[[], None] | None):
        self.stages = list(stages)
        self.undo = undo
        self._alive = len(arrays)
        self.refs = [weakref.ref(a, self._gone) for a in arrays]

    def _gone(self, _ref: weakref.ref) -> None:
        self._alive -= 1
        if self._alive == 0:
            self.stages, self.undo = [], None

    def holds(self, ids: set[int], arrays: dict[int, mx.array]) -> bool:
        for ref in self.refs:
            a = ref()
            if a is not None and id(a) in ids and arrays[id(a)] is a:
                return True
        return False


_local = threading.local()


def _entries() -> collections.deque[_Entry]:
    if not hasattr(_local, "entries"):
        _local.entries = collections.deque(maxlen=REMEMBERED)
    return _local.entries


def register(
    arrays: Sequence[mx.array], stages: Sequence[mx.array], undo: Callable[[], None] | None = None
) -> None:
    """Remember ``stages`` for ``arrays``, in this thread; ``undo`` puts the step's state back."""
    entries = _entries()
    for e in [e for e in entries if not e.stages]:
        entries.remove(e)
    if stages and arrays:
        entries.append(_Entry(arrays, stages, undo))


@dataclasses.dataclass
class Taken:
    """The stages :func:`take` found, oldest step first, and the undos of their steps."""

    stages: list[mx.array]
    undos: list[Callable[[], None]]


def take(trees: Sequence[object]) -> Taken:
    """What was registered with any array in ``trees``; forgotten after."""
    entries = _entries()
    if not entries:
        return Taken([], [])
    leaves = {id(a): a for _, a in tree_flatten(list(trees)) if isinstance(a, mx.array)}
    found = [e for e in entries if e.stages and e.holds(set(leaves), leaves)]
    for e in found:
        entries.remove(e)
    return Taken([s for e in found for s in e.stages], [e.undo for e in found if e.undo])


def hand_on(
    arrays: Sequence[mx.array], stages: Sequence[mx.array], undo: Callable[[], None] | None = None
) -> None:
    """Give ``stages`` to the enclosing collector, or register them with ``arrays`` (and ``undo``)."""
    collector = _collector.get()
    if collector is None:
        register(arrays, stages, undo)
    else:
        collector.extend(stages)


# Callbacks that nv.eval calls after each stage: (index, count, kind) -> None.
_observers: contextvars.ContextVar[tuple[Callable[[int, int, str], None], ...]] = (
    contextvars.ContextVar("nuvec_mlx_stage_observers", default=())
)


@contextlib.contextmanager
def observing(callback: Callable[[int, int, str], None]) -> Iterator[None]:
    """Call ``callback(index, count, kind)`` after each stage :func:`nuvec_mlx.eval` evaluates inside.

    ``index`` counts from 0 to ``count``: the stages, then the evaluation of the
    arrays themselves (``kind`` ``"outputs"``); a callback that raises stops the
    evaluation there.
    """
    token = _observers.set((*_observers.get(), callback))
    try:
        yield
    finally:
        _observers.reset(token)


def observed() -> bool:
    """Whether a callback observes the stages here (it reads memory after each one)."""
    return bool(_observers.get())


def evaluated(index: int, count: int, stage_kind: str) -> None:
    """Tell the observers in force that stage ``index`` of ``count`` has been evaluated."""
    for callback in _observers.get():
        callback(index, count, stage_kind)
