"""What a function reaches besides its arguments: modules and arrays it captures.

A checkpoint recomputes ``fn`` from its primals, so state that ``fn`` reads
from elsewhere is a constant to it. For an ``nn.Module`` that is wrong (its
parameters need gradients), so such modules are found here and their trainable
parameters made primals; a floating ``mx.array`` captured the same way would
silently get a zero gradient, so it is reported.

Looked at: ``fn`` itself when it is a module, a bound method's ``self``, the
function of a ``functools.partial``, and the closure cells and referenced
globals of ``fn``'s own code. Not looked at: functions ``fn`` calls, and
attributes of other objects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import _validate


def _reachable(fn: Callable) -> list[tuple[str, Any]]:
    """(where, value) for every object ``fn`` reaches directly."""
    found: list[tuple[str, Any]] = []
    if isinstance(fn, nn.Module):
        found.append(("fn", fn))
    target = fn.func if isinstance(fn, functools.partial) else fn
    owner = getattr(target, "__self__", None)
    if owner is not None:
        found.append(("self", owner))
        target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None)
    if code is None:
        return found
    for name, cell in zip(code.co_freevars, getattr(target, "__closure__", None) or ()):
        try:
            found.append((f"closure variable {name!r}", cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    scope = getattr(target, "__globals__", {})
    found += [(f"global {name!r}", scope[name]) for name in code.co_names if name in scope]
    return found


def captured(fn: Callable) -> tuple[list[nn.Module], list[str]]:
    """The modules ``fn`` captures (each once), and where it captures floating arrays."""
    modules: list[nn.Module] = []
    arrays: list[str] = []
    for where, value in _reachable(fn):
        if isinstance(value, nn.Module):
            if not any(value is m for m in modules):
                modules.append(value)
        elif isinstance(value, mx.array) and _validate.is_differentiable(value):
            arrays.append(where)
    return modules, arrays
