"""Gradients that keep the stages of the checkpoints they pass through.

:func:`value_and_grad` is :func:`mlx.nn.value_and_grad` (a model's trainable
parameters); :func:`value_and_grad_flat` differentiates a flat loss by
position (``argnums``). Both collect the stages that checkpoints mark while
the backward pass is built and register them with the gradients, so that
:func:`nuvec_mlx.eval` evaluates the backward pass one block at a time (also
eagerly); inside a compiled step they hand them to the step instead.

Inputs that ``argnums`` does not name are constants, and checkpoints inside the
loss are told so (:mod:`nuvec_mlx._constants`): they compute
no gradient for them, which keeps an input-only step at its FLOP floor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import _constants, _gradient, _marks, _pytree, _registry, _validate

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
                    f"argnums selects xs[{i}] of dtype {xs[i].dtype}; gradients need a floating-point input"
                )

        def selected_loss(*selected: mx.array) -> mx.array:
            full = _pytree.substitute(xs, idx, selected)
            with _constants.constant_inputs([x for j, x in enumerate(full) if j not in idx]):
                return _validate.check_scalar(loss(full), loss)

        vg = mx.value_and_grad(selected_loss, argnums=list(range(len(idx))))
        with _marks.collecting() as stages, _gradient.building():
            value, grads = vg(*(xs[i] for i in idx))
        # mx.value_and_grad returns a bare array for a single argnum.
        grads = [grads] if len(idx) == 1 else list(grads)
        _registry.hand_on([value, *grads], stages)
        return value, grads

    return value_and_grad


def grad_flat(loss: LossFn, argnums: int | Sequence[int]) -> Callable[[Sequence[mx.array]], list[mx.array]]:
    """Like :func:`value_and_grad_flat`, returning the gradients only.

    Example:
        >>> nv.grad_flat(lambda xs: (xs[0] ** 2).sum(), 0)([mx.array(3.0)])
        [array(6, dtype=float32)]
    """
    vg = value_and_grad_flat(loss, argnums)
    return lambda xs: vg(xs)[1]


def value_and_grad(model: nn.Module, fn: Callable) -> Callable[..., tuple[Any, Any]]:
    """:func:`mlx.nn.value_and_grad`, keeping the stages of the checkpoints inside.

    Args:
        model: the module whose trainable parameters are differentiated.
        fn: the scalar function, called with the arguments given to the result.

    Returns:
        ``vg(*args, **kwargs) -> (value, grads)``, as :func:`mlx.nn.value_and_grad`.

    Example:
        >>> nv.checkpoint_layers(model)
        >>> loss, grads = nv.value_and_grad(model, loss_fn)(model, x, y)
        >>> nv.eval(loss, grads)  # the backward pass one block at a time
    """
    _validate.check_module(model, "model")
    _validate.check_callable(fn, "fn")

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        value = fn(*args, **kwargs)
        # As nn.value_and_grad takes it: the loss, or a tuple or list whose first item is the loss.
        _validate.check_scalar(value[0] if isinstance(value, (tuple, list)) and value else value, fn)
        return value

    vg = nn.value_and_grad(model, checked)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        with _marks.collecting() as stages, _gradient.building():
            value, grads = vg(*args, **kwargs)
        # Registered with the value too: an eager step that hands the gradients to
        # an optimizer is evaluated through its loss and the updated state.
        _registry.hand_on(_pytree.arrays([value, grads]), stages)
        return value, grads

    return wrapped
