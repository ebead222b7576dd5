"""Reroute one module instance: its calls see other functions under given global names.

A model's code calls library functions by global name: mlx-lm's attention
modules call ``scaled_dot_product_attention`` (``mlx_lm.models.base``'s, which
calls ``mx.fast.scaled_dot_product_attention``), its gated-delta modules
``gated_delta_update``. To compute such a call in chunks without copying the
model's code, and without replacing the function for the whole process (every
other module, thread and user of it would see the replacement), the one
instance asked for gets a subclass whose ``__call__`` (and the methods its
class defines, helpers ``__call__`` calls) is its class's own code with its
globals seen through an overlay: the names given read the replacements, every
other name the module's globals as they were when the subclass was made (a
copy: Python reads a function's globals from a plain dict, so a name the
module rebinds later is not seen by the rerouted code).

``mx`` itself can be among the names, as a :class:`Namespace` that replaces
some of its attributes (``mx.fast.scaled_dot_product_attention`` called
directly).

The subclass is cached per class and names, and pickles by reference to the
original class (:func:`_rerouted_instance`). :func:`nuvec_mlx.nn.reroute`
gives an instance such a class, its checkpoint (if any) wrapped around it.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, cast

#: The attribute a rerouted class keeps its base under.
BASE = "_nuvec_rerouted_from"
#: The attribute a rerouted class keeps its names under.
NAMES = "_nuvec_routes"

_classes: dict[tuple[type, tuple[tuple[str, Any], ...]], type] = {}


class Namespace:
    """``base`` (a module such as ``mlx.core``) with some attributes replaced: what a rerouted call sees.

    Example:
        >>> fast = Namespace(mx.fast, scaled_dot_product_attention=chunked)
        >>> Namespace(mx, fast=fast).fast.scaled_dot_product_attention is chunked
        True
    """

    def __init__(self, base: Any, **replaced: Any):
        self._base, self._replaced = base, replaced

    def __getattr__(self, name: str) -> Any:
        if name in self._replaced:
            return self._replaced[name]
        return getattr(self._base, name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and (self._base, self._replaced) == (other._base, other._replaced)

    def __hash__(self) -> int:
        return hash((id(self._base), tuple(sorted((k, id(v)) for k, v in self._replaced.items()))))


def _rebound(fn: Callable, names: Mapping[str, Any]) -> Callable:
    """``fn``'s code with its globals seen through ``names`` (a copy of the globals, the names on top)."""
    overlay = {**fn.__globals__, **names}
    new = types.FunctionType(fn.__code__, overlay, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(new, fn)
    return new


def _methods(cls: type) -> dict[str, types.FunctionType]:
    """The functions ``cls``'s calls run by their code: its ``__call__`` (its own or inherited) and the
    methods its own class body defines (a helper such as ``_ssm`` that ``__call__`` calls)."""
    found = {name: fn for name, fn in vars(cls).items() if isinstance(fn, types.FunctionType)}
    call = cls.__call__
    if isinstance(call, types.FunctionType):
        found.setdefault("__call__", call)
    return found


def names_read(cls: type) -> frozenset[str]:
    """The global and attribute names the code of ``cls``'s ``__call__`` and own methods reads: where a route
    can apply."""
    return frozenset(n for fn in _methods(cls).values() for n in fn.__code__.co_names)


def rerouted_class(cls: type, names: Mapping[str, Any]) -> type:
    """The cached subclass of ``cls`` whose ``__call__`` and own methods see ``names`` among their globals."""
    key = (cls, tuple(sorted(names.items())))
    if key not in _classes:

        def __reduce_ex__(self: Any, protocol: int) -> tuple:
            # Pickled by reference to the original class, rerouted again on load.
            return (_rerouted_instance, key, *object.__reduce_ex__(self, protocol)[2:])

        attributes: dict[str, Any] = {
            name: _rebound(fn, names) for name, fn in _methods(cls).items() if set(fn.__code__.co_names) & set(names)
        }
        attributes.update(__reduce_ex__=__reduce_ex__, __module__=cls.__module__, __qualname__=cls.__qualname__)
        attributes.update({BASE: cls, NAMES: dict(names)})
        _classes[key] = type(cls.__name__, (cls,), attributes)
    return _classes[key]


def _rerouted_instance(cls: type, names: tuple[tuple[str, Any], ...]) -> Any:
    """An empty rerouted instance of ``cls``, for pickle and copy to fill."""
    sub = rerouted_class(cls, dict(names))
    return cast(Any, sub).__new__(sub)
