"""Work along the sequence in chunks: the settings, the rules that size them, and the transform of a model's blocks.

A checkpointed block keeps only its input between the forward and the
backward pass; its backward pass then recomputes the whole block at once, and
holds every activation of the block over the whole sequence. Three parts of a
language model's step grow with the sequence beyond that, and each splits
along it: the loss head (one chunk's logits at a time:
:func:`nuvec_mlx.losses.cross_entropy`), attention where MLX trains it unfused
(one chunk of queries' scores: :func:`nuvec_mlx.scaled_dot_product_attention`)
and a block's MLP (one chunk of tokens' intermediates: a module checkpointed
in chunks, :func:`nuvec_mlx.checkpoint_module`). :class:`Chunks` holds the
setting of each, :func:`chunk_layers` applies them to a model's blocks, and
the rules here size the ``"auto"`` settings from the sizes involved.

:func:`chunk_layers` changes the blocks it is given, one instance at a time,
and nothing else: an attention module's ``__call__`` sees the chunked
attention under the name it calls (mlx-lm's ``scaled_dot_product_attention``,
or ``mx.fast.scaled_dot_product_attention``) through its own globals
(:func:`nuvec_mlx.nn.reroute`), so that other modules, other threads and every
other caller of MLX's function are untouched; a block's MLP is checkpointed in
chunks. ``routes`` reroute further names the same way (the mlx-lm integration
routes its recurrences, ``gated_delta_update``, through its own chunked scan).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import _attention, _reroute, _validate
from . import nn as nv_nn

__all__ = ["AUTO", "FEED_FORWARD", "Chunks", "Setting", "chunk_layers", "feed_forward", "head_tokens", "mlp_tokens"]

#: A chunk setting: ``"auto"`` (sized by the rules here), a size in tokens, or ``None`` (never chunk).
Setting = int | str | None
AUTO = _attention.AUTO

#: The names blocks give their feed-forward module (MLP, or mixture of experts), which treats tokens
#: independently: what the MLP setting checkpoints in chunks.
FEED_FORWARD = ("mlp", "feed_forward", "block_sparse_moe")

#: The loss head is split into ``ceil(vocabulary / (HEAD_RATIO x hidden))`` chunks by default (see
#: :func:`head_tokens`).
HEAD_RATIO = 8
#: A chunk of the head has at least this many rows (batch x tokens), or the whole sequence: on fewer rows
#: each chunk's matrix products read the whole head weight for little work.
MIN_ROWS = 128


def check(setting: object, name: str) -> Setting:
    """``setting`` if it is ``"auto"``, ``None`` or a size in tokens (an int >= 1)."""
    return _attention.check(setting, name)


def head_tokens(tokens: int, hidden: int, vocabulary: int, batch: int = 1) -> int:
    """The loss head's tokens per chunk by default.

    The head is split into ``ceil(vocabulary / (HEAD_RATIO x hidden))``
    chunks, so that one chunk's logits (batch x chunk x vocabulary) take at
    most :data:`HEAD_RATIO` times the bytes of all the hidden states (batch x
    tokens x hidden): as much as a few checkpointed blocks keep, not the
    vocabulary's multiple of it. A chunk has at least :data:`MIN_ROWS` rows
    (``batch`` x its tokens), or the whole sequence.

    Args:
        tokens: the sequence length.
        hidden: the hidden size (the head's input).
        vocabulary: the head's outputs.
        batch: the batch size.

    Returns:
        The tokens per chunk, at most ``tokens``.

    Example:
        >>> nv.chunking.head_tokens(tokens=2048, hidden=2048, vocabulary=128256, batch=4)
        256
    """
    _check_sizes(tokens=tokens, hidden=hidden, vocabulary=vocabulary, batch=batch)
    count = math.ceil(vocabulary / (HEAD_RATIO * hidden))
    return min(tokens, max(math.ceil(tokens / count), math.ceil(MIN_ROWS / batch)))


def mlp_tokens(tokens: int, hidden: int, width: int, batch: int = 1, blocks: int = 1) -> int | None:
    """A block's MLP's tokens per chunk by default, or ``None`` to leave it whole.

    Example:
        >>> nv.chunking.mlp_tokens(tokens=2048, hidden=2048, width=8192, batch=4, blocks=16) is None
        True
    """
    _check_sizes(tokens=tokens, hidden=hidden, width=width, batch=batch, blocks=blocks)
    return None


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        _validate.check_int(value, name, minimum=1)


@dataclasses.dataclass(frozen=True)
class Chunks:
    """How a step works along the sequence in chunks: each part's setting.

    Each is ``"auto"`` (the default: sized from the sizes involved by the rules
    of :mod:`nuvec_mlx.chunking`), a size in tokens, or ``None`` (never
    chunked).

    Attributes:
        head: the loss head's tokens per chunk (:func:`head_tokens`).
        attention: attention's queries per chunk; ``"auto"`` chunks where the
            backend trains attention unfused (the CPU, Metal), in chunks of 4 x
            the head size.
        mlp: a block's MLP's tokens per chunk (:func:`mlp_tokens`).
        scan: a recurrence's tokens per chunk (gated delta, state-space scans).

    Example:
        >>> nv.chunk_layers(model, nv.Chunks(mlp=1024, attention=None))
    """

    head: Setting = AUTO
    attention: Setting = AUTO
    mlp: Setting = AUTO
    scan: Setting = AUTO

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check(getattr(self, field.name), field.name)

    @classmethod
    def from_settings(cls, **settings: object) -> Chunks:
        """Chunks from settings as a command line or a config file gives them: ``0`` is ``None`` (off),
        an absent or ``None`` setting the default.

        Example:
            >>> Chunks.from_settings(mlp=0, attention="auto", head=None)
            Chunks(head='auto', attention='auto', mlp=None, scan='auto')
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(settings) - names
        if unknown:
            raise TypeError(f"Chunks has the settings {sorted(names)}, got {sorted(unknown)}")
        given = {k: None if _is_off(v) else v for k, v in settings.items() if v is not None}
        return cls(**given)  # type: ignore[arg-type]


def _is_off(value: object) -> bool:
    return value == 0 and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class _MLP:
    """The MLP's chunk, asked at each call: a size, or :func:`mlp_tokens` of the call's sizes."""

    setting: int | str
    blocks: int

    def __call__(self, module: nn.Module, x: mx.array) -> int | None:
        if isinstance(self.setting, int):
            return self.setting
        batch, tokens, hidden = x.shape[0], x.shape[1], x.shape[-1]
        return mlp_tokens(tokens, hidden, _width(module), batch, self.blocks)


def _width(module: nn.Module) -> int:
    """The widest output of ``module``'s layers (an MLP's hidden width): the largest first dimension of
    its ``weight`` arrays (a quantized layer's too: packed along its input)."""
    weights = dict(tree_flatten(module.parameters()))
    widths = [v.shape[0] for k, v in weights.items() if k.endswith("weight") and v.ndim == 2]
    return max(widths, default=1)


@dataclasses.dataclass(frozen=True)
class _LibraryAttention:
    """mlx-lm's ``scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None)``,
    in chunks of queries where it runs without a cache (training); as it is with one (generation)."""

    original: Callable[..., mx.array]
    chunk: int | str

    def __call__(self, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                 sinks: mx.array | None = None) -> mx.array:  # fmt: skip
        if cache is not None:
            return self.original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        options = {} if sinks is None else {"sinks": sinks}
        return _attention.scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, chunk=self.chunk, **options
        )


@dataclasses.dataclass(frozen=True)
class _FastAttention:
    """``mx.fast.scaled_dot_product_attention``, in chunks of queries."""

    chunk: int | str

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, **options: Any) -> mx.array:
        return _attention.scaled_dot_product_attention(q, k, v, chunk=self.chunk, **options)


def attention_routes(cls: type, chunk: int | str) -> dict[str, Any]:
    """The routes that make ``cls``'s ``__call__`` compute its attention in chunks of ``chunk`` queries:
    its global ``scaled_dot_product_attention`` (mlx-lm's), and ``mx`` where it calls
    ``mx.fast.scaled_dot_product_attention`` itself; empty where it calls neither."""
    names = _reroute.names_read(cls)
    if "scaled_dot_product_attention" not in names:
        return {}
    namespace = getattr(cls.__call__, "__globals__", {})
    found: dict[str, Any] = {}
    library = namespace.get("scaled_dot_product_attention")
    if callable(library) and library is not mx.fast.scaled_dot_product_attention:
        found["scaled_dot_product_attention"] = _LibraryAttention(library, chunk)
    if "fast" in names and namespace.get("mx") is mx:
        fast = _reroute.Namespace(mx.fast, scaled_dot_product_attention=_FastAttention(chunk))
        found["mx"] = _reroute.Namespace(mx, fast=fast)
    return found


def chunk_layers(
    model: nn.Module,
    chunks: Chunks | None = None,
    *,
    layers: Any = None,
    routes: Mapping[str, Any] | None = None,
    enable: bool = True,
) -> int:
    """Compute a model's blocks along the sequence in chunks (in place); ``enable=False`` undoes it.

    In each block (and the modules inside it): attention in chunks of queries
    (``chunks.attention``), the feed-forward module (a child named as in
    :data:`FEED_FORWARD`) checkpointed in chunks of tokens (``chunks.mlp``),
    and the functions ``routes`` names computed as they say. Nothing outside
    the blocks changes: the modules' own calls see the chunked functions
    (:func:`nuvec_mlx.nn.reroute`). Values and gradients are the unchunked
    ones, up to the order of sums. Checkpoint the blocks too
    (:func:`nuvec_mlx.checkpoint_layers`): inside a checkpointed block, the
    chunks bound what its backward pass holds.

    Args:
        model: the model.
        chunks: the settings; ``None`` for ``Chunks()`` (every part ``"auto"``).
        layers: the blocks, as :func:`nuvec_mlx.checkpoint_layers` takes them.
        routes: further global names, each the function the modules that call
            it should call instead (hashable: a module's class is cached by them).
        enable: chunk (True) or put the blocks back (False).

    Returns:
        How many modules changed.

    Example:
        >>> nv.checkpoint_layers(model)
        >>> nv.chunk_layers(model)                        # the rules decide
        >>> nv.chunk_layers(model, nv.Chunks(mlp=1024))   # the MLP in chunks of 1024 tokens
    """
    _validate.check_module(model, "model")
    chunks = Chunks() if chunks is None else chunks
    if not isinstance(chunks, Chunks):
        raise TypeError(f"chunks must be an nv.Chunks or None, got {type(chunks).__name__}")
    _validate.check_bool(enable, "enable")
    extra = dict(routes or {})
    blocks = nv_nn.find_layers(model, layers)
    changed = 0
    for block in blocks:
        for module in block.modules():
            changed += nv_nn.reroute(module, _routes(module, chunks, extra) if enable else {})
        mlp = feed_forward(block)
        if mlp is not None:
            rule = _MLP(chunks.mlp, len(blocks)) if enable and chunks.mlp is not None else None
            before = type(mlp)
            nv_nn.in_chunks(mlp, rule, enable=rule is not None)
            changed += type(mlp) is not before
    return changed


def _routes(module: nn.Module, chunks: Chunks, extra: dict[str, Any]) -> dict[str, Any]:
    """The routes ``module``'s own ``__call__`` takes: attention's, and those of ``extra`` it reads."""
    cls = nv_nn.original_class(module)
    found = {} if chunks.attention is None else attention_routes(cls, chunks.attention)
    names = _reroute.names_read(cls)
    found.update({name: route for name, route in extra.items() if name in names})
    return found


def feed_forward(block: nn.Module) -> nn.Module | None:
    """``block``'s feed-forward module (its child named as in :data:`FEED_FORWARD`), or ``None``."""
    _validate.check_module(block, "block")
    return next((c for name in FEED_FORWARD if isinstance(c := block.get(name), nn.Module)), None)
