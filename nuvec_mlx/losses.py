"""Losses that never hold the whole loss head: the logits computed and differentiated in chunks of tokens.

A language model's loss head turns the hidden states (batch x tokens x
hidden) into logits (batch x tokens x vocabulary) and a cross-entropy over
them; with today's vocabularies (128k to 262k tokens) the logits, their
softmax and their gradient are the largest arrays of a fine-tuning step,
larger than everything checkpointed blocks keep. :func:`cross_entropy`
computes the head and the loss chunk by chunk along the tokens, each chunk a
checkpoint of its own (:func:`nuvec_mlx.checkpoint_chunks`): one chunk's
logits are alive at a time, in the forward and in the backward pass. Under
nuvec's gradients (:func:`nuvec_mlx.value_and_grad`,
:class:`nuvec_mlx.TrainingStep`) each chunk's gradient is taken in the forward
pass with its value, so no chunk is computed twice.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from . import _validate, chunking
from .chunks import SUM, checkpoint_chunks


def cross_entropy(
    head: Callable[[mx.array], mx.array],
    hidden: mx.array,
    targets: mx.array,
    weights: mx.array | None = None,
    *,
    chunk: int | None = None,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> mx.array:
    """``nn.losses.cross_entropy(head(hidden), targets, ...)``, the logits computed in chunks of tokens.

    The values and gradients are those of the unchunked loss, up to the order
    of the sum over tokens: the sum (and the mean) is taken in float32, chunk
    by chunk, as mlx-lm's losses sum in float32.

    Args:
        head: the loss head, hidden states to logits: a module or a bound method
            of one (``model.lm_head``, ``model.model.embed_tokens.as_linear``).
            Every module it reaches is an input of each chunk, differentiated
            when trainable: pass the head itself, not a function of the whole model.
        hidden: the hidden states, ``(batch, tokens, hidden)``.
        targets: the target ids, ``(batch, tokens)``.
        weights: per-token weights (a mask), ``(batch, tokens)``, or ``None``.
        chunk: tokens per chunk; ``None`` for :func:`nuvec_mlx.chunking.head_tokens`
            of these sizes, as for a model of one block (the loss is not told how
            many blocks the model has).
        label_smoothing: as for :func:`mlx.nn.losses.cross_entropy`.
        reduction: ``"mean"`` (over every token, as MLX's), ``"sum"``, or
            ``"none"`` (per-token losses, ``(batch, tokens)``).

    Returns:
        The loss.

    Example:
        >>> h = model.model(inputs)  # the hidden states
        >>> loss = nv.losses.cross_entropy(model.lm_head, h, targets, weights=mask, reduction="sum")
    """
    _validate.check_callable(head, "head")
    for value, name, ndim in ((hidden, "hidden", 3), (targets, "targets", 2)):
        if not isinstance(value, mx.array) or value.ndim != ndim:
            raise TypeError(f"{name} must be an mlx.core.array of {ndim} dimensions, got {_validate.describe(value)}")
    if mx.issubdtype(targets.dtype, mx.inexact) or targets.dtype == mx.bool_:
        raise TypeError(f"targets must be an array of integer token ids, got dtype {targets.dtype}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"targets must have hidden's batch and tokens {tuple(hidden.shape[:2])}, got shape {tuple(targets.shape)}"
        )
    if hidden.shape[1] == 0:
        raise ValueError("hidden must hold at least one token, got a sequence of 0 tokens")
    if weights is not None and (not isinstance(weights, mx.array) or weights.shape != targets.shape):
        raise ValueError(
            f"weights must be None or an array of targets' shape {targets.shape}, got {_validate.describe(weights)}"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if chunk is None:
        vocabulary = head(hidden[:, :1]).shape[-1]  # built lazily, never evaluated
        chunk = chunking.head_tokens(hidden.shape[1], hidden.shape[2], vocabulary, hidden.shape[0])
    _validate.check_int(chunk, "chunk", minimum=1)

    def part(h: mx.array, t: mx.array, w: mx.array | None) -> mx.array:
        ce = nn.losses.cross_entropy(head(h), t, weights=w, label_smoothing=label_smoothing)
        if reduction == "none":
            return ce
        # A chunk's share of the mean is divided inside the chunk: the loss's cotangent is then 1, by which
        # a chunk's gradient taken in its forward pass (nuvec_mlx.chunks) is scaled without rounding.
        total = ce.astype(mx.float32).sum()
        return total / targets.size if reduction == "mean" else total

    return checkpoint_chunks(
        part, size=chunk, in_axes=(1, 1, None if weights is None else 1), out_axes=1 if reduction == "none" else SUM
    )(hidden, targets, weights)
