"""Checkpointing helpers for ``mlx.nn`` modules, built on :func:`nuvec_mlx.checkpoint_flat`.

``checkpoint_module`` works per instance: it swaps the instance's class for a
cached subclass whose ``__call__`` runs checkpointed (``type(m).__call__`` of
other instances is untouched), and swapping back undoes it. The subclass
pickles by reference to the original class, so a checkpointed model pickles
and loads checkpointed. Only ``__call__`` is wrapped: a module whose class
defines none is refused, and a model that calls a block some other way runs
it unchecked.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from . import _calls, _policies, _reroute, _validate, policies
from .checkpoint import Link, checkpoint_flat, linked
from .chunks import checkpoint_chunks

#: A module's chunk setting: tokens per chunk, or a rule ``(module, first argument) -> tokens or None``
#: (``None``: the call whole), asked at each call.
ChunkSize = int | Callable[[nn.Module, mx.array], int | None]

_subclasses: dict[tuple, type[nn.Module]] = {}
#: The attribute a checkpointed class keeps its settings under: (the class beneath, policy, chunk, link, lazy):
#: ``lazy`` is ``lazy_in_recompute`` of a module in chunks (:func:`checkpoint_module`).
_KEY = "_nuvec_checkpoint"
_segments = itertools.count()  # each call of checkpoint_layers with segments makes its own


def _checkpointed_class(
    cls: type[nn.Module],
    policy: policies.Policy | None = None,
    chunk: ChunkSize | None = None,
    link: Link | None = None,
    lazy: bool = True,
) -> type[nn.Module]:
    """The cached subclass of ``cls`` whose ``__call__`` runs checkpointed with ``policy``, or in chunks (whose
    forward pass a checkpoint's recomputation leaves to MLX where ``lazy``), or as a block of a segment
    (``link``)."""
    key = (cls, policy, chunk, link, lazy)
    if key not in _subclasses:
        transform = functools.partial(linked, policy=policy, captured="differentiate", link=link)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            # The class beneath's __call__, bound: self and what its code reaches are captured.
            body = cls.__call__.__get__(self)
            if chunk is not None:
                return _in_chunks(self, body, chunk, lazy, args, kwargs)
            return _calls.call_flat(transform, _policies.offering_layers(body, policy), args, kwargs)

        def __reduce_ex__(self, protocol: int) -> tuple:
            # Pickled by reference to the original class and the routes (the subclasses are
            # made at run time, pickle could not find them), and made again on load.
            original, routes, _ = _layers(self)
            made = (original, tuple(sorted(routes.items())), policy, chunk, link, lazy)
            return (_new_checkpointed, made, *object.__reduce_ex__(self, protocol)[2:])

        # type() with three arguments is typed as making a type; it makes a subclass of cls.
        _subclasses[key] = cast(
            type[nn.Module],
            type(
                cls.__name__,
                (cls,),
                {
                    "__call__": __call__,
                    "__reduce_ex__": __reduce_ex__,
                    _KEY: key,
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                },
            ),
        )
    return _subclasses[key]


def _layers(module: nn.Module) -> tuple[type[nn.Module], dict[str, Any], tuple | None]:
    """What ``module``'s class is made of: its own class, the names it is rerouted with
    (:mod:`nuvec_mlx._reroute`), and its checkpoint's settings (``None`` if it is not checkpointed)."""
    cls: type[nn.Module] = type(module)
    key = cls.__dict__.get(_KEY)
    beneath = key[0] if key is not None else cls
    routes = dict(beneath.__dict__.get(_reroute.NAMES, {}))
    return beneath.__dict__.get(_reroute.BASE, beneath), routes, key


def _assemble(module: nn.Module, routes: dict[str, Any], key: tuple | None) -> bool:
    """Give ``module`` the class made of its own class, ``routes`` and the checkpoint ``key`` (policy,
    chunk: ``None`` for none); whether its class changed."""
    original = _layers(module)[0]
    cls = _reroute.rerouted_class(original, routes) if routes else original
    new = _checkpointed_class(cls, *key[1:]) if key is not None else cls
    if type(module) is new:
        return False
    module.__class__ = new
    return True


def reroute(module: nn.Module, routes: dict[str, Any]) -> bool:
    """Make ``module``'s own ``__call__`` see ``routes`` among its globals (:mod:`nuvec_mlx._reroute`),
    its checkpoint kept; empty ``routes`` undoes it. Whether its class changed."""
    return _assemble(module, routes, _layers(module)[2])


@contextlib.contextmanager
def restoring(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Inside, the checkpointing and rerouting of ``modules`` may change; after, each runs as before."""
    classes = [type(m) for m in modules]
    try:
        yield
    finally:
        for m, cls in zip(modules, classes):
            m.__class__ = cls


def _in_chunks(
    module: nn.Module, call: Callable[..., Any], chunk: ChunkSize, lazy: bool, args: tuple, kwargs: dict
) -> Any:
    """``call(*args, **kwargs)`` checkpointed in chunks of ``chunk`` along axis 1 of its first argument and of
    the other positional arrays of its batch and tokens (:func:`_per_token`: a mixture of experts' routing),
    ``lazy`` as :func:`nuvec_mlx.checkpoint_chunks`'s ``lazy_in_recompute``; as it is, neither chunked nor
    checkpointed, where that is one chunk (checkpointed, a lone chunk holds more than the plain call) or where a
    rule says ``None``."""
    if not args or not isinstance(args[0], mx.array) or args[0].ndim < 2:
        raise ValueError(
            f"a module checkpointed in chunks ({_validate.name_of(call)}) splits its first positional "
            "argument along axis 1 (tokens of batch x tokens x features): it must be an array of 2 or more "
            f"dimensions, got {_validate.describe(args[0]) if args else 'no positional argument'}"
        )
    size = chunk if isinstance(chunk, int) else chunk(module, args[0])
    if size is None or args[0].shape[1] <= size:
        return call(*args, **kwargs)
    axes = [1, *(1 if _per_token(a, args[0]) else None for a in args[1:])]
    return checkpoint_chunks(call, size=size, in_axes=axes, lazy_in_recompute=lazy)(*args, **kwargs)


def _per_token(arg: Any, x: mx.array) -> bool:
    """Whether ``arg`` is an array of ``x``'s batch and tokens (its first two dimensions), split with it."""
    return isinstance(arg, mx.array) and arg.ndim >= 2 and arg.shape[:2] == x.shape[:2]


def _new_checkpointed(
    original: type[nn.Module],
    routes: tuple,
    policy: policies.Policy | None,
    chunk: ChunkSize | None,
    link: Link | None = None,
    lazy: bool = True,
) -> nn.Module:
    """An empty checkpointed instance of ``original`` rerouted with ``routes``, for pickle and copy to fill."""
    beneath = _reroute.rerouted_class(original, dict(routes)) if routes else original
    sub = _checkpointed_class(beneath, policy, chunk, link, lazy)
    return sub.__new__(sub)


def _check_has_call(module: nn.Module, name: str) -> nn.Module:
    """``module`` if its class defines ``__call__`` (what a checkpoint wraps), else ``TypeError``."""
    if not any("__call__" in vars(c) for c in type(module).__mro__ if c is not object):
        raise TypeError(
            f"{name} ({type(module).__name__}) has no __call__, so nothing calls it through a "
            "checkpoint; checkpoint the modules the model calls, or the function that uses it "
            "with nv.checkpoint"
        )
    return module


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` was wrapped by :func:`checkpoint_module`.

    Example:
        >>> nv.is_checkpointed(nv.checkpoint_module(nn.Linear(2, 2)))
        True
    """
    _validate.check_module(module, "module")
    return _layers(module)[2] is not None


def original_class(module: nn.Module) -> type[nn.Module]:
    """``module``'s class as it was before nuvec checkpointed or rerouted it."""
    return _layers(module)[0]


def routes(module: nn.Module) -> dict[str, Any]:
    """The global names ``module``'s ``__call__`` is rerouted with (:func:`reroute`; empty if none)."""
    return _layers(module)[1]


def checkpoint_module(
    module: nn.Module,
    enable: bool = True,
    policy: policies.Policy | None = None,
    chunk: int | None = None,
    lazy_in_recompute: bool = True,
) -> nn.Module:
    """Checkpoint one module instance (in place); ``enable=False`` undoes it.

    Its trainable parameters are primals of the checkpoint; frozen ones are
    constants (so LoRA adapters on frozen weights train as usual). A module
    checkpointed again with another policy takes the new one.

    With ``chunk``, the module is checkpointed in chunks of that many tokens
    (:func:`nuvec_mlx.checkpoint_chunks` along axis 1 of its first argument,
    batch x tokens x features, and of its other positional arrays with the
    same batch and tokens, such as the experts and weights a router chose
    for each token; the rest read whole): one chunk's intermediates are
    alive at a time, in its forward and its backward pass. This is for
    modules that treat tokens independently, such as a transformer block's
    MLP or a mixture of experts. Nested inside a
    checkpointed block it costs no computation where the block's backward
    pass does not read the module's output (an MLP's only joins the residual
    sum): the block's recomputation no longer needs the module's forward
    pass, which the chunks' recomputation replaces. There it bounds what the
    block's backward pass holds.
    An input of no more than ``chunk`` tokens runs the module as it is,
    neither chunked nor checkpointed (checkpointed as one chunk, it would
    hold more than the plain call).
    :func:`nuvec_mlx.chunk_layers` chunks each block's MLP so, by a rule.

    Args:
        module: an ``mlx.nn.Module`` instance.
        enable: wrap (True) or unwrap (False).
        policy: which forward values to keep rather than recompute
            (:mod:`nuvec_mlx.policies`; the outputs of its ``nn.Linear``
            layers, named values); ``None`` keeps none.
        chunk: ``None`` (the module whole), or the tokens per chunk (an int
            >= 1; ``policy`` must then be ``None``).
        lazy_in_recompute: with ``chunk``, inside a checkpointed block's
            recomputation, leave the chunks' forward pass to MLX (True: an
            MLP, whose output only joins the residual sum, is then not
            computed there), or make each chunk a stage (False: for a module
            whose output the block's backward pass reads, such as attention's
            projections, so that the recomputed chunks are computed one at
            a time and not all in one stage);
            :func:`nuvec_mlx.checkpoint_chunks`'s argument of that name.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: ``module``'s class defines no ``__call__``.
        ValueError: ``chunk`` with a ``policy``; or, when called, a module in
            chunks whose first positional argument is not an array of 2 or
            more dimensions.

    Example:
        >>> nv.checkpoint_module(model.layers[0])
        >>> nv.checkpoint_module(model.layers[1], policy=nv.policies.save_matmuls)
        >>> nv.checkpoint_module(model.layers[1].mlp, chunk=512)  # inside a checkpointed block
    """
    _validate.check_module(module, "module")
    _validate.check_bool(enable, "enable")
    policy = _policies.check_policy(policy)
    if chunk is not None:
        _validate.check_int(chunk, "chunk", minimum=1)
    _validate.check_bool(lazy_in_recompute, "lazy_in_recompute")
    return in_chunks(module, chunk, enable, policy, lazy_in_recompute)


def in_chunks(
    module: nn.Module,
    chunk: ChunkSize | None,
    enable: bool = True,
    policy: policies.Policy | None = None,
    lazy_in_recompute: bool = True,
) -> nn.Module:
    """:func:`checkpoint_module` of checked arguments, ``chunk`` also a rule (:data:`ChunkSize`)."""
    if chunk is not None and policy is not None:
        raise ValueError("chunk must be None with a policy: a policy keeps values of a whole module's forward pass")
    if enable:
        _check_has_call(module, "module")
    original, routes, _ = _layers(module)
    _assemble(module, routes, (original, policy, chunk, None, lazy_in_recompute) if enable else None)
    return module


def find_layers(model: nn.Module, layers: Any = None) -> list[nn.Module]:
    """The blocks ``layers`` names in ``model``, as :func:`checkpoint_layers` takes them.

    Args:
        model: the model.
        layers: ``None`` (``model.layers`` or ``model.model.layers``), a list of
            modules, or a predicate ``module -> bool`` over ``model``'s modules.

    Returns:
        The blocks, each checked to be an ``nn.Module``.
    """
    _validate.check_module(model, "model")
    return [_validate.check_module(b, f"layers[{i}]") for i, b in enumerate(_blocks(model, layers))]


def _blocks(model: nn.Module, layers: Any) -> list[nn.Module]:
    if layers is None:
        for owner in (model, getattr(model, "model", None)):
            found = getattr(owner, "layers", None)
            if isinstance(found, (list, tuple)):
                return list(found)
        raise ValueError(
            "layers=None expects model.layers or model.model.layers to be a list of "
            "modules; pass layers= explicitly (a list or a predicate)"
        )
    if callable(layers) and not isinstance(layers, nn.Module):
        return [m for _, m in model.named_modules()[::-1] if m is not model and layers(m)]
    if isinstance(layers, (list, tuple)):
        return list(layers)
    raise TypeError(f"layers must be None, a list of modules or a predicate, got {type(layers).__name__}")


def checkpoint_layers(
    model: nn.Module,
    layers: Any = None,
    every: int = 1,
    enable: bool = True,
    policy: policies.Policy | None = None,
    segment: int | str = 1,
) -> int:
    """Checkpoint (or, with ``enable=False``, un-checkpoint) a model's blocks.

    With ``segment=k``, each run of ``k`` consecutive blocks is a segment:
    only the input of its first block is kept between the forward and the
    backward pass, not every block's. When the backward pass reaches a
    segment, the inputs of its other blocks are recomputed from the first's
    (one block's forward pass at a time), and each block is then recomputed
    and differentiated as a checkpointed block is: the step keeps
    ``n / k`` blocks' inputs plus one segment's ``k``, and one more forward
    pass of the blocks in each segment but its last; ``k = sqrt(n)`` keeps
    the fewest (Chen et al., 2016). For sequences so long that the blocks'
    inputs are most of the step's peak. A block whose input is not the
    previous block's output as the model passes it on (a model that changes
    the hidden state between blocks) starts a segment of its own.

    Args:
        model: the model.
        layers: ``None`` (``model.layers`` or ``model.model.layers``), a list of
            modules, or a predicate ``module -> bool`` over ``model``'s modules.
        every: wrap every ``every``-th block (0, every, 2*every, ...).
        enable: wrap (True) or unwrap (False).
        policy: as for :func:`checkpoint_module`.
        segment: blocks per segment (an int >= 1; 1, the default, keeps every
            block's input), or ``"sqrt"`` for ``ceil(sqrt(n))``; more than 1
            needs ``every=1`` and no ``policy``.

    Returns:
        How many blocks were wrapped, took another policy, or were unwrapped:
        blocks whose ``__call__`` now runs checkpointed (or no longer does).

    Raises:
        TypeError: a block to wrap defines no ``__call__`` (nothing calls it
            through a checkpoint); nothing is wrapped then.

    Example:
        >>> nv.checkpoint_layers(model)               # every block
        >>> nv.checkpoint_layers(model, segment=4)    # every 4th block's input kept
        >>> nv.checkpoint_layers(model, enable=False)
    """
    _validate.check_module(model, "model")
    _validate.check_int(every, "every", minimum=1)
    _validate.check_bool(enable, "enable")
    policy = _policies.check_policy(policy)
    blocks = find_layers(model, layers)
    size = _segment_size(segment, len(blocks))
    if size > 1 and (every != 1 or policy is not None):
        given = f"every={every}" if every != 1 else "a policy"
        raise ValueError(
            f"segment must be 1 with {given}: a segment recomputes its blocks' inputs from its first block's, "
            f"every block checkpointed without a policy; got segment={segment!r}"
        )
    for i, block in enumerate(blocks):
        if enable and i % every == 0:
            _check_has_call(block, f"layers[{i}]")  # before any block is wrapped
    if size > 1 and enable:
        key = next(_segments)
        return sum(
            _assemble(b, routes(b), (original_class(b), None, None, (key, i % size), True))
            for i, b in enumerate(blocks)
        )
    count = 0
    for block in blocks[::every]:
        before = type(block)
        count += type(checkpoint_module(block, enable, policy)) is not before
    return count


def _segment_size(segment: object, n: int) -> int:
    """``segment`` as a number of blocks: an int >= 1, or ``"sqrt"`` of ``n`` blocks."""
    if segment == "sqrt":
        return max(1, math.ceil(math.sqrt(n)))
    if isinstance(segment, str):
        raise ValueError(f"segment must be 'sqrt' or an int, got {segment!r}")
    return _validate.check_int(segment, "segment", minimum=1)


def checkpoint_sequential(
    layers: Sequence[Callable],
    segments: int | str = "sqrt",
    policy: policies.Policy | None = None,
) -> Callable[[Any], Any]:
    """Run ``layers`` in sequence as ``segments`` checkpointed segments.

    Args:
        layers: modules (or functions) applied one after another.
        segments: number of segments, or ``"sqrt"`` for ceil(sqrt(len(layers)))
            (Chen et al. 2016).
        policy: as for :func:`checkpoint_module`.

    Returns:
        ``run(x) -> y`` equal to applying the layers in turn.

    Example:
        >>> run = nv.checkpoint_sequential(model.layers, "sqrt")
    """
    if isinstance(layers, nn.Sequential):
        layers = layers.layers
    if isinstance(layers, nn.Module) or not isinstance(layers, Sequence):
        raise TypeError(f"layers must be an nn.Sequential or a list or tuple of layers, got {type(layers).__name__}")
    layers = list(layers)
    if not layers:
        raise ValueError("layers must hold at least one layer, got none")
    for i, layer in enumerate(layers):
        _validate.check_callable(layer, f"layers[{i}]")
    n = len(layers)
    if segments == "sqrt":
        segments = math.ceil(math.sqrt(n))
    if isinstance(segments, str):
        raise ValueError(f"segments must be 'sqrt' or an int, got {segments!r}")
    _validate.check_int(segments, "segments", minimum=1)
    policy = _policies.check_policy(policy)
    if segments > n:
        raise ValueError(f"segments must be at most the {n} layers, got {segments}")
    size = math.ceil(n / segments)
    groups = [layers[i : i + size] for i in range(0, n, size)]
    transform = functools.partial(checkpoint_flat, policy=policy)

    def run(x: Any) -> Any:
        for group in groups:

            def seg(h: Any, group: list = group) -> Any:
                for layer in group:
                    h = layer(h)
                return h

            x = _calls.call_flat(transform, _policies.offering_layers(seg, policy), (x,), {})  # seg reaches its layers
        return x

    return run
