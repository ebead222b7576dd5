"""Run a call of pytrees through a transform of flat functions.

A flat function (``list[mx.array] -> list[mx.array]``) is what nuvec's core
transforms take. :func:`call_flat` turns ``fn(*args, **kwargs)`` into one: the
array leaves of the arguments (:func:`mlx.utils.tree_flatten`) and the
trainable parameters of some modules become the flat inputs, every other leaf
is static, and the outputs are rebuilt with their structure. While ``fn``
runs, the modules hold the flat inputs in place of their parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import _flat, _random, _validate

FlatTransform = Callable[[Callable[[list[mx.array]], list[mx.array]]], Callable]


def _rebuild(template: Any, leaves: list[Any]) -> Any:
    it = iter(leaves)
    return tree_map(lambda _: next(it), template)


def _swap_parameters(modules: list[nn.Module], values: list[list[tuple[str, mx.array]]]) -> list:
    """Give each module the named parameters in ``values``; return what they held."""
    held = [tree_flatten(m.trainable_parameters()) for m in modules]
    for m, named in zip(modules, values):
        m.update(tree_unflatten(named), strict=False)
    return held


def _array_leaves(out: Any, fn: Callable) -> list[mx.array]:
    leaves = [v for _, v in tree_flatten(out)]
    for j, v in enumerate(leaves):
        if not isinstance(v, mx.array):
            raise TypeError(
                f"checkpoint: fn ({_validate.name_of(fn)}) must return arrays or "
                f"nested lists/tuples/dicts of arrays; output leaf {j} is {type(v).__name__}"
            )
    return leaves


def call_flat(
    transform: FlatTransform, fn: Callable, args: tuple, kwargs: dict, modules: list[nn.Module]
) -> Any:
    """``fn(*args, **kwargs)`` computed by ``transform(flat)(inputs)``.

    Args:
        transform: takes a flat function and returns one with its values, for
            example :func:`nuvec_mlx.checkpoint_flat`.
        fn: the function of pytrees.
        args, kwargs: its arguments; array leaves become flat inputs.
        modules: whose trainable parameters become flat inputs too (after the
            arguments' arrays), so that they are differentiated.

    Returns:
        ``fn``'s output, rebuilt from the flat outputs.
    """
    leaves = [v for _, v in tree_flatten((list(args), kwargs))]
    positions = [i for i, v in enumerate(leaves) if isinstance(v, mx.array)]
    params = [tree_flatten(m.trainable_parameters()) for m in modules]
    sizes = [len(p) for p in params]
    template: list[Any] = []

    def flat(xs: list[mx.array]) -> list[mx.array]:
        a, kw = _rebuild((list(args), kwargs), _flat.substitute(leaves, positions, xs[: len(positions)]))
        values, start = [], len(positions)
        for p, n in zip(params, sizes):
            values.append([(name, x) for (name, _), x in zip(p, xs[start : start + n])])
            start += n
        held = _swap_parameters(modules, values)
        try:
            out = fn(*a, **kw)
        finally:
            _swap_parameters(modules, held)
        template[:] = [out]
        return _array_leaves(out, fn)

    xs = [leaves[i] for i in positions] + [v for p in params for _, v in p]
    out = transform(flat)(xs)  # runs flat, which records the output's structure
    return _rebuild(template[0], out)


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


def snapshot(tree: Any) -> Callable[[], None]:
    """Remember the arrays held in ``tree`` (the state a compiled step updates); the
    function returned puts them back in place (lists, dicts, modules, ``mx.random.state``).

    Example:
        >>> undo = snapshot([model.state, optimizer.state])
        >>> ...  # a step that updates them
        >>> undo()
    """
    held: list[mx.array] = []
    _visit(tree, lambda a: held.append(a) or a)

    def undo() -> None:
        it = iter(held)
        _visit(tree, lambda _: next(it))

    return undo
