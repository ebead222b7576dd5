"""Argument checks shared by the flat transforms: every message names the argument."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


def array_list(xs: object, name: str) -> list[mx.array]:
    """Return ``xs`` as a list of arrays, or raise a ``TypeError`` naming ``name``."""
    if isinstance(xs, mx.array) or not isinstance(xs, (list, tuple)):
        raise TypeError(
            f"{name} must be a list or tuple of mlx.core.array, got {type(xs).__name__}"
        )
    for i, x in enumerate(xs):
        if not isinstance(x, mx.array):
            raise TypeError(
                f"{name}[{i}] must be an mlx.core.array, got {type(x).__name__}"
            )
    return list(xs)


def outputs(out: object, fn: object) -> list[mx.array]:
    """Check that ``fn`` returned a list or tuple of arrays."""
    return array_list(out, f"the value returned by fn ({_name(fn)})")


def argnums(argnums: int | Sequence[int], n: int | None) -> list[int]:
    """Normalise ``argnums`` against ``n`` inputs: ints, in range, not repeated.

    With ``n=None`` (the number of inputs not yet known) only the types, the
    emptiness and the repeats of non-negative entries are checked.
    """
    items = [argnums] if isinstance(argnums, int) else argnums
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(
            f"argnums must be an int or a sequence of ints, got {type(argnums).__name__}"
        )
    if len(items) == 0:
        raise ValueError("argnums must name at least one input, got an empty sequence")
    result = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, int):
            raise TypeError(f"argnums must hold ints, got {type(a).__name__} ({a!r})")
    if n is None:
        non_negative = [a for a in items if a >= 0]
        if len(set(non_negative)) != len(non_negative):
            raise ValueError(f"argnums names an input more than once: {list(items)}")
        return list(items)
    if n == 0:
        raise ValueError(
            f"xs is empty, but argnums {list(items)} selects inputs to differentiate: "
            "pass at least one array in xs"
        )
    for a in items:
        if not -n <= a < n:
            raise ValueError(
                f"argnums entry {a} is out of range for {n} inputs (expected -{n} <= i < {n})"
            )
        i = a % n
        if i in result:
            raise ValueError(f"argnums names input {i} more than once: {list(items)}")
        result.append(i)
    return result


def is_differentiable(x: mx.array) -> bool:
    """Whether ``x`` has a floating-point dtype, the only kind MLX differentiates."""
    return mx.issubdtype(x.dtype, mx.inexact)


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def callable_(fn: object, name: str) -> None:
    """Raise a ``TypeError`` unless ``fn`` is callable."""
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")


def scalar(value: object, loss: object) -> mx.array:
    """Check that ``loss`` returned a scalar array."""
    if not isinstance(value, mx.array):
        raise TypeError(
            f"loss ({_name(loss)}) must return a scalar mlx.core.array, "
            f"got {type(value).__name__}"
        )
    if value.ndim != 0:
        raise ValueError(
            f"loss ({_name(loss)}) must return a scalar (shape ()), "
            f"got an array of shape {tuple(value.shape)}"
        )
    return value
