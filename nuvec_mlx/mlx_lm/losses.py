"""mlx-lm's default loss with the loss head in chunks of tokens: :func:`chunked_loss`.

mlx-lm's ``default_loss`` computes ``model(inputs)``, the whole logits, then a
masked cross-entropy. :func:`chunked_loss` computes the same loss from the
model's hidden states, running the model's own head code (a separate
``lm_head``, tied embeddings' ``as_linear``, logit soft-capping or scaling:
whatever the model's ``__call__`` does after ``self.model``) one chunk of
tokens at a time (:func:`nuvec_mlx.losses.cross_entropy`'s way).

How the head is found without copying it. The model's ``__call__`` is run
once with ``self.model`` (the backbone) standing in for a function that
returns given hidden states, on a view of the model that records what the
call reads (the head's modules, settings such as ``args`` or a soft-cap). Each
chunk then runs the same ``__call__`` on a view that serves exactly those,
with the chunk's hidden states as the backbone's output: the modules a chunk
reaches are the head's, and only they are inputs of the chunks.

Before any of it, the model's ``__call__`` is probed with its child modules
standing in for stubs (nothing of the model runs): a model that returns one
child's output unchanged (qwen3_5's ``Model`` returns ``self.language_model``'s)
is followed into that child; a model whose ``__call__`` does not call
``self.model`` once gets mlx-lm's unchunked loss. The probe matters beyond
the head: a forward pass run only to find out, its result dropped, still
marks the stages of checkpointed blocks, which a compiled step then computes
(and MLX 0.32.4's compile merges with the real forward pass, which fails on
models with ``mx.split``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tuner.trainer import default_loss

from .. import _validate, chunking
from ..chunks import SUM, checkpoint_chunks


class _NoHead(Exception):
    """The model's ``__call__`` did not apply a head to ``self.model``'s output once."""


class _Backbone:
    """Stands for ``self.model`` in one run of the model's ``__call__``: called, it returns ``hidden``."""

    def __init__(self, view: _View):
        self._view, self.calls = view, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._view._hidden

    def __getattr__(self, name: str) -> Any:
        return self._view._read("model." + name)


class _View:
    """The model as its ``__call__`` sees it, ``self.model`` a stand-in returning ``hidden``.

    Recording (``values`` is ``None``): every attribute read is taken from the
    model and noted. Serving: only the attributes noted are there.
    """

    def __init__(self, model: nn.Module | None, hidden: mx.array, values: dict[str, Any] | None = None):
        self._model, self._hidden = model, hidden
        self._serving = values is not None
        self._values: dict[str, Any] = {} if values is None else values
        self._backbone = _Backbone(self)

    def _read(self, path: str) -> Any:
        if self._serving:
            if path not in self._values:
                raise _NoHead(f"the model's __call__ read {path}, which it did not read when its head was found")
            return self._values[path]
        value: Any = self._model
        for name in path.split("."):
            value = getattr(value, name)
        self._values[path] = value
        return value

    def __getattr__(self, name: str) -> Any:
        if name == "model":
            return self._backbone
        return self._read(name)


class Head:
    """An mlx-lm model's loss head, run from its own ``__call__``: hidden states to logits.

    Args:
        model: an mlx-lm model (``model.model`` its backbone).
        hidden, inputs: hidden states and the token ids they are the backbone's output for
            (the first token of each is used; nothing is evaluated).

    Raises:
        ValueError: the model's ``__call__`` does not apply a head to ``self.model``'s output.
    """

    def __init__(self, model: nn.Module, hidden: mx.array, inputs: mx.array):
        call = type(model).__call__
        view = _View(model, hidden[:1, :1])
        try:
            out = call(view, inputs[:1, :1])
        except (_NoHead, AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"{type(model).__name__}.__call__ cannot run on given hidden states: {e}") from e
        if view._backbone.calls != 1:
            raise ValueError(f"{type(model).__name__}.__call__ calls self.model {view._backbone.calls} times, not once")
        if out is view._hidden or not isinstance(out, mx.array):
            raise ValueError(f"{type(model).__name__}.__call__ applies nothing to self.model's output")
        self.vocabulary = out.shape[-1]
        self.call, self.values = call, view._values
        self.modules = {path: v for path, v in self.values.items() if isinstance(v, nn.Module)}

    def __call__(self, hidden: mx.array, inputs: mx.array) -> mx.array:
        """The logits of ``hidden``, the backbone's output for ``inputs``."""
        return self.call(_View(None, hidden, self.values), inputs)


def hidden_states(model: nn.Module, inputs: mx.array) -> mx.array:
    """What ``model.model`` returns inside ``model(inputs)``: the hidden states the head reads.

    The model's ``__call__`` runs as it is, with ``self.model`` recorded; the
    logits it then builds are never evaluated (nothing reads them).
    """
    found: list[mx.array] = []
    backbone = getattr(model, "model", None)
    if not isinstance(backbone, nn.Module):
        raise ValueError(f"{type(model).__name__} has no backbone in model.model")
    module: nn.Module = backbone  # narrowed: the class below sees the name, not the check

    class _Recording:
        def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
            found.append(module(*args, **kwargs))
            return found[-1]

        def __getattr__(self, name: str) -> Any:
            return getattr(backbone, name)

    view = _Forwarding(model, _Recording())
    type(model).__call__(view, inputs)
    if len(found) != 1:
        raise ValueError(f"{type(model).__name__}.__call__ called self.model {len(found)} times, not once")
    return found[0]


class _Stub:
    """A child module of the model in a probe of its ``__call__``: calling it records the call and returns
    a stand-in array; reading an attribute of it gives the stub of that attribute."""

    def __init__(self, probe: _Probe, path: str):
        self._probe, self._path = probe, path

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        out = mx.zeros((1, 1, 1))
        self._probe.calls.append((self._path, args, kwargs, out))
        return out

    def __getattr__(self, name: str) -> _Stub:
        return _Stub(self._probe, f"{self._path}.{name}")


class _Probe:
    """The model as its ``__call__`` sees it, each child module a :class:`_Stub`: which children it calls."""

    def __init__(self, model: nn.Module):
        self._model = model
        self.calls: list[tuple[str, tuple, dict, mx.array]] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._model, name)
        return _Stub(self, name) if isinstance(value, nn.Module) else value


def _route(model: nn.Module, inputs: mx.array) -> str | None:
    """What the model's ``__call__`` does, probed with its children stubbed (nothing of the model runs):
    ``"model"`` where it calls ``self.model`` once; the name of a child whose output it returns unchanged,
    called with the inputs alone (a wrapper: qwen3_5's ``language_model``); ``None`` otherwise."""
    probe = _Probe(model)
    try:
        out = type(model).__call__(probe, inputs)
    except Exception:  # the stand-ins do not fit the model's own code: let the full search decide
        return "model"
    if [path for path, *_ in probe.calls].count("model") == 1:
        return "model"
    if len(probe.calls) == 1:
        path, args, kwargs, result = probe.calls[0]
        whole = args[:1] == (inputs,) and all(a is None for a in (*args[1:], *kwargs.values()))
        if out is result and "." not in path and whole:
            return path
    return None


class _Forwarding:
    """``model`` with ``model.model`` replaced by ``backbone``, for one call of its ``__call__``."""

    def __init__(self, model: nn.Module, backbone: Any):
        self._model, self._backbone = model, backbone

    def __getattr__(self, name: str) -> Any:
        return self._backbone if name == "model" else getattr(self._model, name)


def chunked_loss(
    model: nn.Module, batch: mx.array, lengths: mx.array, chunk: int | str | None = "auto"
) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``default_loss``, the loss head computed ``chunk`` tokens at a time.

    The same values as ``mlx_lm.tuner.trainer.default_loss`` (the mean
    cross-entropy over the tokens that ``lengths`` marks, and their count), up
    to the order of the float32 sum over tokens; the logits are never all
    alive at once. Pass it as ``train``'s ``loss`` (its ``chunk`` with
    :func:`functools.partial`).

    Args:
        model: an mlx-lm model.
        batch: token ids, ``(batch, tokens + 1)``.
        lengths: per row, the first and last position the loss counts (mlx-lm's ``lengths``).
        chunk: tokens per chunk; ``"auto"`` for :func:`nuvec_mlx.chunking.head_tokens`;
            ``None`` for mlx-lm's ``default_loss`` unchanged.

    Returns:
        ``(loss, tokens)``, as ``default_loss``.

    Example:
        >>> train(model, optimizer, data, args=args, loss=chunked_loss)
        >>> train(model, optimizer, data, args=args, loss=functools.partial(chunked_loss, chunk=128))
    """
    _validate.check_module(model, "model")
    if not isinstance(batch, mx.array) or batch.ndim != 2:
        raise TypeError(f"batch must be an mlx.core.array of 2 dimensions (token ids), got {_validate.describe(batch)}")
    if not isinstance(lengths, mx.array) or lengths.shape != (batch.shape[0], 2):
        raise TypeError(
            f"lengths must be an mlx.core.array of shape {(batch.shape[0], 2)} (per row, the first and last "
            f"position), got {_validate.describe(lengths)}"
        )
    if chunk is None:
        return default_loss(model, batch, lengths)
    if chunk != "auto":
        _validate.check_int(chunk, "chunk", minimum=1)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    route = _route(model, inputs)
    if route is None:  # no self.model: nothing to chunk, and no forward pass run to find out
        return default_loss(model, batch, lengths)
    if route != "model":  # a wrapper returning one child's logits: that child's head, chunked
        return chunked_loss(getattr(model, route), batch, lengths, chunk)
    try:
        hidden = hidden_states(model, inputs)
        head = Head(model, hidden, inputs)
    except ValueError:
        return default_loss(model, batch, lengths)  # no head apart from the backbone: nothing to chunk
    steps = mx.arange(1, targets.shape[1] + 1)
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
    size = (
        chunk
        if isinstance(chunk, int)
        else chunking.head_tokens(
            hidden.shape[1], hidden.shape[2], head.vocabulary, hidden.shape[0], len(getattr(model, "layers", ())) or 1
        )
    )

    tokens = mask.sum()

    # Each chunk's share of the mean, divided inside: the loss's cotangent is then 1, so that a chunk's
    # gradient taken in its forward pass (nuvec_mlx.chunks) is the one the backward pass uses, unscaled,
    # and one chunk is mlx-lm's loss and gradient bitwise.
    def part(h: mx.array, ids: mx.array, t: mx.array, m: mx.array, n: mx.array) -> mx.array:
        return (nn.losses.cross_entropy(head(h, ids), t) * m).astype(mx.float32).sum() / n

    chunked = checkpoint_chunks(part, size=size, in_axes=(1, 1, 1, 1, None), out_axes=SUM)
    return chunked(hidden, inputs, targets, mask, tokens), tokens


def loss_for(chunk: int | str | None) -> Callable[..., tuple[mx.array, mx.array]]:
    """mlx-lm's default loss with the head in chunks of ``chunk`` tokens (``None``: ``default_loss`` itself)."""
    return default_loss if chunk is None else functools.partial(chunked_loss, chunk=chunk)
