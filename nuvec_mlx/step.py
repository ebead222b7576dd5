"""A training step: loss and gradients, the optimizer's update, compiled, evaluated one block at a time.

Staged evaluation needs four parts to agree: the gradient built by nuvec
(:func:`nuvec_mlx.value_and_grad`), the step compiled by nuvec
(:func:`nuvec_mlx.compile`), the optimizer's update staged per block
(:func:`update`), and the evaluation staged (:func:`nuvec_mlx.eval`).
:class:`TrainingStep` is the four together, with the state handled: call it
with a batch, get the loss back, evaluated. The parts stay public for loops of
your own; :func:`update` is the one of them defined here.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.nn.utils import average_gradients
from mlx.utils import tree_map, tree_unflatten

from . import _ceiling, _marks, _pytree, _state, _validate, evaluate
from .compile import Compiled
from .grad import value_and_grad


def update(optimizer: optim.Optimizer, model: nn.Module, gradients: Any) -> None:
    """``optimizer.update(model, gradients)``, each checkpointed block's update a stage after its backward.

    Inside a compiled step, :func:`nuvec_mlx.eval` evaluates the backward pass
    one checkpointed block at a time; ``optimizer.update`` then runs after the
    last of those stages, when every gradient is alive at once (in full
    fine-tuning a floor of one more copy of the weights, whatever the batch).
    Here the update of each block's parameters is a stage of its own, right
    after that block's backward stage, so each block's gradients are freed
    before the next block's are made. A block whose parameters are small
    beside its backward stage (LoRA's adapters) has its update computed in the
    stage after instead, which saves a wait. Values are those of
    ``optimizer.update``; parameters no checkpoint took are updated with the
    outputs. Outside a compiled step it is ``optimizer.update``. Gradients
    averaged across processes in buckets (``nn.average_gradients`` on several
    ranks) tie the blocks of a bucket together: a block's update stage then
    computes every gradient in its bucket.

    Args:
        optimizer: an ``mlx.optimizers`` optimizer.
        model: the model whose trainable parameters ``gradients`` mirror.
        gradients: the gradients, as ``nn.value_and_grad`` returns them.

    Example:
        >>> @nv.compile(inputs=state, outputs=state)
        ... def step(x, y):
        ...     loss, grads = nv.value_and_grad(model, loss_fn)(model, x, y)
        ...     nv.update(optimizer, model, grads)
        ...     return loss
    """
    _validate.check_optimizer(optimizer, "optimizer")
    _validate.check_module(model, "model")
    _validate.check_gradients(gradients, model)
    with _marks.updating(optimizer):
        optimizer.update(model, gradients)
    last = _marks.last_backward()
    stage_of = {path: last[id(m)] for path, m in model.named_modules() if id(m) in last}
    if not stage_of:
        return
    groups: dict[int, list[str]] = {}
    params = dict(_pytree.flatten(model.trainable_parameters()))
    for name in params:
        # The last stage of a checkpointed module that holds it: the parameter's gradient is done there.
        found = [i for path, i in stage_of.items() if not path or name.startswith(path + ".")]
        if found:
            groups.setdefault(max(found), []).append(name)
    staged = _marks.update_stages({i: [params[n] for n in names] for i, names in groups.items()})
    model.update(tree_unflatten([(n, a) for i, names in groups.items() for n, a in zip(names, staged[i])]))


class TrainingStep:
    """One training step of ``model``: the loss and its gradients, the optimizer's update, staged.

    Calling it with a batch runs the step: ``loss_fn(model, *batch)`` and the
    gradients of ``model``'s trainable parameters (:func:`nuvec_mlx.value_and_grad`),
    averaged across processes when launched distributed, then
    ``optimizer``'s update with each checkpointed block's update a stage right
    after its backward pass (:func:`update`); compiled with
    :func:`nuvec_mlx.compile`; evaluated with :func:`nuvec_mlx.eval`, one
    checkpointed block at a time, with this step's evaluation settings. It
    returns what ``loss_fn`` returned, evaluated. The model, the optimizer's
    state and ``mx.random.state`` are its compile state.

    ``dispatch_seconds`` and ``evaluation_seconds`` time the last call's two
    parts: the host building and dispatching the step (tracing it, the first
    time), and its staged evaluation.

    The step traces again by itself when a module's checkpointing changed
    since it was traced (:func:`nuvec_mlx.checkpoint_layers`,
    :func:`nuvec_mlx.chunk_layers`, :meth:`nuvec_mlx.Plan.apply` swap the
    class of the modules they change: the step compares its model's modules'
    classes with those it traced), so it always runs the blocks as they are. Inside
    :func:`nuvec_mlx.memory.ceiling`, a step stopped by the ceiling leaves
    the model, the optimizer and the random key as they were before it.

    Args:
        model: the model; checkpoint its blocks with
            :func:`nuvec_mlx.checkpoint_layers` (before or after).
        loss_fn: ``loss_fn(model, *batch)`` returning the loss, or a tuple or
            list whose first item is the loss (mlx-lm's losses return
            ``(loss, tokens)``), as :func:`mlx.nn.value_and_grad` takes it.
        optimizer: an ``mlx.optimizers`` optimizer; ``None`` for a step that
            returns ``(loss, gradients)`` and updates nothing.
        compile: compile the step (:func:`nuvec_mlx.compile`); ``False`` runs
            it eagerly, still staged.
        ahead: stages queued ahead of the one waited for
            (:func:`nuvec_mlx.eval`); ``None`` for
            :func:`nuvec_mlx.default_ahead` (1 on a GPU, 0 on the CPU); 0
            gives the lowest peak.
        synchronize: wait for the device after each stage
            (:func:`nuvec_mlx.eval`): on CUDA, the same peak every step.
        throttle: :func:`nuvec_mlx.eval`'s throttle; ``None`` for the default.
        accumulate: gradients are summed over this many calls and the
            optimizer updates with their mean on every ``accumulate``-th call
            (mlx-lm's ``grad_accumulation_steps``).
        average_gradients: average the gradients across processes
            (:func:`mlx.nn.average_gradients`; nothing on one process).

    Example:
        >>> nv.checkpoint_layers(model)
        >>> step = nv.TrainingStep(model, loss_fn, optim.Adam(1e-4))
        >>> for x, y in batches:
        ...     loss = step(x, y)
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[..., Any],
        optimizer: optim.Optimizer | None = None,
        *,
        compile: bool = True,
        ahead: int | None = None,
        synchronize: bool = False,
        throttle: int | float | None = None,
        accumulate: int = 1,
        average_gradients: bool = True,
    ):
        self.model = _validate.check_module(model, "model")
        self.loss_fn = _validate.check_callable(loss_fn, "loss_fn")
        self.optimizer = _validate.check_optimizer(optimizer, "optimizer", allow_none=True)
        self.compile = _validate.check_bool(compile, "compile")
        evaluate.check_settings(throttle, ahead, synchronize)
        self.ahead, self.synchronize, self.throttle = ahead, synchronize, throttle
        self.accumulate = _validate.check_int(accumulate, "accumulate", minimum=1)
        if optimizer is None and accumulate != 1:
            raise ValueError(f"accumulate must be 1 without an optimizer (nothing to update), got {accumulate}")
        self.average_gradients = _validate.check_bool(average_gradients, "average_gradients")
        self.state: list[Any] = self._current_state()
        self.calls = 0  # steps run: the optimizer updates on every accumulate-th
        #: The last call's seconds building and dispatching the step (the host's part) and evaluating it.
        self.dispatch_seconds = self.evaluation_seconds = 0.0
        self._grad: Any = None  # the gradients summed since the last update
        self._traced: Callable[..., tuple[Any, list[mx.array]]] | None = None
        self._traces = [0]  # how often the step's Python function ran (shared with its _Body, no cycle)
        # The model's modules and their classes when traced: checkpointing a block swaps its class.
        self._modules: list[nn.Module] = []
        self._classes: list[type] = []
        self._signatures: set[tuple] = set()  # of the calls run since the trace (_pytree.signature)

    def replace(self, **settings: Any) -> TrainingStep:
        """A new step of the same model, loss and optimizer, with ``settings`` changed.

        Example:
            >>> lowest = step.replace(ahead=0)
        """
        current = {
            "compile": self.compile,
            "ahead": self.ahead,
            "synchronize": self.synchronize,
            "throttle": self.throttle,
            "accumulate": self.accumulate,
            "average_gradients": self.average_gradients,
        }
        unknown = set(settings) - set(current)
        if unknown:
            raise TypeError(f"replace() takes the step's settings {sorted(current)}, got {sorted(unknown)}")
        return TrainingStep(self.model, self.loss_fn, self.optimizer, **{**current, **settings})

    def __call__(self, *batch: Any, **kwargs: Any) -> Any:
        """Run one step on ``batch`` (``loss_fn``'s arguments after the model) and return the loss, evaluated."""
        begin = time.perf_counter()
        do_update = (self.calls + 1) % self.accumulate == 0
        args = (batch, kwargs, self._grad, do_update)
        fresh = self._retracing() or _pytree.signature(args) not in self._signatures
        # A trace (the first call, or one with new shapes) that raises, or a call a ceiling stops, puts the
        # state back as it was before the call, also before a first trace makes the optimizer's state. (A
        # trace that raises leaves MLX's placeholders in the state.)
        stoppable = _ceiling.current() is not None
        undo = self.snapshot() if fresh or stoppable else None
        try:
            (value, grad), stages = self._trace()(*args)
        except BaseException:
            if undo is not None:
                undo()
            raise
        if not stoppable:
            # Traced: held through the evaluation, the state as it was would stay alive beside the updated
            # one until the step ends (a first step's peak above every later one's by up to the trainable
            # parameters and their optimizer state).
            undo = None
        outputs = [value] if self.optimizer is not None else [value, grad]
        dispatched = time.perf_counter()
        evaluate.staged(
            stages,
            [self.state, outputs, grad],
            throttle=self.throttle,
            ahead=self.ahead,
            synchronize=self.synchronize,
            undos=[undo] if undo is not None else [],
        )
        self.dispatch_seconds, self.evaluation_seconds = dispatched - begin, time.perf_counter() - dispatched
        self._signatures.add(_pytree.signature(args))
        self.calls += 1
        if self.optimizer is None:
            return value, grad
        self._grad = grad
        return value

    def _current_state(self) -> list[Any]:
        """The containers of the step's state now: the model's, the optimizer's, the random key's."""
        optimizer = [] if self.optimizer is None else [self.optimizer.state]
        return [self.model.state, *optimizer, mx.random.state]

    def _trace(self) -> Callable[..., tuple[Any, list[mx.array]]]:
        """The step's function, traced again if a block's checkpointing changed since, or if the
        optimizer's state was replaced (``optimizer.state = saved``, as a resumed run sets it): the
        compiled step reads and writes the containers it was traced with."""
        if self._retracing():
            self.state = self._current_state()
            self._signatures.clear()
            if self.optimizer is not None:  # its state exists before the step: a ceiling can put it back
                self.optimizer.init(self.model.trainable_parameters())
            self._modules = self.model.modules()
            self._classes = [type(m) for m in self._modules]
            body = _Body(self)
            if self.compile:
                self._traced = Compiled(body, inputs=self.state, outputs=self.state).call_staged
            else:
                self._traced = body.staged
        assert self._traced is not None  # made above when there was none
        return self._traced

    @property
    def traces(self) -> int:
        """How often the step's Python function was traced: compiled, it grows only when the step traces
        again (new shapes, a block's checkpointing changed, the optimizer's state replaced); uncompiled,
        with every call; as :attr:`nuvec_mlx.Compiled.traces`.

        Example:
            >>> step(x, y); step(x, y)
            >>> step.traces  # compiled: the second call replayed the first one's trace
            1
        """
        return self._traces[0]

    def _retracing(self) -> bool:
        """Whether the next call traces the step afresh (see :meth:`_trace`)."""
        if self._traced is None or self._replaced():
            return True
        return any(type(m) is not cls for m, cls in zip(self._modules, self._classes, strict=True))

    def _replaced(self) -> bool:
        """Whether the optimizer holds other state containers than the step's (a resumed run set them)."""
        return self.optimizer is not None and _containers(self.optimizer.state) != _containers(self.state[1])

    def snapshot(self) -> Callable[[], None]:
        """What puts the model, the optimizer's state and the random key back as they are now.

        The same containers are kept (a compiled step holds them); state a
        later step creates (an optimizer's first moments) is removed, the
        optimizer fills it in again at its next update, and the step traces
        afresh: MLX would reuse a trace begun with the smaller state and write
        its outputs back by position (a moment into the random key).

        Example:
            >>> undo = step.snapshot()
            >>> step(x, y)
            >>> undo()  # as if the step had not run
        """
        state, optimizer, me = self.state, self.optimizer, weakref.ref(self)  # no cycle through a held undo
        put_back = _state.snapshot(state)

        def undo() -> None:
            paths = [path for path, _ in _pytree.flatten(state)]
            put_back()
            if optimizer is not None:  # uninitialised: it fills in what the put-back removed
                optimizer.state = optimizer.state
            step = me()
            if step is not None and [path for path, _ in _pytree.flatten(state)] != paths:
                step._traced = None

        return undo

    def __repr__(self) -> str:
        return (
            f"TrainingStep(model={type(self.model).__name__}, loss_fn={_validate.name_of(self.loss_fn)}, "
            f"optimizer={type(self.optimizer).__name__ if self.optimizer else None}, compile={self.compile}, "
            f"ahead={self.ahead}, synchronize={self.synchronize}, throttle={self.throttle}, "
            f"accumulate={self.accumulate})"
        )


def _containers(state: Any) -> list[int]:
    """The identities of the dicts that hold an optimizer's ``state`` (one, or a ``MultiOptimizer``'s,
    whose ``state`` is a new dict of its optimizers' states at each read)."""
    states = state.get("states") if isinstance(state, dict) and set(state) == {"states"} else None
    if isinstance(states, list):
        return [i for s in states for i in _containers(s)]
    return [id(state)]


class _Body:
    """What a :class:`TrainingStep` traces: it refers to the step's parts, not to the step (no cycle
    through MLX's compile cache)."""

    def __init__(self, step: TrainingStep):
        self.model, self.optimizer = step.model, step.optimizer
        self.accumulate, self.average = step.accumulate, step.average_gradients
        self.value_and_grad = value_and_grad(step.model, step.loss_fn)
        self.traces = step._traces

    def __call__(self, batch: tuple, kwargs: dict, grad: Any, do_update: bool) -> tuple[Any, Any]:
        self.traces[0] += 1
        value, new = self.value_and_grad(self.model, *batch, **kwargs)
        if grad is not None:
            new = tree_map(mx.add, new, grad)
        if self.optimizer is None:
            return value, (average_gradients(new) if self.average else new)
        if not do_update:
            return value, new
        if self.average:
            new = average_gradients(new)
        if self.accumulate > 1:
            new = tree_map(lambda g: g / self.accumulate, new)
        update(self.optimizer, self.model, new)
        return value, None

    def staged(self, *args: Any) -> tuple[tuple[Any, Any], list[mx.array]]:
        """The step run eagerly, and its stages."""
        with _marks.collecting() as stages:
            out = self(*args)
        return out, list(stages)
