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
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from . import _capture, _constants, _marks, _pytree, _validate

FlatTransform = Callable[[Callable[[list[mx.array]], list[mx.array]]], Callable]


class _Array:
    """Where an output held an array, in the skeleton of the output."""

    def __repr__(self) -> str:
        return "<array>"


_ARRAY = _Array()


def _skeleton(out: Any) -> Any:
    """``out`` with its arrays replaced by one marker: what must not change between runs."""
    return tree_map(lambda v: _ARRAY if isinstance(v, mx.array) else v, out, is_leaf=_pytree.is_module)


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
        trainable = {id(v) for m in modules for _, v in _pytree.flatten(m.trainable_parameters())}
        self.arrays = [v for t in self.trees for _, v in _pytree.flatten(t)]
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
                    put_back = {id(v): old for (_, v), (_, old) in zip(_pytree.flatten(g), _pytree.flatten(h))}
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
    leaves = _pytree.leaves((list(args), kwargs))
    positions = [i for i, v in enumerate(leaves) if isinstance(v, mx.array)]
    holding = _Holding(_outermost([*(v for v in leaves if _pytree.is_module(v)), *_capture.modules(fn)]))
    xs = [leaves[i] for i in positions] + holding.arrays
    # The call's other leaves, its arrays left out: flat is kept as long as a checkpoint's rules are, and
    # must not keep the arrays it is given (a segment's inner blocks' inputs are not kept).
    found = _pytree.substitute(leaves, positions, [None] * len(positions))
    template = _pytree.rebuild((list(args), kwargs), found)
    first: list[Any] = []  # the skeleton of the first run's output (its structure and non-array leaves)

    def flat(xs: list[mx.array]) -> list[mx.array]:
        a, kw = _pytree.rebuild(template, _pytree.substitute(found, positions, xs[: len(positions)]))
        out = holding.run(xs[len(positions) :], not first, lambda: fn(*a, **kw))
        if not first:
            first.append(_skeleton(out))
        elif not _equal(_skeleton(out), first[0]):
            raise ValueError(
                f"checkpoint: fn ({_validate.name_of(fn)}) returned "
                f"{reprlib.repr(_skeleton(out))} when recomputed in the backward pass, but "
                f"{reprlib.repr(first[0])} in the forward pass; its outputs that are "
                "not arrays must be equal (==) each time fn runs"
            )
        return [v for v in _pytree.leaves(out) if isinstance(v, mx.array)]

    flat.__name__ = flat.__qualname__ = _validate.name_of(fn)  # for messages about fn
    with _constants.constant_inputs(holding.constants, add=True), _marks.holding(holding.modules):
        out = transform(flat)(xs)  # runs flat, which records the output's structure
    arrays = iter(out)
    return tree_map(lambda v: next(arrays) if v is _ARRAY else v, first[0], is_leaf=_pytree.is_module)
