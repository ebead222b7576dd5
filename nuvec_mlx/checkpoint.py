"""A gradient checkpoint that keeps its saving when the whole step is compiled.

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
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx

from . import _validate

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


def _key_list() -> list:
    """The calling thread's random-state list, whose only item is the current key.

    ``mx.random.state`` is a read-only view of it in MLX 0.32; its iterator is
    the one public handle that reaches the list itself.
    """
    state = iter(mx.random.state).__reduce__()[1][0]
    if not isinstance(state, list) or len(state) != 1:
        raise RuntimeError("nuvec_mlx cannot reach mx.random.state's key in this MLX version")
    return state


@contextlib.contextmanager
def _random_key(key: mx.array) -> Iterator[None]:
    """Draw random numbers from ``key`` inside, and leave the global state as it was."""
    state = _key_list()
    saved = state[0]
    state[0] = key
    try:
        yield
    finally:
        state[0] = saved


def _signature(arrays: Sequence[mx.array]) -> list[tuple[tuple[int, ...], mx.Dtype]]:
    return [(tuple(a.shape), a.dtype) for a in arrays]


def checkpoint_flat(fn: FlatFn) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """Checkpoint a flat function: same values and gradients, less memory.

    The forward pass keeps only the inputs of ``fn``; its activations are
    recomputed in the backward pass, when the cotangents of its outputs exist.
    Integer and bool inputs are passed through undifferentiated. Random draws
    (``mx.random``) are repeated identically on recomputation.

    Args:
        fn: ``list[mx.array] -> list[mx.array]``, a pure function of its inputs
            (arrays it captures by closure are constants to it).

    Returns:
        A flat function with the values and gradients of ``fn``.

    Example:
        >>> block = nv.checkpoint_flat(lambda xs: [mx.tanh(xs[0] @ xs[1])])
        >>> h = block([x, w])[0]
    """
    _validate.callable_(fn, "fn")

    @functools.wraps(fn)
    def checkpointed(xs: Sequence[mx.array]) -> list[mx.array]:
        xs = _validate.array_list(xs, "xs")
        diff = [i for i, x in enumerate(xs) if _validate.is_differentiable(x)]
        constants = _constants.get()
        # Positions (within diff) of the primals whose gradients are wanted.
        wanted = [
            k for k, i in enumerate(diff) if not any(xs[i] is c for c in constants)
        ]
        key = mx.random.state[0]
        forward_signature = []

        def run(primals: Sequence[mx.array]) -> list[mx.array]:
            full = list(xs)
            for i, p in zip(diff, primals):
                full[i] = p
            return _validate.outputs(fn(full), fn)

        def forward(*primals: mx.array) -> list[mx.array]:
            out = run(primals)
            forward_signature[:] = _signature(out)
            return out

        def recompute(*primals: mx.array) -> list[mx.array]:
            with _random_key(key):
                out = run(primals)
            if _signature(out) != forward_signature:
                raise ValueError(
                    f"checkpoint_flat: fn ({_validate._name(fn)}) returned outputs "
                    f"{_signature(out)} when recomputed in the backward pass, but "
                    f"{forward_signature} in the forward pass; fn must return the "
                    "same number, shapes and dtypes of outputs every time"
                )
            return out

        block = mx.custom_function(forward)

        @block.vjp
        def backward(primals, cotangents, outputs):
            primals = [primals] if isinstance(primals, mx.array) else list(primals)
            cotangents = list(cotangents)
            primals = mx.depends(primals, cotangents)
            grads = list(mx.vjp(recompute, primals, cotangents)[1])
            if len(wanted) > 1:
                chained = mx.depends([grads[k] for k in wanted], [grads[k] for k in wanted])
                for k, g in zip(wanted, chained):
                    grads[k] = g
            return grads

        if not diff:
            return run([])
        return list(block(*(xs[i] for i in diff)))

    return checkpointed
