"""Run a call of pytrees through a transform of flat functions.

A flat function (``list[mx.array] -> list[mx.array]``) is what nuvec's core
transforms take. :func:`call_flat` turns ``fn(*args, **kwargs)`` into one: the
array leaves of the arguments (:func:`mlx.utils.tree_flatten`) and the
trainable parameters of some modules become the flat inputs, every other leaf
is static, and the outputs are rebuilt with their structure. Modules among the
arguments reach ``fn`` as themselves (not as dicts), and their parameters are
flat inputs too. While ``fn`` runs, the modules hold the flat inputs in place
of their parameters.

Output leaves that are not arrays (``None``, ints, caches, any Python object)
pass through as the first run of ``fn`` returned them; every later run (the
recomputation in the backward pass) must return equal ones.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import _flat, _random, _validate

FlatTransform = Callable[[Callable[[list[mx.array]], list[mx.array]]], Callable]


def _is_module(value: Any) -> bool:
    return isinstance(value, nn.Module)


def _leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``, a module being a leaf (not the dict it also is)."""
    return [v for _, v in tree_flatten(tree, is_leaf=_is_module)]


def _rebuild(template: Any, leaves: list[Any]) -> Any:
    it = iter(leaves)
    return tree_map(lambda _: next(it), template, is_leaf=_is_module)


class _Array:
    """Where an output held an array, in the skeleton of the output."""

    def __repr__(self) -> str:
        return "<array>"


_ARRAY = _Array()


def _skeleton(out: Any) -> Any:
    """``out`` with its arrays replaced by one marker: what must not change between runs."""
    return tree_map(lambda v: _ARRAY if isinstance(v, mx.array) else v, out, is_leaf=_is_module)


def _equal(a: Any, b: Any) -> bool:
    """Whether two skeletons are equal: same containers, leaves identical or ``==``."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # no answer (an object whose == returns an array) is not "equal"
        return False


def _swap_parameters(modules: list[nn.Module], values: list[list[tuple[str, mx.array]]]) -> list:
    """Give each module the named parameters in ``values``; return what they held."""
    held = [tree_flatten(m.trainable_parameters()) for m in modules]
    for m, named in zip(modules, values):
        m.update(tree_unflatten(named), strict=False)
    return held


def call_flat(
    transform: FlatTransform, fn: Callable, args: tuple, kwargs: dict, modules: list[nn.Module]
) -> Any:
    """``fn(*args, **kwargs)`` computed by ``transform(flat)(inputs)``.

    Args:
        transform: takes a flat function and returns one with its values, for
            example :func:`nuvec_mlx.checkpoint_flat`.
        fn: the function of pytrees.
        args, kwargs: its arguments; array leaves become flat inputs, modules
            reach ``fn`` as they are, their trainable parameters flat inputs.
        modules: other modules (captured by ``fn``) whose trainable parameters
            become flat inputs too (after the arguments' arrays), so that they
            are differentiated.

    Returns:
        ``fn``'s output, rebuilt from the flat outputs; its leaves that are not
        arrays are those of the first run.

    Raises:
        ValueError: a later run of ``fn`` returned other non-array leaves or
            another structure than the first.
    """
    leaves = _leaves((list(args), kwargs))
    positions = [i for i, v in enumerate(leaves) if isinstance(v, mx.array)]
    modules = _distinct([*(v for v in leaves if _is_module(v)), *modules])
    params = [tree_flatten(m.trainable_parameters()) for m in modules]
    sizes = [len(p) for p in params]
    first: list[Any] = []  # the first run's output (its structure and non-array leaves)

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
        if not first:
            first.append(out)
        elif not _equal(_skeleton(out), _skeleton(first[0])):
            raise ValueError(
                f"checkpoint: fn ({_validate.name_of(fn)}) returned "
                f"{reprlib.repr(_skeleton(out))} when recomputed in the backward pass, but "
                f"{reprlib.repr(_skeleton(first[0]))} in the forward pass; its outputs that are "
                "not arrays must be equal (==) each time fn runs"
            )
        return [v for v in _leaves(out) if isinstance(v, mx.array)]

    xs = [leaves[i] for i in positions] + [v for p in params for _, v in p]
    out = transform(flat)(xs)  # runs flat, which records the output's structure
    arrays = iter(out)
    return tree_map(lambda v: next(arrays) if isinstance(v, mx.array) else v, first[0], is_leaf=_is_module)


def _distinct(modules: list[nn.Module]) -> list[nn.Module]:
    """``modules`` without repeats (by identity), in order."""
    kept: list[nn.Module] = []
    for m in modules:
        if not any(m is k for k in kept):
            kept.append(m)
    return kept


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
