"""Gradients of flat losses: positions (``argnums``) name what to differentiate.

Inputs that ``argnums`` does not name are constants, and checkpoints inside the
loss are told so (:func:`nuvec_mlx.checkpoint.constant_inputs`): they compute
no gradient for them, which keeps an input-only step at its FLOP floor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx

from . import _flat, _stages, _validate
from .checkpoint import constant_inputs

LossFn = Callable[[list[mx.array]], mx.array]


def value_and_grad_flat(
    loss: LossFn, argnums: int | Sequence[int]
) -> Callable[[Sequence[mx.array]], tuple[mx.array, list[mx.array]]]:
    """Return a function computing a loss and its gradients for some inputs.

    Args:
        loss: ``list[mx.array] -> mx.array`` returning a scalar.
        argnums: the positions in ``xs`` to differentiate, an int or a sequence.

    Returns:
        ``vg(xs) -> (value, grads)`` with one gradient for each entry of
        ``argnums``, in that order. Inputs not in ``argnums`` are constants, and
        checkpoints inside ``loss`` compute no gradient for them.

    Example:
        >>> vg = nv.value_and_grad_flat(lambda xs: (xs[0] * xs[1]).sum(), [1])
        >>> vg([mx.array(2.0), mx.array(3.0)])
        (array(6, dtype=float32), [array(2, dtype=float32)])
    """
    _validate.check_callable(loss, "loss")
    _validate.check_argnums(argnums, None)  # fail at construction, not at the first call

    def value_and_grad(xs: Sequence[mx.array]) -> tuple[mx.array, list[mx.array]]:
        xs = _validate.check_array_list(xs, "xs")
        idx = _validate.check_argnums(argnums, len(xs))
        for i in idx:
            if not _validate.is_differentiable(xs[i]):
                raise ValueError(
                    f"argnums selects xs[{i}] of dtype {xs[i].dtype}; "
                    "gradients need a floating-point input"
                )

        def selected_loss(*selected: mx.array) -> mx.array:
            full = _flat.substitute(xs, idx, selected)
            with constant_inputs([x for j, x in enumerate(full) if j not in idx]):
                return _validate.check_scalar(loss(full), loss)

        vg = mx.value_and_grad(selected_loss, argnums=list(range(len(idx))))
        with _stages.collecting() as stages:
            value, grads = vg(*(xs[i] for i in idx))
        # mx.value_and_grad returns a bare array for a single argnum.
        grads = [grads] if len(idx) == 1 else list(grads)
        _stages.hand_on(grads, stages)
        return value, grads

    return value_and_grad


def grad_flat(
    loss: LossFn, argnums: int | Sequence[int]
) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """Like :func:`value_and_grad_flat`, returning the gradients only.

    Example:
        >>> nv.grad_flat(lambda xs: (xs[0] ** 2).sum(), 0)([mx.array(3.0)])
        [array(6, dtype=float32)]
    """
    vg = value_and_grad_flat(loss, argnums)
    return lambda xs: vg(xs)[1]
