"""Pytrees: MLX's trees (:mod:`mlx.utils`) as the package reads them.

Small helpers over :func:`mlx.utils.tree_flatten` and friends: a module is a leaf
where a call's arguments are read (not the dict it also is), and ``flatten`` is
typed as the list it returns. A leaf module: it imports nothing from the package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_reduce

T = TypeVar("T")


def substitute(items: Sequence[T], positions: Sequence[int], values: Sequence[Any]) -> list[T]:
    """A copy of ``items`` with ``values`` put at ``positions``, in order.

    Example:
        >>> substitute(["a", "b", "c"], [0, 2], ["x", "z"])
        ['x', 'b', 'z']
    """
    result = list(items)
    for i, v in zip(positions, values, strict=True):
        result[i] = v
    return result


def is_module(value: Any) -> bool:
    return isinstance(value, nn.Module)


def arrays(tree: Any) -> list[mx.array]:
    """The arrays among ``tree``'s leaves (lists, tuples, dicts, modules' state), in order.

    :func:`mlx.utils.tree_reduce`, which builds no path strings: the registry of
    steps reads every array of a step's state on each call.
    """

    def add(found: list[mx.array], x: Any) -> list[mx.array]:
        if isinstance(x, mx.array):
            found.append(x)
        return found

    return tree_reduce(add, tree, [])


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    """:func:`mlx.utils.tree_flatten`: the ``(path, leaf)`` pairs of ``tree``, in order.

    The package calls it here, not directly: MLX annotates its return as
    ``list[tuple[str, Any]] | dict[str, Any]`` (a dict when one is passed as
    ``destination``), so a type checker reads ``for k, v in tree_flatten(t)`` as
    unpacking a dict's ``str`` keys. Given a list as ``destination`` (what it
    makes itself when given none), it fills that list, typed as the list it is.
    """
    pairs: list[tuple[str, Any]] = []
    tree_flatten(tree, is_leaf=is_leaf, destination=pairs)
    return pairs


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, a module being a leaf (not the dict it also is)."""
    return [v for _, v in flatten(tree, is_leaf=is_module)]


def signature(tree: Any) -> tuple:
    """What :func:`mlx.core.compile` traces a call of ``tree`` again for: its arrays' shapes and dtypes, its
    other leaves' values (by identity where they have no hash), and where they are in the tree.

    Example:
        >>> signature(([mx.zeros((2, 3))], {"train": True}))
        (('0.0', (2, 3), mlx.core.float32), ('1.train', <class 'bool'>, True))
    """
    out: list[tuple] = []
    for path, leaf in flatten(tree, is_leaf=is_module):
        if isinstance(leaf, mx.array):
            out.append((path, tuple(leaf.shape), leaf.dtype))
        else:
            try:
                hash(leaf)
                out.append((path, type(leaf), leaf))
            except TypeError:
                out.append((path, type(leaf), id(leaf)))
    return tuple(out)


def rebuild(template: Any, leaves: list[Any]) -> Any:
    it = iter(leaves)
    return tree_map(lambda _: next(it), template, is_leaf=is_module)
