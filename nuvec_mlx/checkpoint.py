"""The checkpoint: a block's activations recomputed in the backward pass, also under compile.

:func:`mlx.core.checkpoint` recomputes a block from its inputs and forward
outputs, so the evaluator is free to run the recomputation long before the
backward pass reaches the block, and under :func:`mlx.core.compile` the
recomputation can cost more memory than it saves. Here the recomputation reads
its inputs through :func:`mlx.core.depends` on the block's *cotangents*: it
cannot start before the backward pass arrives, and compile's common
subexpression elimination cannot merge it with the forward pass. The gradients
a block returns also depend on one another (the "chain"), so that a block's
parameter gradients are finished before the cotangent moves on to the previous
block and its recomputed activations can be freed.

:func:`checkpoint_flat` is that mechanism for flat functions; :func:`checkpoint`
puts functions of pytrees, and the modules they capture, through it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from . import _capture, _flat, _pytree, _random, _saving, _stages, _validate, policies

FlatFn = Callable[[list[mx.array]], Sequence[mx.array]]

# Arrays that the enclosing flat gradient treats as constants: a checkpoint
# computes no gradient for them and leaves them out of the chain.
_constants: contextvars.ContextVar[tuple[mx.array, ...]] = contextvars.ContextVar(
    "nuvec_mlx_constants", default=()
)


@contextlib.contextmanager
def constant_inputs(arrays: Sequence[mx.array]) -> Iterator[None]:
    """Tell checkpoints traced inside this context that ``arrays`` need no gradient."""
    token = _constants.set(tuple(arrays))
    try:
        yield
    finally:
        _constants.reset(token)


def _signature(arrays: Sequence[mx.array]) -> list[tuple[tuple[int, ...], mx.Dtype]]:
    return [(tuple(a.shape), a.dtype) for a in arrays]


class _Call:
    """One call of a checkpointed ``fn``: its inputs, and the rules ``mx.custom_function`` runs."""

    def __init__(self, fn: FlatFn, xs: list[mx.array], policy: policies.Policy | None):
        self.fn, self.xs = fn, xs
        self.kept = _saving.Record(policy)  # forward values the recomputation reuses
        self.diff = [i for i, x in enumerate(xs) if _validate.is_differentiable(x)]
        constants = _constants.get()
        # Positions (within diff) of the primals whose gradients are wanted.
        self.wanted = [k for k, i in enumerate(self.diff) if not any(xs[i] is c for c in constants)]
        self.key = _random.key()  # the forward's draws, replayed by the recomputation
        self.replay_key = self.key
        self.signature: list = []
        self.empty = False  # fn returned no arrays: the custom function returns a stand-in

    def run(self, primals: Sequence[mx.array]) -> list[mx.array]:
        return _validate.check_outputs(self.fn(_flat.substitute(self.xs, self.diff, primals)), self.fn)

    def forward(self, *primals: mx.array) -> list[mx.array]:
        with self.kept.recording():
            out = self.run(primals)
        self.signature = _signature(out)
        if not out:  # mx.custom_function needs an output; nothing depends on this one
            self.empty = True
            return [mx.zeros(())]
        return _stages.mark(out, _stages.FORWARD)

    def recompute(self, *primals: mx.array) -> list[mx.array]:
        with _random.drawing_from(self.replay_key), self.kept.replaying():
            out = self.run(primals)
        if _signature(out) != self.signature:
            raise ValueError(
                f"checkpoint_flat: fn ({_validate.name_of(self.fn)}) returned outputs "
                f"{_signature(out)} when recomputed in the backward pass, but "
                f"{self.signature} in the forward pass; fn must return the same "
                "number, shapes and dtypes of outputs every time"
            )
        return out

    def backward(self, primals: Any, cotangents: Sequence[mx.array], outputs: Any) -> list[mx.array]:
        primals = [primals] if isinstance(primals, mx.array) else list(primals)
        if not self.wanted:  # every input a constant: nothing to recompute
            return [mx.zeros_like(p) for p in primals]
        # Read through the cotangents: the recomputation, its random draws
        # included, waits for the backward pass to reach this block.
        primals = mx.depends(primals, list(cotangents))
        self.replay_key = mx.depends([self.key], list(cotangents))[0]

        def recompute_wanted(*wanted: mx.array) -> list[mx.array]:
            return self.recompute(*_flat.substitute(primals, self.wanted, wanted))

        # Only the wanted gradients are computed (a constant's is never used).
        grads = mx.vjp(recompute_wanted, [primals[k] for k in self.wanted], list(cotangents))[1]
        grads = _stages.mark(_stages.chained(grads), _stages.BACKWARD)  # nv.eval waits here
        return _flat.substitute([mx.zeros_like(p) for p in primals], self.wanted, grads)


def checkpoint_flat(fn: FlatFn, policy: policies.Policy | None = None) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """Checkpoint a flat function: same values and gradients, less memory.

    The forward pass keeps only the inputs of ``fn``; its activations are
    recomputed in the backward pass, when the cotangents of its outputs exist.
    Integer and bool inputs are passed through undifferentiated. Random draws
    (``mx.random``) are repeated identically on recomputation.

    Args:
        fn: ``list[mx.array] -> list[mx.array]``, a pure function of its inputs
            (arrays it captures by closure are constants to it).
        policy: which forward values to keep rather than recompute
            (:mod:`nuvec_mlx.policies`); ``None`` keeps none. A flat function
            offers only the values it names with :func:`nuvec_mlx.checkpoint_name`.

    Returns:
        A flat function with the values and gradients of ``fn``.

    Example:
        >>> block = nv.checkpoint_flat(lambda xs: [mx.tanh(xs[0] @ xs[1])])
        >>> h = block([x, w])[0]
    """
    _validate.check_callable(fn, "fn")
    policy = policies.check_policy(policy)
    if policies.recomputes_nothing(policy):
        return _saving.unrecomputed(fn, _constants.get)

    @functools.wraps(fn)
    def checkpointed(xs: Sequence[mx.array]) -> list[mx.array]:
        call = _Call(fn, _validate.check_array_list(xs, "xs"), policy)
        if not call.diff:
            return call.run([])
        block = mx.custom_function(call.forward)
        block.vjp(call.backward)
        out = list(block(*(call.xs[i] for i in call.diff)))
        return [] if call.empty else out

    return checkpointed


def checkpoint(
    fn: Callable | None = None, *, allow_captured: bool = False, policy: policies.Policy | None = None
) -> Callable:
    """Checkpoint a function of pytrees: same values and gradients, less memory.

    Usable as ``@nv.checkpoint`` or ``@nv.checkpoint(allow_captured=True)``.
    Positional and keyword arguments may be arrays or nested lists, tuples and
    dicts of arrays; non-array leaves are static. Integer and bool arrays are
    not differentiated. Random draws repeat identically on recomputation,
    eagerly and under compile (with ``mx.random.state`` as compile state).

    Captured state: ``nn.Module`` objects that ``fn`` reaches directly (``fn``
    itself, a bound method's ``self``, a closure cell, or a global name the
    code of ``fn`` references) contribute their *trainable* parameters as
    primals, so their gradients are correct; frozen parameters are constants.
    Floating ``mx.array`` values captured the same way raise ``ValueError``
    (their gradients would silently be zero): pass them as arguments, or pass
    ``allow_captured=True`` to treat them as constants knowingly. Only
    ``fn``'s own closure and globals are inspected, not those of functions it
    calls nor attributes of other objects.

    Args:
        fn: the function to checkpoint (may also be an ``nn.Module``).
        allow_captured: treat captured floating arrays as constants (zero
            gradient) instead of raising.
        policy: which forward values to keep rather than recompute
            (:mod:`nuvec_mlx.policies`): the outputs of the ``nn.Linear`` layers
            of the modules ``fn`` captures, values named with
            :func:`nuvec_mlx.checkpoint_name`; ``None`` keeps none.

    Returns:
        A function with the signature, values and gradients of ``fn``.

    Example:
        >>> @nv.checkpoint
        ... def block(x, params, scale=2.0):
        ...     return {"h": mx.tanh(x @ params["w"]) * scale}
        >>> out = block(x, {"w": w})["h"]
    """
    _validate.check_bool(allow_captured, "allow_captured")
    policy = policies.check_policy(policy)
    if fn is None:
        return functools.partial(checkpoint, allow_captured=allow_captured, policy=policy)
    _validate.check_callable(fn, "fn")
    modules, arrays = _capture.captured(fn)
    if arrays and not allow_captured:
        raise ValueError(
            f"checkpoint: fn ({_validate.name_of(fn)}) captures floating-point "
            f"mx.array values ({', '.join(arrays)}); their gradients would silently "
            "be zero. Pass them as arguments, or use allow_captured=True to treat "
            "them as constants"
        )

    body = policies.offering_layers(fn, modules, policy)

    @functools.wraps(fn)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return _pytree.call_flat(functools.partial(checkpoint_flat, policy=policy), body, args, kwargs, modules)

    return checkpointed
