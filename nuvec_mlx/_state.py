"""The state a compiled step updates: copied, remembered and put back in place.

A compiled step (:func:`mlx.core.compile` with ``inputs``/``outputs``) holds the
containers of its state (a model's dicts, an optimizer's, ``mx.random.state``)
and writes its results into them. :func:`snapshot` remembers what they hold and
puts it back (the ceiling's undo, a failed trace, the planner's trials);
:func:`copy_arrays` gives them copies of their arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from . import _random


def _visit(tree: Any, replace: Callable[[mx.array], mx.array]) -> None:
    """Replace the array leaves of the lists and dicts in ``tree`` in place, depth first."""
    if tree is mx.random.state:
        _random.set_key(replace(_random.key()))
        return
    if isinstance(tree, (list, dict)):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        for k, v in list(items):
            if isinstance(v, mx.array):
                tree[k] = replace(v)
            else:
                _visit(v, replace)
    elif isinstance(tree, tuple):
        for v in tree:
            _visit(v, replace)


def copy_arrays(tree: Any) -> int:
    """Replace the array leaves of ``tree`` (lists, dicts, modules) with copies, in place; the bytes copied.

    An array held twice is copied once and stays shared.

    Example:
        >>> copy_arrays(optimizer.state)  # the old arrays now belong to whoever else holds them
    """
    copies: dict[int, mx.array] = {}

    def copy(a: mx.array) -> mx.array:
        if id(a) not in copies:
            copies[id(a)] = mx.array(a)
        return copies[id(a)]

    _visit(tree, copy)
    mx.eval(list(copies.values()))
    return sum(a.nbytes for a in copies.values())


def _hold(tree: Any, held: list[tuple[Any, Any]]) -> None:
    """Append each list and dict in ``tree`` with a shallow copy of what it holds (and the random key).

    A function of the module, not a closure of :func:`snapshot`: a closure that calls itself is a
    reference cycle, which would keep what it holds alive until the garbage collector runs.
    """
    if tree is mx.random.state:
        held.append((tree, _random.key()))
        return
    if isinstance(tree, dict):
        held.append((tree, dict(tree)))
        children: Any = tree.values()
    elif isinstance(tree, list):
        held.append((tree, list(tree)))
        children = tree
    elif isinstance(tree, tuple):
        children = tree
    else:
        return
    for child in children:
        _hold(child, held)


def snapshot(tree: Any) -> Callable[[], None]:
    """Remember what the lists and dicts in ``tree`` hold (the state a compiled step updates); the
    function returned puts it back in place: the same containers, holding what they held, keys the
    step added removed (an optimizer's moments made by its first update), and ``mx.random.state``'s key.

    The containers themselves are kept, never replaced: a step compiled before (its inputs and
    outputs) holds them. Modules are dicts here (``model.state`` is the module itself).

    Example:
        >>> undo = snapshot([model.state, optimizer.state])
        >>> ...  # a step that updates them
        >>> undo()
    """
    held: list[tuple[Any, Any]] = []  # (container, what it held)
    _hold(tree, held)

    def undo() -> None:
        for container, contents in held:
            if container is mx.random.state:
                _random.set_key(contents)
            elif isinstance(container, dict):  # dict's own methods: nn.Module overrides update
                dict.clear(container)
                dict.update(container, contents)
            else:
                list.__setitem__(container, slice(None), contents)

    return undo
