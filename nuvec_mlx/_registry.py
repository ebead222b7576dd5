"""The registry of steps: where :func:`nuvec_mlx.eval` finds the stages of the arrays it is given.

The outermost collector of a step (:mod:`nuvec_mlx._marks`) *registers* the
stages it gathered with the arrays the step returns and the state it updates;
:func:`nuvec_mlx.eval` then takes the stages of the arrays it is given and
evaluates them one by one, before the arrays themselves. The registry holds
the arrays weakly, per thread, and forgets an entry when they are gone or when
the entry is among the oldest of more than :data:`REMEMBERED`. An entry
forgotten before :func:`nuvec_mlx.eval` took it was evaluated some other way
(:func:`mlx.core.eval`), unstaged: that is said once, with a
:class:`nuvec_mlx.NotStagedWarning`.

Observers (:func:`observing`) are told after each stage that
:func:`nuvec_mlx.eval` evaluates, and when an evaluation starts: the memory
timeline and the ceiling read memory there.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx

from . import _marks, _pytree, _validate

#: Registered steps remembered per thread: older ones are evaluated unstaged.
REMEMBERED = 16


def _forgotten() -> None:
    _validate.warn(
        "a checkpointed step's stages were never evaluated by nv.eval: the step ran unstaged, with "
        "several blocks' activations alive at once. Evaluate what the step returns (or the state it "
        "updates) with nv.eval; inside mx.compile, compile with nv.compile, which carries the stages out; "
        "or use nv.TrainingStep, which does both",
        _marks.NotStagedWarning,
    )


class _Entry:
    """The stages of one step, weak references to its arrays, and how to undo the step.

    The references' callback reaches the entry weakly: a callback holding it
    would make a cycle (entry, reference, callback) that keeps the entry, and
    the state its undo holds, alive until the garbage collector runs.
    """

    def __init__(self, arrays: Sequence[mx.array], stages: Sequence[mx.array], undo: Callable[[], None] | None):
        self.stages = list(stages)
        self.undo = undo
        self._alive = len(arrays)
        me = weakref.ref(self)

        def gone(_ref: weakref.ref) -> None:
            entry = me()
            if entry is not None:
                entry._gone()

        self.refs = [weakref.ref(a, gone) for a in arrays]

    def _gone(self) -> None:
        self._alive -= 1
        if self._alive == 0 and self.stages:
            self.forget(taken=False)

    def forget(self, taken: bool) -> None:
        """Drop the stages and the undo; warn if :func:`nuvec_mlx.eval` never took them."""
        if not taken and self.stages:
            _forgotten()
        self.stages, self.undo = [], None

    def holds(self, arrays: dict[int, mx.array]) -> bool:
        for ref in self.refs:
            a = ref()
            if a is not None and arrays.get(id(a)) is a:
                return True
        return False


_local = threading.local()


def entries() -> collections.deque[_Entry]:
    """This thread's registered steps, oldest first."""
    if not hasattr(_local, "entries"):
        _local.entries = collections.deque()
    return _local.entries


def register(arrays: Sequence[mx.array], stages: Sequence[mx.array], undo: Callable[[], None] | None = None) -> None:
    """Remember ``stages`` for ``arrays``, in this thread; ``undo`` puts the step's state back."""
    held = entries()
    for e in [e for e in held if not e.stages]:
        held.remove(e)
    if stages and arrays:
        held.append(_Entry(arrays, stages, undo))
        while len(held) > REMEMBERED:
            held.popleft().forget(taken=False)


@dataclasses.dataclass
class Taken:
    """The stages :func:`take` found, oldest step first, and the undos of their steps."""

    stages: list[mx.array]
    undos: list[Callable[[], None]]


def take(trees: Sequence[object]) -> Taken:
    """What was registered with any array in ``trees``; forgotten after."""
    held = entries()
    if not held:
        return Taken([], [])
    leaves = {id(a): a for a in _pytree.arrays(list(trees))}
    found = [e for e in held if e.stages and e.holds(leaves)]
    taken = Taken([s for e in found for s in e.stages], [e.undo for e in found if e.undo])
    for e in found:
        held.remove(e)
        e.forget(taken=True)
    return taken


def hand_on(arrays: Sequence[mx.array], stages: Sequence[mx.array], undo: Callable[[], None] | None = None) -> None:
    """Give ``stages`` to the enclosing collector, or register them with ``arrays`` (and ``undo``)."""
    collector = _marks.collector()
    if collector is None:
        register(arrays, stages, undo)
    else:
        collector.extend(stages)


# What nv.eval tells: after each stage, (index, count, kind) -> None; as an evaluation starts, () -> None.
_Observer = tuple[Callable[[int, int, str], None], Callable[[], None] | None]
_observers: contextvars.ContextVar[tuple[_Observer, ...]] = contextvars.ContextVar(
    "nuvec_mlx_stage_observers", default=()
)


@contextlib.contextmanager
def observing(callback: Callable[[int, int, str], None], started: Callable[[], None] | None = None) -> Iterator[None]:
    """Call ``callback(index, count, kind)`` after each stage :func:`nuvec_mlx.eval` evaluates inside,
    and ``started()`` (if given) as each evaluation starts.

    ``index`` counts from 0 to ``count``: the stages, then the evaluation of the
    arrays themselves (``kind`` ``"outputs"``); a callback that raises stops the
    evaluation there.
    """
    token = _observers.set((*_observers.get(), (callback, started)))
    try:
        yield
    finally:
        _observers.reset(token)


def observed() -> bool:
    """Whether a callback observes the stages here (it reads memory after each one)."""
    return bool(_observers.get())


def starting() -> None:
    """Tell the observers in force that an evaluation starts."""
    for _, started in _observers.get():
        if started is not None:
            started()


def evaluated(index: int, count: int, stage_kind: str) -> None:
    """Tell the observers in force that stage ``index`` of ``count`` has been evaluated."""
    for callback, _ in _observers.get():
        callback(index, count, stage_kind)
