"""``nv.checkpoint``: checkpoint functions of pytrees (nested lists/tuples/dicts).

Built on :func:`nuvec_mlx.checkpoint_flat`: the arguments are flattened with
:func:`mlx.utils.tree_flatten`, array leaves become the flat inputs, every other
leaf is static (closed over), and the outputs are rebuilt with their structure.

Captured state (how it is detected, and the limits):

* ``nn.Module`` objects reached directly from ``fn`` (``fn`` itself, a bound
  method's ``self``, a closure cell, or a global name the code of ``fn``
  references) contribute their *trainable* parameters as extra primals, so
  their gradients are correct. Frozen parameters are constants.
* Floating-point ``mx.array`` values captured the same way (closure cell or
  referenced global) raise ``ValueError``: a checkpoint cannot substitute them,
  so their gradients would silently be zero. Pass them as arguments instead,
  or pass ``allow_captured=True`` to treat them as constants knowingly.
* Only ``fn``'s own closure and globals are inspected, not those of functions
  it calls nor attributes of other objects; state hidden there is a constant.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import _validate
from .checkpoint import checkpoint_flat


def _leaves(tree: Any) -> list[Any]:
    return [v for _, v in tree_flatten(tree)]


def _rebuild(template: Any, leaves: list[Any]) -> Any:
    it = iter(leaves)
    return tree_map(lambda _: next(it), template)


def _captured(fn: Callable) -> tuple[list[nn.Module], list[str]]:
    """Modules and floating arrays that ``fn`` reaches by closure or globals."""
    found: list[tuple[str, Any]] = []
    if isinstance(fn, nn.Module):
        found.append(("fn", fn))
    target = fn
    if isinstance(fn, functools.partial):
        target = fn.func
    self_ = getattr(target, "__self__", None)
    if self_ is not None:
        found.append(("self", self_))
        target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, getattr(target, "__closure__", None) or ()):
            try:
                found.append((f"closure variable {name!r}", cell.cell_contents))
            except ValueError:  # empty cell
                pass
        glob = getattr(target, "__globals__", {})
        for name in code.co_names:
            if name in glob:
                found.append((f"global {name!r}", glob[name]))
    modules: list[nn.Module] = []
    arrays: list[str] = []
    for where, value in found:
        if isinstance(value, nn.Module):
            if not any(value is m for m in modules):
                modules.append(value)
        elif isinstance(value, mx.array) and _validate.is_differentiable(value):
            arrays.append(where)
    return modules, arrays


def call_checkpointed(
    fn: Callable, args: tuple, kwargs: dict, modules: list[nn.Module]
) -> Any:
    """Call ``fn(*args, **kwargs)`` checkpointed, with the trainable parameters
    of ``modules`` as primals (swapped in while ``fn`` runs)."""
    arg_flat = tree_flatten((list(args), kwargs))
    arg_leaves = [v for _, v in arg_flat]
    pos = [i for i, v in enumerate(arg_leaves) if isinstance(v, mx.array)]
    params = [tree_flatten(m.trainable_parameters()) for m in modules]
    n_args = len(pos)
    out_template: list[Any] = []

    def flat(xs: list[mx.array]) -> list[mx.array]:
        leaves = list(arg_leaves)
        for i, x in zip(pos, xs[:n_args]):
            leaves[i] = x
        a, kw = _rebuild((list(args), kwargs), leaves)
        k = n_args
        saved = []
        for m, p in zip(modules, params):
            saved.append(tree_flatten(m.trainable_parameters()))
            m.update(tree_unflatten([(name, xs[k + j]) for j, (name, _) in enumerate(p)]),
                     strict=False)
            k += len(p)
        try:
            out = fn(*a, **kw)
        finally:
            for m, s in zip(modules, saved):
                m.update(tree_unflatten(s), strict=False)
        out_leaves = _leaves(out)
        for j, v in enumerate(out_leaves):
            if not isinstance(v, mx.array):
                raise TypeError(
                    f"checkpoint: fn ({_validate._name(fn)}) must return arrays or "
                    f"nested lists/tuples/dicts of arrays; output leaf {j} is "
                    f"{type(v).__name__}"
                )
        out_template[:] = [out]
        return out_leaves

    xs = [arg_leaves[i] for i in pos] + [v for p in params for _, v in p]
    out = checkpoint_flat(flat)(xs)
    return _rebuild(out_template[0], out)


def checkpoint(fn: Callable | None = None, *, allow_captured: bool = False) -> Callable:
    """Checkpoint a function of pytrees: same values and gradients, less memory.

    Usable as ``@nv.checkpoint`` or ``@nv.checkpoint(allow_captured=True)``.
    Positional and keyword arguments may be arrays or nested lists, tuples and
    dicts of arrays; non-array leaves are static. Integer and bool arrays are
    not differentiated. Random draws repeat identically on recomputation,
    eagerly and under compile (with ``mx.random.state`` as compile state).
    Modules ``fn`` captures contribute their trainable parameters as primals;
    captured floating arrays raise ``ValueError`` (see the module docstring).

    Args:
        fn: the function to checkpoint (may also be an ``nn.Module``).
        allow_captured: treat captured floating arrays as constants (zero
            gradient) instead of raising.

    Returns:
        A function with the signature, values and gradients of ``fn``.

    Example:
        >>> @nv.checkpoint
        ... def block(x, params, scale=2.0):
        ...     return {"h": mx.tanh(x @ params["w"]) * scale}
        >>> out = block(x, {"w": w})["h"]
    """
    if fn is None:
        return lambda f: checkpoint(f, allow_captured=allow_captured)
    _validate.callable_(fn, "fn")
    if not isinstance(allow_captured, bool):
        raise TypeError(f"allow_captured must be a bool, got {type(allow_captured).__name__}")
    modules, arrays = _captured(fn)
    if arrays and not allow_captured:
        raise ValueError(
            f"checkpoint: fn ({_validate._name(fn)}) captures floating-point "
            f"mx.array values ({', '.join(arrays)}); their gradients would silently "
            "be zero. Pass them as arguments, or use allow_captured=True to treat "
            "them as constants"
        )

    @functools.wraps(fn)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return call_checkpointed(fn, args, kwargs, modules)

    return checkpointed
