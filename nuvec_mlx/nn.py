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
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from . import _attention, _calls, _policies, _validate, policies
from .checkpoint import checkpoint_flat
from .chunks import checkpoint_chunks

_subclasses: dict[tuple[type, Callable | None, int | str | None, int | None], type[nn.Module]] = {}

# Bumped whenever a module's checkpointing changes: a compiled step traced before runs its
# blocks as they were when traced, so nv.TrainingStep traces again when this moved.
_changes = 0


def changes() -> int:
    """How many times :func:`checkpoint_module` has changed how a module runs, in this process."""
    return _changes


def _checkpointed_class(
    cls: type[nn.Module],
    policy: policies.Policy | None = None,
    attention_chunk: int | str | None = "auto",
    chunk: int | None = None,
) -> type[nn.Module]:
    """The cached subclass of ``cls`` whose ``__call__`` runs checkpointed with ``policy``, or in chunks."""
    key = (cls, policy, attention_chunk, chunk)
    if key not in _subclasses:
        transform = functools.partial(checkpoint_flat, policy=policy, attention_chunk=attention_chunk)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            # The original __call__, bound: self and what its code reaches are captured.
            body = cls.__call__.__get__(self)
            if chunk is not None:
                return _in_chunks(body, chunk, args, kwargs)
            return _calls.call_flat(transform, _policies.offering_layers(body, policy), args, kwargs)

        def __reduce_ex__(self, protocol: int) -> tuple:
            # Pickled by reference to the original class (the subclass is made at
            # run time, pickle could not find it), and checkpointed again on load.
            return (_new_checkpointed, key, *object.__reduce_ex__(self, protocol)[2:])

        # type() with three arguments is typed as making a type; it makes a subclass of cls.
        _subclasses[key] = cast(
            type[nn.Module],
            type(
                cls.__name__,
                (cls,),
                {
                    "__call__": __call__,
                    "__reduce_ex__": __reduce_ex__,
                    "_nuvec_original_class": cls,
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                },
            ),
        )
    return _subclasses[key]


@contextlib.contextmanager
def restoring(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Inside, the checkpointing of ``modules`` may change; after, each runs as it did before."""
    global _changes
    classes = [type(m) for m in modules]
    try:
        yield
    finally:
        for m, cls in zip(modules, classes):
            if type(m) is not cls:
                m.__class__ = cls
                _changes += 1


def _in_chunks(call: Callable[..., Any], chunk: int, args: tuple, kwargs: dict) -> Any:
    """``call(*args, **kwargs)`` checkpointed in chunks of ``chunk`` along axis 1 of its first argument;
    as it is where that is one chunk (a lone chunk held more than the plain call: MLX 0.32, CPU)."""
    if not args or not isinstance(args[0], mx.array) or args[0].ndim < 2:
        raise ValueError(
            f"a module checkpointed in chunks ({_validate.name_of(call)}) splits its first positional "
            "argument along axis 1 (tokens of batch x tokens x features): it must be an array of 2 or more "
            f"dimensions, got {_validate.describe(args[0]) if args else 'no positional argument'}"
        )
    if args[0].shape[1] <= chunk:
        return call(*args, **kwargs)
    axes = [1, *[None] * (len(args) - 1)]
    return checkpoint_chunks(call, size=chunk, in_axes=axes, lazy_in_recompute=True)(*args, **kwargs)


def _new_checkpointed(
    cls: type[nn.Module],
    policy: policies.Policy | None = None,
    attention_chunk: int | str | None = "auto",
    chunk: int | None = None,
) -> nn.Module:
    """An empty checkpointed instance of ``cls``, for pickle and copy to fill."""
    sub = _checkpointed_class(cls, policy, attention_chunk, chunk)
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
    return "_nuvec_original_class" in type(module).__dict__


def checkpoint_module(
    module: nn.Module,
    enable: bool = True,
    policy: policies.Policy | None = None,
    attention_chunk: int | str | None = "auto",
    chunk: int | None = None,
) -> nn.Module:
    """Checkpoint one module instance (in place); ``enable=False`` undoes it.

    Its trainable parameters are primals of the checkpoint; frozen ones are
    constants (so LoRA adapters on frozen weights train as usual). A module
    checkpointed again with another policy takes the new one.

    With ``chunk``, the module is checkpointed in chunks of that many tokens
    (:func:`nuvec_mlx.checkpoint_chunks` along axis 1 of its first argument,
    batch x tokens x features): one chunk's intermediates are alive at a time,
    in its forward and its backward pass. This is for modules that treat
    tokens independently, such as a transformer block's MLP. Nested inside a
    checkpointed block it costs no computation: the block's recomputation no
    longer needs the module's forward pass, which the chunks' recomputation
    replaces. There it bounds what the block's backward pass holds, which is
    the peak of LoRA fine-tuning on long sequences, where mlx-lm's float32
    adapters keep float32 copies of the MLP's activations. An input of no
    more than ``chunk`` tokens runs the module as it is (one chunk, checkpointed,
    held more than the plain call: MLX 0.32, CPU).

    Args:
        module: an ``mlx.nn.Module`` instance.
        enable: wrap (True) or unwrap (False).
        policy: which forward values to keep rather than recompute
            (:mod:`nuvec_mlx.policies`; the outputs of its ``nn.Linear``
            layers, named values); ``None`` keeps none.
        attention_chunk: attention inside the module in query chunks
            (:func:`nuvec_mlx.checkpoint_flat`): ``"auto"`` where the backend
            trains attention unfused, a chunk size, or ``None``.
        chunk: ``None`` (the module whole), or the tokens per chunk (an int
            >= 1; ``policy`` must then be ``None``, ``attention_chunk`` is unused).

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
    attention_chunk = _attention.check(attention_chunk)
    if chunk is not None:
        _validate.check_int(chunk, "chunk", minimum=1)
        if policy is not None:
            raise ValueError("chunk must be None with a policy: a policy keeps values of a whole module's forward pass")
    global _changes
    cls = type(module).__dict__.get("_nuvec_original_class", type(module))
    if enable:
        _check_has_call(module, "module")
    new = _checkpointed_class(cls, policy, attention_chunk, chunk) if enable else cls
    if type(module) is not new:
        module.__class__ = new
        _changes += 1
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
    attention_chunk: int | str | None = "auto",
) -> int:
    """Checkpoint (or, with ``enable=False``, un-checkpoint) a model's blocks.

    Args:
        model: the model.
        layers: ``None`` (``model.layers`` or ``model.model.layers``), a list of
            modules, or a predicate ``module -> bool`` over ``model``'s modules.
        every: wrap every ``every``-th block (0, every, 2*every, ...).
        enable: wrap (True) or unwrap (False).
        policy, attention_chunk: as for :func:`checkpoint_module`.

    Returns:
        How many blocks were wrapped, took another policy, or were unwrapped:
        blocks whose ``__call__`` now runs checkpointed (or no longer does).

    Raises:
        TypeError: a block to wrap defines no ``__call__`` (nothing calls it
            through a checkpoint); nothing is wrapped then.

    Example:
        >>> nv.checkpoint_layers(model)            # every block
        >>> nv.checkpoint_layers(model, enable=False)
    """
    _validate.check_module(model, "model")
    _validate.check_int(every, "every", minimum=1)
    _validate.check_bool(enable, "enable")
    policy = _policies.check_policy(policy)
    attention_chunk = _attention.check(attention_chunk)
    blocks = find_layers(model, layers)
    for i, block in enumerate(blocks):
        if enable and i % every == 0:
            _check_has_call(block, f"layers[{i}]")  # before any block is wrapped
    count = 0
    for block in blocks[::every]:
        before = type(block)
        count += type(checkpoint_module(block, enable, policy, attention_chunk)) is not before
    return count


def checkpoint_sequential(
    layers: Sequence[Callable],
    segments: int | str = "sqrt",
    policy: policies.Policy | None = None,
    attention_chunk: int | str | None = "auto",
) -> Callable[[Any], Any]:
    """Run ``layers`` in sequence as ``segments`` checkpointed segments.

    Args:
        layers: modules (or functions) applied one after another.
        segments: number of segments, or ``"sqrt"`` for ceil(sqrt(len(layers)))
            (Chen et al. 2016).
        policy, attention_chunk: as for :func:`checkpoint_module`.

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
    transform = functools.partial(checkpoint_flat, policy=policy, attention_chunk=_attention.check(attention_chunk))

    def run(x: Any) -> Any:
        for group in groups:

            def seg(h: Any, group: list = group) -> Any:
                for layer in group:
                    h = layer(h)
                return h

            x = _calls.call_flat(transform, _policies.offering_layers(seg, policy), (x,), {})  # seg reaches its layers
        return x

    return run
