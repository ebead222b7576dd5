"""The mechanism behind checkpoint policies: forward values kept for the recomputation.

A checkpointed call owns a :class:`Record`. While its function runs forward
(inside :meth:`Record.recording`), every value it could keep is *offered*: the
output of each ``nn.Linear``/``nn.QuantizedLinear`` call of the modules it
reaches (:func:`intercepting` swaps their class for the call's duration),
the outputs of each call of a function named with :func:`offering_calls`, and
each :func:`offer_name` value; those the policy accepts are kept, keyed by
where they were made (the layer, or the name) and how many times that place
had made one before. While the function is recomputed in the backward pass
(inside :meth:`Record.replaying`) the same places offer again, and a kept
value is returned in place of the new one, wrapped in a custom function whose
vjp is the vjp of what made it: it reads the recomputed inputs (and the
layer's weights), so gradients are exact, and the work that made the value is
built but never evaluated. A named value is the one exception: only the value
is known, not what made it, so the reuse's input is the recomputed value
itself, and MLX, which evaluates a custom function's inputs, computes it.

:func:`unrecomputed` is the block that recomputes nothing: its inputs pass
through an identity whose vjp finishes and marks the block's gradients, and
its outputs are marked, so it is staged like a checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from . import _calls, _capture, _marks, _pytree, _validate

MATMUL, NAME = "matmul", "name"

#: The layers whose outputs are offered as ``"matmul"`` values.
LAYERS = (nn.Linear, nn.QuantizedLinear)


@dataclasses.dataclass(frozen=True)
class Saveable:
    """A value of a checkpointed block's forward pass that a policy may keep.

    Attributes:
        kind: ``"matmul"`` (the output of an ``nn.Linear`` or
            ``nn.QuantizedLinear`` layer) or ``"name"`` (a value, or a
            function's output, named with :func:`nuvec_mlx.checkpoint_name`).
        name: the layer's path inside the module that reaches it (for example
            ``"mlp.up_proj"``), or the name given to ``checkpoint_name``.
        shape: the value's shape.
        dtype: the value's dtype.
    """

    kind: str
    name: str
    shape: tuple[int, ...]
    dtype: mx.Dtype


class _Run:
    """One run of a checkpointed function: forward (keeping) or recomputation (reusing)."""

    def __init__(self, record: Record, replay: bool):
        self.record, self.replay = record, replay
        self.counts: collections.Counter = collections.Counter()

    def offer(
        self,
        kind: str,
        where: object,
        name: str,
        value: mx.array,
        vjp_of: Callable[[], tuple[Callable, list[mx.array]]],
    ) -> mx.array:
        """``value``, or in a recomputation the one kept for the same place."""
        key = (kind, where, self.counts[(kind, where)])
        self.counts[(kind, where)] += 1
        if not self.replay:
            if self.record.keeps(Saveable(kind, name, tuple(value.shape), value.dtype)):
                self.record.values[key] = value
            return value
        kept = self.record.values.get(key)
        if kept is None:
            return value
        fn, primals = vjp_of()
        return _reused(kept, fn, primals)


class Record:
    """The values one checkpointed call keeps, by the ``policy`` (``None`` keeps nothing)."""

    def __init__(self, policy: Callable[[Saveable], bool] | None):
        self.policy = policy
        self.values: dict[tuple, mx.array] = {}

    def keeps(self, value: Saveable) -> bool:
        return self.policy is not None and bool(self.policy(value))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Keep the values the policy accepts while the function runs forward inside."""
        with _running(_Run(self, replay=False)):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Reuse the kept values while the function is recomputed inside."""
        with _running(_Run(self, replay=True)):
            yield


_active: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("nuvec_mlx_saving", default=None)


@contextlib.contextmanager
def _running(run: _Run) -> Iterator[None]:
    token = _active.set(run)
    try:
        yield
    finally:
        _active.reset(token)


def _reused(kept: mx.array, fn: Callable, primals: list[mx.array]) -> mx.array:
    """``kept`` in the place of ``fn(*primals)``, with the vjp of ``fn`` at ``primals``.

    Forward mode and batching (``mx.jvp``, ``mx.vmap`` of a gradient) see
    ``fn`` itself: they recompute the value, exactly.
    """
    reuse = mx.custom_function(lambda *_: kept)

    @reuse.vjp
    def vjp(ps: Any, cotangent: mx.array, _output: Any) -> Any:
        ps = _listed(ps)
        grads = mx.vjp(fn, ps, [cotangent])[1]
        return grads[0] if len(ps) == 1 else tuple(grads)

    @reuse.jvp
    def jvp(ps: Any, tangents: Any) -> mx.array:
        ps = _listed(ps)
        tangents = [mx.zeros_like(p) if t is None else t for p, t in zip(ps, _listed(tangents))]
        return mx.jvp(fn, ps, tangents)[1][0]

    @reuse.vmap
    def vmap(inputs: Any, axes: Any) -> tuple[mx.array, int]:
        return mx.vmap(fn, in_axes=tuple(_listed(axes)))(*_listed(inputs)), 0

    # mx.custom_function's __call__ is typed object; it returns what its function returns: kept.
    return cast(mx.array, reuse(*primals))


def _listed(values: Any) -> list:
    """A custom function's arguments as a list (one argument comes alone)."""
    return list(values) if isinstance(values, (list, tuple)) else [values]


def offer_name(x: mx.array, name: str) -> mx.array:
    """``x``, offered to the running checkpoint's policy under ``name``."""
    run = _active.get()
    if run is None:
        return x
    return run.offer(NAME, name, name, x, lambda: (lambda v: v, [x]))


def offering_calls(fn: Callable, name: str) -> Callable:
    """``fn``, whose output arrays are offered to the running checkpoint's policy under ``name``.

    A kept output is reused with the vjp of ``fn`` at its array arguments
    (and the arrays of the modules it reaches), as a layer's output
    is: ``fn`` itself is built but never evaluated in the recomputation. A
    value named with :func:`offer_name` is instead the input of its own reuse,
    so what made it is still computed.
    """

    def offering(flat: Callable[[list[mx.array]], list[mx.array]]) -> Callable[[list[mx.array]], list[mx.array]]:
        def offered(xs: list[mx.array]) -> list[mx.array]:
            run, outs = _active.get(), flat(xs)
            assert run is not None  # call() below runs this only under a run

            def vjp_of(i: int) -> tuple[Callable, list[mx.array]]:
                return (lambda *ps: flat(list(ps))[i]), xs

            return [run.offer(NAME, name, name, out, functools.partial(vjp_of, i)) for i, out in enumerate(outs)]

        return offered

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _active.get() is None:
            return fn(*args, **kwargs)
        return _calls.call_flat(offering, fn, args, kwargs)

    return call


def _layer_call(cls: type) -> Callable:
    """``__call__`` of the class that offers ``cls``'s outputs as ``"matmul"`` values."""
    original = cls.__call__

    def __call__(self: nn.Module, x: mx.array) -> mx.array:
        run = _active.get()
        out = original(self, x)
        if run is None:
            return out
        names = [k for k, _ in _pytree.flatten(self.trainable_parameters())]

        def vjp_of() -> tuple[Callable, list[mx.array]]:
            params = [v for _, v in _pytree.flatten(self.trainable_parameters())]

            def op(x: mx.array, *ps: mx.array) -> mx.array:
                held = self.trainable_parameters()
                self.update(tree_unflatten(list(zip(names, ps))), strict=False)
                try:
                    return original(self, x)
                finally:
                    self.update(held, strict=False)

            return op, [x, *params]

        return run.offer(MATMUL, id(self), (_paths.get() or {}).get(id(self), ""), out, vjp_of)

    return __call__


@functools.cache
def _offering_class(cls: type) -> type:
    return type(
        cls.__name__,
        (cls,),
        {
            "__call__": _layer_call(cls),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_nuvec_offering": cls,
        },
    )


# The paths of the layers being intercepted, by id, for Saveable.name.
_paths: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar("nuvec_mlx_layer_paths", default=None)


@contextlib.contextmanager
def _layers_offering(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Inside, the ``nn.Linear``/``nn.QuantizedLinear`` layers under ``modules`` offer their outputs."""
    swapped, paths = [], dict(_paths.get() or {})
    for module in modules:
        for path, m in module.named_modules():
            if isinstance(m, LAYERS):
                paths.setdefault(id(m), path)
                if "_nuvec_offering" not in type(m).__dict__:
                    swapped.append((m, type(m)))
                    m.__class__ = _offering_class(type(m))
    token = _paths.set(paths)
    try:
        yield
    finally:
        _paths.reset(token)
        for m, cls in swapped:
            m.__class__ = cls


def intercepting(fn: Callable) -> Callable:
    """``fn``, with the layers of the modules it reaches offering their outputs while it runs:
    the modules among its arguments and those :func:`nuvec_mlx._capture.modules` finds."""
    reached = _capture.modules(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        given = [
            v
            for _, v in _pytree.flatten((list(args), kwargs), is_leaf=lambda v: isinstance(v, nn.Module))
            if isinstance(v, nn.Module)
        ]
        with _layers_offering([*given, *reached]):
            return fn(*args, **kwargs)

    return run


def unrecomputed(
    fn: Callable[[list[mx.array]], Sequence[mx.array]], is_constant: Callable[[mx.array], bool]
) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """A flat block that is staged like a checkpoint and recomputes nothing.

    Args:
        fn: the flat block.
        is_constant: whether an input needs no gradient (the enclosing
            gradient's constants), asked at each call.
    """

    @functools.wraps(fn)
    def staged(xs: Sequence[mx.array]) -> list[mx.array]:
        xs = _validate.check_array_list(xs, "xs")
        modules = _marks.held()
        wanted = [i for i, x in enumerate(xs) if _validate.is_differentiable(x) and not is_constant(x)]
        if wanted:
            enter = mx.custom_function(lambda *ps: list(ps))

            @enter.vjp
            def finish(_primals: Any, cotangents: Any, _outputs: Any) -> Any:
                cotangents = [cotangents] if isinstance(cotangents, mx.array) else list(cotangents)
                return tuple(_marks.finished(cotangents, _marks.BACKWARD, modules))

            # mx.custom_function's __call__ is typed object; enter returns its arguments as a list.
            xs = _pytree.substitute(xs, wanted, cast(list[mx.array], enter(*(xs[i] for i in wanted))))
        out = _validate.check_outputs(fn(xs), fn)
        return _marks.mark(out, _marks.FORWARD) if wanted else out

    return staged
