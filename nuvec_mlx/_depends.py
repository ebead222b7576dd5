"""Dependencies between arrays that every transform of MLX understands.

:func:`mlx.core.depends` makes arrays wait for others without copying them,
which is how a checkpoint orders its recomputation and how stages are marked.
But MLX 0.32's ``Depends`` has no ``vmap`` and no ``jvp`` rule, and
:func:`mlx.core.vmap` and :func:`mlx.core.jvp` transform every node of the
graphs they trace (also those inside custom functions): one ``Depends`` in a
gradient makes ``mx.vmap(mx.grad(f))`` (per-example gradients) and
``mx.jvp(mx.grad(f), ...)`` (Hessian-vector products) fail.

:func:`depends` is the same dependency as an :func:`mlx.core.custom_function`:
its outputs share the buffers of its inputs (no copy, like ``Depends``), its
node reads the dependencies, so they are computed first, and its rules pass
the inputs' cotangents, tangents and batch axes through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import mlx.core as mx


@mx.custom_function
def _depend(inputs: list[mx.array], dependencies: list[mx.array]) -> list[mx.array]:
    return list(inputs)


@_depend.vjp
def _depend_vjp(primals, cotangents, outputs):
    inputs, dependencies = primals
    return list(cotangents), [mx.zeros_like(d) for d in dependencies]


@_depend.jvp
def _depend_jvp(primals, tangents):
    inputs, _ = primals
    return [mx.zeros_like(x) if t is None else t for x, t in zip(inputs, tangents[0])]


@_depend.vmap
def _depend_vmap(args, axes):
    return batched(depends(*args), args, axes)


def batched(
    outputs: Sequence[mx.array], args: Sequence[Sequence[mx.array]], axes: Sequence[Sequence[int | None]]
) -> tuple[list[mx.array], list[int]]:
    """What a custom function's ``vmap`` rule returns for ``outputs`` that pass ``args[0]`` through: each
    batched as its input in ``args[0]``, and none unbatched: an unbatched one is broadcast along a new first
    axis of the batch's size (read from the first batched array of ``args``; a view, no copy).

    MLX 0.32's ``ExpandDims`` vmap rule misreads an unbatched input that a custom function's vmap rule
    returned (axis -1: ``x[..., None]`` on it raises ``[expand_dims] Axis ... is out of bounds``), and a
    chunked loss's integer targets are such an input under ``mx.vmap(mx.grad(...))``.
    """
    size = next(x.shape[a] for xs, xs_axes in zip(args, axes) for x, a in zip(xs, xs_axes) if a is not None)
    out = [x if a is not None else mx.broadcast_to(x[None], (size, *x.shape)) for x, a in zip(outputs, axes[0])]
    return out, [0 if a is None else a for a in axes[0]]


def depends(inputs: Sequence[mx.array], dependencies: Sequence[mx.array]) -> list[mx.array]:
    """``inputs``, computed only after ``dependencies``: :func:`mlx.core.depends` for every transform.

    Args:
        inputs: the arrays to return.
        dependencies: the arrays they must wait for.

    Returns:
        Arrays equal to ``inputs`` (sharing their buffers) whose evaluation
        evaluates ``dependencies`` first.

    Example:
        >>> x, = depends([x], cotangents)  # x is read only once the cotangents exist
    """
    if not inputs or not dependencies:
        return list(inputs)
    # mx.custom_function's __call__ is typed object; it returns what _depend returns, a list of arrays.
    return list(cast(list[mx.array], _depend(list(inputs), list(dependencies))))


def floating(arrays: Sequence[mx.array]) -> list[int]:
    """The positions of ``arrays`` with a floating-point dtype: the only ones a derivative flows through."""
    return [i for i, x in enumerate(arrays) if mx.issubdtype(x.dtype, mx.inexact)]


def depends_floating(inputs: Sequence[mx.array], dependencies: Sequence[mx.array]) -> list[mx.array]:
    """:func:`depends` for the floating-point ``inputs``; the others (integer indices) pass as they are.

    Read through a dependency, an integer array would be on a derivative's path, and MLX refuses a
    derivative with respect to indices (a gather's, a scatter's) in a jvp or a second derivative. It
    needs no ordering: it exists before the step, and what reads it reads floating inputs too.
    """
    out = list(inputs)
    positions = floating(inputs)
    for i, x in zip(positions, depends([inputs[i] for i in positions], dependencies)):
        out[i] = x
    return out


def jvp_floating(fn: Callable[..., Sequence[mx.array]], primals: Sequence[mx.array], tangents: Sequence) -> list:
    """The tangents of ``fn(*primals)`` for ``tangents`` (``None``: zero) of its floating-point primals only:
    :func:`mlx.core.jvp` over integer primals asks their gathers for a derivative with respect to indices."""
    positions = floating(primals)

    def of_floating(*xs: mx.array) -> Sequence[mx.array]:
        full = list(primals)
        for i, x in zip(positions, xs):
            full[i] = x
        return fn(*full)

    filled = [mx.zeros_like(primals[i]) if tangents[i] is None else tangents[i] for i in positions]
    return list(mx.jvp(of_floating, [primals[i] for i in positions], filled)[1])


@mx.custom_function
def _also_into(outputs: list[mx.array], graph: list[mx.array]) -> list[mx.array]:
    """``outputs``, whose cotangents also flow into ``graph``: the same values as the forward computed them.

    A checkpoint's rule differentiates fn with respect to its inputs only; an
    array fn read from anywhere else (a closure, a global, an attribute) that
    a transform differentiates would get nothing through it. The forward runs
    fn on stopped inputs, so its graph holds a derivative for exactly those
    arrays: passing the cotangents into it too adds their derivatives, by
    MLX's own rules, and nothing else. Where fn reads no such array, nothing
    in that graph needs a derivative and MLX's transforms skip it; where it
    does, that part of the forward's graph is kept for the backward pass, as
    without the checkpoint.
    """
    return list(outputs)


@_also_into.vjp
def _also_into_vjp(primals, cotangents, outputs):
    return list(cotangents), list(cotangents)


@_also_into.jvp
def _also_into_jvp(primals, tangents):
    outputs, _ = primals
    return [sum((t for t in pair if t is not None), mx.zeros_like(x)) for x, pair in zip(outputs, zip(*tangents))]


@_also_into.vmap
def _also_into_vmap(args, axes):
    return batched(args[0], args, axes)


def also_into(outputs: Sequence[mx.array], graph: Sequence[mx.array]) -> list[mx.array]:
    """``outputs`` (a checkpoint's), whose cotangents also flow into ``graph`` (its forward's outputs
    as the function computed them on stopped inputs): the derivatives of arrays the function read
    besides its inputs, by MLX's own rules; nothing where it read none."""
    # mx.custom_function's __call__ is typed object; it returns what _also_into returns, a list of arrays.
    return list(cast(list[mx.array], _also_into(list(outputs), list(graph))))


def first_order(message: str) -> Callable[[list[mx.array], list[mx.array]], object]:
    """An identity on ``arrays`` (gradients computed from ``inputs``, passed to be seen as its inputs) that
    refuses to be differentiated again: its vjp and jvp raise ``ValueError(message)``. For gradients a
    transform takes itself, in a forward pass or from states it treats as given, whose own derivative
    would silently be wrong."""

    @mx.custom_function
    def identity(arrays: list[mx.array], inputs: list[mx.array]) -> list[mx.array]:
        return list(arrays)

    @identity.vjp
    def refuse_vjp(primals: object, cotangents: object, outputs: object) -> object:
        raise ValueError(message)

    @identity.jvp
    def refuse_jvp(primals: object, tangents: object) -> object:
        raise ValueError(message)

    @identity.vmap
    def passed(inputs: list[list[mx.array]], axes: list[list[int | None]]) -> tuple[list[mx.array], list[int]]:
        return batched(inputs[0], inputs, axes)

    return identity
