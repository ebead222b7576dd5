"""Reroute one module instance: its ``__call__`` sees other functions under given global names.

A model's code calls library functions by global name: mlx-lm's attention
modules call ``scaled_dot_product_attention`` (``mlx_lm.models.base``'s, which
calls ``mx.fast.scaled_dot_product_attention``), its gated-delta modules
``gated_delta_update``. To compute such a call in chunks without copying the
model's code, and without replacing the function for the whole process (every
other module, thread and user of it would see the replacement), the one
instance asked for gets a subclass whose ``__call__`` is its class's own
``__call__`` with its globals seen through an overlay: the names given read the
replacements, every other name reads the module's globals as they are.

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


def names_read(cls: type) -> frozenset[str]:
    """The global and attribute names the code of ``cls``'s own ``__call__`` reads: where a route can apply."""
    code = getattr(cls.__call__, "__code__", None)
    return frozenset(code.co_names) if code is not None else frozenset()


def rerouted_class(cls: type, names: Mapping[str, Any]) -> type:
    """The cached subclass of ``cls`` whose ``__call__`` sees ``names`` among its globals."""
    key = (cls, tuple(sorted(names.items())))
    if key not in _classes:
        call = _rebound(cls.__call__, names)

        def __reduce_ex__(self: Any, protocol: int) -> tuple:
            # Pickled by reference to the original class, rerouted again on load.
            return (_rerouted_instance, key, *object.__reduce_ex__(self, protocol)[2:])

        attributes = {"__call__": call, "__reduce_ex__": __reduce_ex__, BASE: cls, NAMES: dict(names)}
        attributes.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
        _classes[key] = type(cls.__name__, (cls,), attributes)
    return _classes[key]


def _rerouted_instance(cls: type, names: tuple[tuple[str, Any], ...]) -> Any:
    """An empty rerouted instance of ``cls``, for pickle and copy to fill."""
    sub = rerouted_class(cls, dict(names))
    return cast(Any, sub).__new__(sub)
