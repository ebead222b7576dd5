"""The modules a function reaches besides its arguments.

A checkpoint recomputes ``fn`` from its inputs. Modules that ``fn`` uses
without receiving them (a closure over a model, a bound method's ``self``)
should be recomputed from the checkpoint's inputs too, or their parameters'
derivatives flow through the forward's graph, which then stays alive until
the backward pass (correct, but no memory saved). So the modules ``fn``
reaches are found here, and their arrays made inputs of the checkpoint.

Followed, from ``fn``: ``fn`` itself (a module, or a callable object's
``__call__``), a bound method's ``self`` and function, a
``functools.partial``'s function, arguments and keywords; a function's
closure cells, default values (positional and keyword-only) and the globals
its code loads (also in the lambdas and comprehensions it defines); and, from
every object reached so, the items of lists, tuples, dicts and sets, the
attributes of plain objects (``__dict__`` and ``__slots__``) and the Python
attributes of modules, and the functions found (helper functions, followed
as ``fn`` is). Not followed: Python modules, classes and the methods on them,
builtins, objects of C types, arrays; and no more than :data:`LIMIT` objects.
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

#: The most objects one search visits.
LIMIT = 10_000

_OPAQUE = (
    types.ModuleType,
    type,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    range,
    mx.array,
)


_LOADS_GLOBAL = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS")


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names a code object and the code objects nested in it load.

    Only names loaded as globals: ``co_names`` also holds attribute names,
    and a global that happens to share one (``model`` and ``self.model``) is
    not reached.
    """
    names = [i.argval for i in dis.get_instructions(code) if i.opname in _LOADS_GLOBAL]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return tuple(dict.fromkeys(names))


def _function_parts(fn: types.FunctionType) -> Iterator[Any]:
    for cell in fn.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            pass
    yield from fn.__defaults__ or ()
    yield from (fn.__kwdefaults__ or {}).values()
    yield from (fn.__globals__[n] for n in _global_names(fn.__code__) if n in fn.__globals__)


def _parts(obj: Any) -> Iterator[Any]:
    """The objects one step from ``obj``."""
    if isinstance(obj, types.FunctionType):
        yield from _function_parts(obj)
    elif isinstance(obj, types.MethodType):
        yield from (obj.__self__, obj.__func__)
    elif isinstance(obj, functools.partial):
        yield from (obj.func, *obj.args, *obj.keywords.values())
    elif isinstance(obj, nn.Module):
        yield from vars(obj).values()  # its Python attributes; its arrays are its own
    elif isinstance(obj, dict):
        yield from obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    else:
        yield from getattr(obj, "__dict__", {}).values()
        for slot in getattr(type(obj), "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                yield getattr(obj, slot)


def modules(fn: Callable) -> list[nn.Module]:
    """The modules ``fn`` reaches, each once, in the order found.

    Example:
        >>> layers = [nn.Linear(2, 2)]
        >>> modules(lambda x: layers[0](x))
        [Linear(input_dims=2, output_dims=2, bias=True)]
    """
    found: list[nn.Module] = []
    seen: set[int] = set()
    stack: list[Any] = [fn]
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - the class's own function, not a callable test
    if isinstance(call, types.FunctionType):
        stack.append(call)  # a callable object's (or a module's) own code
    while stack and len(seen) < LIMIT:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found.append(obj)
        stack.extend(reversed(list(_parts(obj))))
    return found
