"""Run a call of pytrees through a transform of flat functions.

A flat function (``list[mx.array] -> list[mx.array]``) is what nuvec's core
transforms take. :func:`call_flat` turns ``fn(*args, **kwargs)`` into one: the
array leaves of the arguments (:func:`mlx.utils.tree_flatten`) and the arrays
of the modules involved become the flat inputs, every other leaf is static,
and the outputs are rebuilt with their structure.

Modules involved: those among the arguments (they reach ``fn`` as modules, not
as the dicts they also are) and those ``fn`` reaches (:mod:`nuvec_mlx._capture`).
Every array a module holds is a flat input, put in place (by position in the
module's own nesting, so dict keys such as ``"0"`` or ``"a.b"`` stay keys)
while ``fn`` runs; trainable parameters are differentiated, the others
(frozen parameters, running statistics, ``_``-named arrays) are constants.
Arrays that the first run of ``fn`` assigns to a module (a BatchNorm's running
statistics) stay there; later runs (the recomputation in the backward pass)
leave the modules as they found them.

Output leaves that are not arrays (``None``, ints, caches, any Python object)
pass through as the first run of ``fn`` returned them; every later run must
return equal ones.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_reduce

from . import _capture, _constants, _marks, _random, _validate

FlatTransform = Callable[[Callable[[list[mx.array]], list[mx.array]]], Callable]
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


def _is_module(value: Any) -> bool:
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
    return [v for _, v in flatten(tree, is_leaf=_is_module)]


def signature(tree: Any) -> tuple:
    """What :func:`mlx.core.compile` traces a call of ``tree`` again for: its arrays' shapes and dtypes, its
    other leaves' values (by identity where they have no hash), and where they are in the tree.

    Example:
        >>> signature(([mx.zeros((2, 3))], {"train": True}))
        (('0.0', (2, 3), mlx.core.float32), ('1.train', <class 'bool'>, True))
    """
    out: list[tuple] = []
    for path, leaf in flatten(tree, is_leaf=_is_module):
        if isinstance(leaf, mx.array):
            out.append((path, tuple(leaf.shape), leaf.dtype))
        else:
            try:
                hash(leaf)
                out.append((path, type(leaf), leaf))
            except TypeError:
                out.append((path, type(leaf), id(leaf)))
    return tuple(out)


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


def _arrays(module: nn.Module) -> dict:
    """Every array ``module`` holds, nested as in the module (its ``_``-named ones too)."""
    return module.filter_and_map(lambda m, k, v: isinstance(v, (dict, list, mx.array)))


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """``modules`` once each, without those inside another of them (their arrays are its)."""
    distinct: list[nn.Module] = []
    for m in modules:
        if not any(m is d for d in distinct):
            distinct.append(m)
    inner = {id(sub) for m in distinct for sub in m.modules() if sub is not m}
    return [m for m in distinct if id(m) not in inner]


class _Holding:
    """Modules holding given arrays while ``fn`` runs, and put back after."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules
        self.trees = [_arrays(m) for m in modules]
        trainable = {id(v) for m in modules for _, v in flatten(m.trainable_parameters())}
        self.arrays = [v for t in self.trees for _, v in flatten(t)]
        self.constants = [v for v in self.arrays if id(v) not in trainable]

    def run(self, values: list[mx.array], keep_updates: bool, call: Callable[[], Any]) -> Any:
        """``call()`` with the modules holding ``values``; with ``keep_updates``, arrays it
        assigned to the modules stay there, else the modules are left as they were."""
        it = iter(values)
        given = [tree_map(lambda _: next(it), t) for t in self.trees]
        held = [_arrays(m) for m in self.modules]
        for m, g in zip(self.modules, given):
            m.update(g, strict=False)
        try:
            out = call()
        except BaseException:
            keep_updates = False
            raise
        finally:
            for m, g, h in zip(self.modules, given, held):
                if keep_updates:
                    put_back = {id(v): old for (_, v), (_, old) in zip(flatten(g), flatten(h))}
                    h = tree_map(lambda now, put_back=put_back: put_back.get(id(now), now), _arrays(m))
                m.update(h, strict=False)
        return out


def call_flat(transform: FlatTransform, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` computed by ``transform(flat)(inputs)``.

    Args:
        transform: takes a flat function and returns one with its values, for
            example :func:`nuvec_mlx.checkpoint_flat`.
        fn: the function of pytrees.
        args, kwargs: its arguments; array leaves become flat inputs, modules
            reach ``fn`` as they are.

    Returns:
        ``fn``'s output, rebuilt from the flat outputs; its leaves that are not
        arrays are those of the first run.

    Raises:
        ValueError: a later run of ``fn`` returned other non-array leaves or
            another structure than the first.
    """
    found = leaves((list(args), kwargs))
    positions = [i for i, v in enumerate(found) if isinstance(v, mx.array)]
    holding = _Holding(_outermost([*(v for v in found if _is_module(v)), *_capture.modules(fn)]))
    first: list[Any] = []  # the first run's output (its structure and non-array leaves)

    def flat(xs: list[mx.array]) -> list[mx.array]:
        a, kw = _rebuild((list(args), kwargs), substitute(found, positions, xs[: len(positions)]))
        out = holding.run(xs[len(positions) :], not first, lambda: fn(*a, **kw))
        if not first:
            first.append(out)
        elif not _equal(_skeleton(out), _skeleton(first[0])):
            raise ValueError(
                f"checkpoint: fn ({_validate.name_of(fn)}) returned "
                f"{reprlib.repr(_skeleton(out))} when recomputed in the backward pass, but "
                f"{reprlib.repr(_skeleton(first[0]))} in the forward pass; its outputs that are "
                "not arrays must be equal (==) each time fn runs"
            )
        return [v for v in leaves(out) if isinstance(v, mx.array)]

    flat.__name__ = flat.__qualname__ = _validate.name_of(fn)  # for messages about fn
    xs = [found[i] for i in positions] + holding.arrays
    with _constants.constant_inputs(holding.constants, add=True), _marks.holding(holding.modules):
        out = transform(flat)(xs)  # runs flat, which records the output's structure
    arrays = iter(out)
    return tree_map(lambda v: next(arrays) if isinstance(v, mx.array) else v, first[0], is_leaf=_is_module)


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
