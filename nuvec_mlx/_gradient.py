"""Whether nuvec is building a first-order gradient: what lets a chunked loss skip its recomputation.

A chunked function whose one output is a summed scalar (a loss head in chunks,
:func:`nuvec_mlx.losses.cross_entropy`) can take each chunk's gradient in the
forward pass, with the chunk's value, and leave the backward pass only to
scale those gradients by the loss's cotangent: the same peak as recomputing the
chunk in the backward pass, without the recomputation. That pays only where a
gradient is then taken, and holds only for a first derivative. nuvec's
gradients (:func:`nuvec_mlx.value_and_grad`, :func:`nuvec_mlx.value_and_grad_flat`
and the steps built on them) say so while they build theirs; a checkpoint's
forward pass, whose values its backward pass recomputes, says the opposite.
Elsewhere (``mx.grad``, ``nn.value_and_grad``, a loss evaluated alone) the
chunks are recomputed in the backward pass, if there is one.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_building: contextvars.ContextVar[bool] = contextvars.ContextVar("nuvec_mlx_building_gradient", default=False)


@contextlib.contextmanager
def building(on: bool = True) -> Iterator[None]:
    """Inside, a first-order gradient of what runs is (``on``) or is not being built by nuvec."""
    token = _building.set(on)
    try:
        yield
    finally:
        _building.reset(token)


def active() -> bool:
    """Whether the code running is the forward pass of a first-order gradient nuvec builds."""
    return _building.get()
