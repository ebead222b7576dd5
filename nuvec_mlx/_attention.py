"""Attention in query chunks: :func:`scaled_dot_product_attention`, and where MLX trains attention unfused.

Read from MLX's source (``mlx/fast.cpp``, ``scaled_dot_product_attention``
and each backend's ``use_fallback``; MLX 0.32): under a gradient, MLX computes
:func:`mlx.core.fast.scaled_dot_product_attention` with plain operations, the
*fallback*, on the CPU always, and on Metal always when training (its fused
kernels have no backward, and the forward is faster unfused there); on CUDA
it runs cuDNN's fused forward and backward for float16 and bfloat16 with head
sizes that are multiples of 8 up to 128 and query lengths that are multiples
of 128, and the fallback otherwise (float32 among them). The fallback holds
the scores, batch x heads x queries x keys, and their softmax: a block's
backward pass then holds tokens squared. The fused backward also has limits
of its own (:data:`FUSED_LIMIT` on the queries, :data:`FUSED_KEY_LIMIT` on the
keys where query heads share key-value heads): past them, it asks for more
memory than the card has; attention past them is computed in fused chunks of
queries and groups of heads.

:func:`scaled_dot_product_attention` computes the same attention in chunks of
queries (:func:`nuvec_mlx.checkpoint_chunks`), so that the forward and the
backward pass hold one chunk's scores. A chunk of queries ``[start, stop)``
with the causal mask needs the keys up to ``stop`` only (the causal mask is
aligned to the last key, so the chunk is exact and the keys after it are never
read); with an array mask (a sliding window), the chunk takes its rows of the
mask and every key; with no mask, every key. Each query's attention is
computed as without chunks.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from . import _validate
from .chunks import checkpoint_chunks

#: The chunk setting that chunks where this backend trains attention unfused, or past :data:`FUSED_LIMIT`.
AUTO = "auto"
#: The most batch x heads x queries x head size handed to MLX's fused CUDA attention under a gradient: on an H100
#: (MLX 0.32.4; ``benchmarks/results/h100/2026-12-06-attention-backward/``) the fused backward fails to allocate
#: at 2^28 (32 heads of 128 at 65,536 queries) and runs at 7/8 of that and at 2^27; up to 65,536 keys their
#: length does not count (past that, :data:`FUSED_KEY_LIMIT`). Longer queries are computed in fused chunks of
#: at most this many.
FUSED_LIMIT = 1 << 27
#: The most batch x query heads x keys x head size handed to MLX's fused CUDA attention under a gradient where
#: query heads share key-value heads: on an H100 (MLX 0.32.4; the same results) 32 query heads over 8 key-value
#: heads of 128 fail to allocate at 131,072 keys (2^29), from 1,024 queries up, and run at 98,304 keys; 16 over
#: 8 run at 131,072 keys (2^28), and so do 32 over 32 (no sharing). Past it the heads are computed in groups
#: (:func:`head_group`).
FUSED_KEY_LIMIT = 1 << 28
#: cuDNN's fused backward takes query lengths that are multiples of this (MLX 0.32's ``use_fallback``).
FUSED_MULTIPLE = 128


def check(setting: object, name: str) -> int | str | None:
    """``setting`` if it is ``"auto"``, ``None`` (never chunk) or a chunk size (an int >= 1)."""
    if setting is None or setting == AUTO:
        return setting
    if isinstance(setting, bool) or not isinstance(setting, int):
        raise TypeError(f"{name} must be 'auto', None or an int chunk size, got {setting!r}")
    return _validate.check_int(setting, name, minimum=1)


def backend() -> str:
    """Where MLX's default device runs: ``"cpu"``, ``"metal"`` or ``"cuda"``."""
    if mx.default_device().type == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def _causal(mask: Any) -> bool:
    return isinstance(mask, str) and mask == "causal"


def trains_unfused(q: mx.array, k: mx.array, v: mx.array, causal: bool) -> bool:
    """Whether MLX computes this attention with the fallback under a gradient (see the module's notes)."""
    if backend() != "cuda":
        return True
    q_len, k_len, head, value = q.shape[2], k.shape[2], q.shape[-1], v.shape[-1]
    cudnn = (
        os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "1") != "0"
        and isinstance(major := mx.device_info().get("compute_capability_major", 0), int)
        and major >= 8
        and not (causal and q_len > k_len)
        and head % 8 == 0
        and head <= 128
        and value % 8 == 0
        and value <= 128
        and q.dtype in (mx.float16, mx.bfloat16)
    )
    return not (cudnn and q_len % FUSED_MULTIPLE == 0)


def default_size(q: mx.array) -> int:
    """The query chunk by default: 4 x the head size, so that one chunk's scores take about four query
    tensors' bytes (batch x heads x chunk x keys, against batch x heads x keys x head size), about
    the size of the block's largest activation (its MLP's) rather than tokens times that."""
    return 4 * q.shape[-1]


def fused_size(q: mx.array) -> int | None:
    """The queries per chunk that keep fused attention within :data:`FUSED_LIMIT`, or ``None`` where the whole
    is within it: a multiple of 128 queries, so that each chunk is fused too."""
    batch, heads, tokens, head = q.shape
    if batch * heads * tokens * head <= FUSED_LIMIT:
        return None
    return max(FUSED_LIMIT // (batch * heads * head) // FUSED_MULTIPLE, 1) * FUSED_MULTIPLE


def head_group(q: mx.array, k: mx.array) -> int | None:
    """The query heads per fused call that keep fused attention within :data:`FUSED_KEY_LIMIT`, or ``None``
    where every head goes in one call: whole sets of the query heads that share a key-value head."""
    batch, heads, _, head = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    if kv_heads == heads or batch * heads * keys * head <= FUSED_KEY_LIMIT:
        return None
    shared = heads // kv_heads
    return max(FUSED_KEY_LIMIT // (batch * shared * keys * head), 1) * shared


def _fast(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any, options: dict[str, Any]) -> mx.array:
    """:func:`mlx.core.fast.scaled_dot_product_attention`; where it is fused past :data:`FUSED_KEY_LIMIT`, in groups
    of query heads with their key-value heads (each head's attention is computed as in one call)."""
    causal = _causal(mask)
    group = None if q.ndim != 4 or trains_unfused(q, k, v, causal) else head_group(q, k)
    if group is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, **options)
    shared, heads = q.shape[1] // k.shape[1], q.shape[1]
    per_head = isinstance(mask, mx.array) and mask.ndim >= 3 and mask.shape[-3] == heads  # a mask per head
    sinks, out = options.get("sinks"), []
    for start in range(0, heads, group):
        h, kv = slice(start, start + group), slice(start // shared, (start + group) // shared)
        group_options = options if sinks is None else {**options, "sinks": sinks[h]}
        group_mask = mask[..., h, :, :] if per_head else mask
        out.append(
            mx.fast.scaled_dot_product_attention(
                q[:, h], k[:, kv], v[:, kv], scale=scale, mask=group_mask, **group_options
            )
        )
    return mx.concatenate(out, axis=1)


def auto_size(q: mx.array, k: mx.array, v: mx.array, mask: Any, unfused: int) -> int | None:
    """The queries per chunk of ``"auto"``: ``unfused`` where this backend trains the attention unfused,
    :func:`fused_size` where it is fused."""
    if q.ndim != 4:
        return None
    causal = _causal(mask)
    return unfused if trains_unfused(q, k, v, causal) else fused_size(q)


def chunk_size(q: mx.array, k: mx.array, v: mx.array, mask: Any, chunk: int | str | None) -> int | None:
    """The queries per chunk ``chunk`` gives this attention, or ``None`` to compute it whole: ``"auto"``
    chunks where this backend trains it unfused, in chunks of :func:`default_size`, and fused attention past
    :data:`FUSED_LIMIT`."""
    if chunk is None or q.ndim != 4:
        return None
    if chunk == AUTO:
        chunk = auto_size(q, k, v, mask, default_size(q))
        if chunk is None:
            return None
    return None if q.shape[2] <= int(chunk) else int(chunk)


def scaled_dot_product_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    chunk: int | str | None = AUTO,
    **options: Any,
) -> mx.array:
    """:func:`mlx.core.fast.scaled_dot_product_attention`, computed in chunks of queries.

    The same values and gradients (each query's attention is computed as
    without chunks); each chunk is checkpointed (:func:`nuvec_mlx.checkpoint_chunks`),
    so that the forward and the backward pass hold one chunk's scores, not
    the queries times the keys, where MLX trains attention unfused.

    Args:
        q, k, v: queries, keys and values, ``(batch, heads, tokens, head size)``.
        scale, mask: as for :func:`mlx.core.fast.scaled_dot_product_attention`
            (``"causal"``, an array mask, or ``None``); other keyword
            arguments (``sinks``) are passed on.
        chunk: queries per chunk; ``"auto"`` (the default) chunks where this
            backend trains attention unfused (the CPU, Metal; CUDA outside
            cuDNN's fused kernels), in chunks of 4 x the head size, and fused
            attention past :data:`FUSED_LIMIT` in fused chunks; ``None``
            never chunks.

    Returns:
        The attention's output, ``(batch, heads, tokens, value size)``.

    Example:
        >>> out = nv.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal")
    """
    chunk = check(chunk, "chunk")
    size = None if options.get("stream") is not None else chunk_size(q, k, v, mask, chunk)
    if size is None:
        return _fast(q, k, v, scale, mask, options)
    causal = _causal(mask)
    q_len, k_len = q.shape[2], k.shape[2]
    rows = isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == q_len  # the mask's query axis

    def attend(q: mx.array, k: mx.array, v: mx.array, mask: Any, chunk: slice) -> mx.array:
        if causal:  # the keys up to the chunk's last query (the causal mask aligns to the last key)
            stop = chunk.stop + k_len - q_len
            k, v = k[:, :, :stop], v[:, :, :stop]
        return _fast(q, k, v, scale, mask, options)

    in_axes = (2, None, None, -2 if rows else None)
    return checkpoint_chunks(attend, size=size, in_axes=in_axes, out_axes=2, slice_arg="chunk")(q, k, v, mask)
