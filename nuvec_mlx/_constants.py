"""Inputs that need no gradient: what a checkpoint leaves out of its backward pass.

A checkpoint differentiates its floating-point inputs. Some need no gradient:
the inputs a flat gradient does not differentiate (``argnums`` leaves them
out, :mod:`nuvec_mlx.grad`), and the frozen parameters and other non-trainable
arrays of the modules a checkpoint runs (:mod:`nuvec_mlx._pytree`). Declared
here, they are neither differentiated nor chained, which keeps an input-only
step or a LoRA step at its FLOP floor.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import mlx.core as mx

_constants: contextvars.ContextVar[tuple[mx.array, ...]] = contextvars.ContextVar("nuvec_mlx_constants", default=())


@contextlib.contextmanager
def constant_inputs(arrays: Sequence[mx.array], add: bool = False) -> Iterator[None]:
    """Tell checkpoints traced inside that ``arrays`` need no gradient.

    Args:
        arrays: the arrays (by identity).
        add: keep those declared by enclosing contexts too; by default they
            are replaced (a nested gradient may differentiate what an outer one
            holds constant).
    """
    token = _constants.set((*_constants.get(), *arrays) if add else tuple(arrays))
    try:
        yield
    finally:
        _constants.reset(token)


def is_constant(x: mx.array) -> bool:
    """Whether ``x`` (this very array) was declared constant by an enclosing context."""
    return any(x is c for c in _constants.get())
