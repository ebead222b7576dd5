"""Argument checks: each ``check_*`` returns its value or raises naming the argument.

A wrong *type* raises ``TypeError``, a value of the right type that is out of
range raises ``ValueError``; every message names the argument and says what
was expected.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from . import _pytree

#: MLX's version, for messages. ``mlx.core`` has ``__version__``; its type stub leaves it out.
MLX_VERSION: str = mx.__version__  # type: ignore[attr-defined]

T = TypeVar("T")


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep, contextlib.__file__, functools.__file__)


def warn(message: str, category: type[Warning]) -> None:
    """Warn at the user's line: the first caller outside nuvec_mlx (and the context managers and
    wrappers it calls through), however deep inside the package the warning is raised."""
    frame, level = sys._getframe(0), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def name_of(fn: object) -> str:
    """A readable name for a function in error messages."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def is_differentiable(x: mx.array) -> bool:
    """Whether ``x`` has a floating-point dtype, the only kind MLX differentiates."""
    return mx.issubdtype(x.dtype, mx.inexact)


def describe(value: object) -> str:
    """An array's shape, or another value's type, for messages."""
    return f"shape {tuple(value.shape)}" if isinstance(value, mx.array) else type(value).__name__


def check_callable(fn: T, name: str) -> T:
    """``fn`` if it is callable, else ``TypeError``."""
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    return fn


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is a bool, else ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_module(module: object, name: str) -> nn.Module:
    """``module`` if it is an ``mlx.nn.Module``, else ``TypeError``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{name} must be an mlx.nn.Module, got {type(module).__name__}")
    return module


def check_optimizer(optimizer: object, name: str, allow_none: bool = False) -> optim.Optimizer | None:
    """``optimizer`` if it is an ``mlx.optimizers.Optimizer`` (or, with ``allow_none``, ``None``), else raise."""
    if not (isinstance(optimizer, optim.Optimizer) or (allow_none and optimizer is None)):
        expected = "an mlx.optimizers.Optimizer or None" if allow_none else "an mlx.optimizers.Optimizer"
        raise TypeError(f"{name} must be {expected}, got {type(optimizer).__name__}")
    return optimizer


def check_gradients(gradients: object, model: nn.Module) -> None:
    """``gradients`` if they mirror trainable parameters of ``model`` (a subtree, same shapes), else raise."""
    if not isinstance(gradients, dict):
        raise TypeError(
            "gradients must be a dict of arrays mirroring model.trainable_parameters() (as nn.value_and_grad "
            f"returns them), got {type(gradients).__name__}"
        )
    params = dict(_pytree.flatten(model.trainable_parameters()))
    for name, g in _pytree.flatten(gradients):
        if name not in params:
            raise ValueError(f"gradients has {name!r}, which is not a trainable parameter of model")
        if not isinstance(g, mx.array) or g.shape != params[name].shape:
            raise ValueError(
                f"gradients[{name!r}] must be an array of shape {tuple(params[name].shape)} as the parameter, "
                f"got {describe(g)}"
            )


def check_path(path: object, name: str) -> Path:
    """``path`` as a :class:`pathlib.Path`, if it is a str or an ``os.PathLike``."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or an os.PathLike, got {type(path).__name__}")
    return Path(path)


def check_str(value: object, name: str) -> str:
    """``value`` if it is a str, else ``TypeError``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def check_int(value: object, name: str, minimum: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_nbytes(nbytes: object, name: str) -> float:
    """``nbytes`` if it is a number of bytes: an int >= 0, or ``math.inf``."""
    if nbytes == math.inf and isinstance(nbytes, float):
        return nbytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"{name} must be an int number of bytes or math.inf, got {type(nbytes).__name__} ({nbytes!r})")
    if nbytes < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {nbytes}")
    return nbytes


def check_array_list(xs: object, name: str) -> list[mx.array]:
    """``xs`` as a list, if it is a list or tuple of arrays."""
    if isinstance(xs, mx.array) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of mlx.core.array, got {type(xs).__name__}")
    for i, x in enumerate(xs):
        if not isinstance(x, mx.array):
            raise TypeError(f"{name}[{i}] must be an mlx.core.array, got {type(x).__name__}")
    return list(xs)


def check_outputs(out: object, fn: object) -> list[mx.array]:
    """What a flat ``fn`` returned, if it is a list or tuple of arrays."""
    return check_array_list(out, f"the value returned by fn ({name_of(fn)})")


def check_scalar(value: object, loss: object) -> mx.array:
    """What ``loss`` returned, if it is a scalar array."""
    if not isinstance(value, mx.array):
        raise TypeError(f"loss ({name_of(loss)}) must return a scalar mlx.core.array, got {type(value).__name__}")
    if value.ndim != 0:
        raise ValueError(
            f"loss ({name_of(loss)}) must return a scalar (shape ()), got an array of shape {tuple(value.shape)}"
        )
    return value


def check_argnums(argnums: object, n: int | None) -> list[int]:
    """``argnums`` normalised against ``n`` inputs: ints, in range, not repeated.

    With ``n=None`` (the number of inputs not yet known) only the types, the
    emptiness and the repeats of non-negative entries are checked.
    """
    items = [argnums] if isinstance(argnums, int) else argnums
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"argnums must be an int or a sequence of ints, got {type(argnums).__name__}")
    if len(items) == 0:
        raise ValueError("argnums must name at least one input, got an empty sequence")
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
            f"xs is empty, but argnums {list(items)} selects inputs to differentiate: pass at least one array in xs"
        )
    result: list[int] = []
    for a in items:
        if not -n <= a < n:
            raise ValueError(f"argnums entry {a} is out of range for {n} inputs (expected -{n} <= i < {n})")
        if a % n in result:
            raise ValueError(f"argnums names input {a % n} more than once: {list(items)}")
        result.append(a % n)
    return result
