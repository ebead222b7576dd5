"""Attention in query chunks inside nuvec's checkpoints, where MLX trains attention unfused.

Read from MLX's source (``mlx/fast.cpp``, ``scaled_dot_product_attention``
and each backend's ``use_fallback``; MLX 0.32): under a gradient, MLX computes
:func:`mlx.core.fast.scaled_dot_product_attention` with plain operations, the
*fallback*, on the CPU always, and on Metal always when training (its fused
kernels have no backward, and the forward is faster unfused there); on CUDA
it runs cuDNN's fused forward and backward for float16 and bfloat16 with head
sizes that are multiples of 8 up to 128 and query lengths that are multiples
of 128, and the fallback otherwise (float32 among them). The fallback holds
the scores, batch x heads x queries x keys, and their softmax: a block's
backward pass then holds tokens squared.

Inside a checkpointed block, :func:`chunking` routes every call of
``mx.fast.scaled_dot_product_attention`` (mlx-lm's models make theirs through
it) through :func:`nuvec_mlx.checkpoint_chunks` along the queries, so that the
block's forward and backward hold one chunk's scores. A chunk of queries
``[start, stop)`` with the causal mask needs the keys up to ``stop`` only (the
causal mask is aligned to the last key, so the chunk is exact and the keys
after it are never read); with an array mask (a sliding window), the chunk
takes its rows of the mask and every key; with no mask, every key. Each
query's attention is computed as without chunks.

``mx.fast.scaled_dot_product_attention`` is replaced by a dispatcher only
while a checkpoint that chunks runs, and put back after; the dispatcher
chunks only in the context that asked for it, so that another thread's calls
in the meantime go straight to MLX's function.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

from . import _validate
from .chunks import checkpoint_chunks

#: ``attention_chunk``'s value that chunks where this backend trains attention unfused.
AUTO = "auto"

_setting: contextvars.ContextVar[int | str | None] = contextvars.ContextVar("nuvec_mlx_attention", default=None)
_lock = threading.Lock()
_users = 0  # checkpoints that chunk, running now: the dispatcher is installed while there are any
_original: Callable[..., mx.array] | None = None


def check(setting: object, name: str = "attention_chunk") -> int | str | None:
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
    return not (cudnn and q_len % 128 == 0)


def default_size(q: mx.array) -> int:
    """The query chunk by default: 4 x the head size, so that one chunk's scores take about four query
    tensors' bytes (batch x heads x chunk x keys, against batch x heads x keys x head size), about
    the size of the block's largest activation (its MLP's) rather than tokens times that."""
    return 4 * q.shape[-1]


def _dispatch(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None, **options: Any) -> mx.array:
    """``mx.fast.scaled_dot_product_attention``, in query chunks where :func:`chunking` asked for them."""
    original = _original
    assert original is not None
    setting = _setting.get()
    if setting is None or options.get("stream") is not None or q.ndim != 4:
        return original(q, k, v, scale=scale, mask=mask, **options)
    causal = isinstance(mask, str) and mask == "causal"
    if setting == AUTO and not trains_unfused(q, k, v, causal):
        return original(q, k, v, scale=scale, mask=mask, **options)
    size = default_size(q) if setting == AUTO else int(setting)
    q_len, k_len = q.shape[2], k.shape[2]
    if q_len <= size:
        return original(q, k, v, scale=scale, mask=mask, **options)
    array_mask = isinstance(mask, mx.array)
    rows = array_mask and mask.ndim >= 2 and mask.shape[-2] == q_len  # the mask's query axis, when it has one

    def attend(q: mx.array, k: mx.array, v: mx.array, mask: Any, chunk: slice) -> mx.array:
        if causal:  # the keys up to the chunk's last query (the causal mask aligns to the last key)
            stop = chunk.stop + k_len - q_len
            k, v = k[:, :, :stop], v[:, :, :stop]
        return original(q, k, v, scale=scale, mask=mask, **options)

    in_axes = (2, None, None, -2 if rows else None)
    return checkpoint_chunks(attend, size=size, in_axes=in_axes, out_axes=2, slice_arg="chunk")(q, k, v, mask)


@contextlib.contextmanager
def chunking(setting: int | str | None) -> Iterator[None]:
    """Inside, ``mx.fast.scaled_dot_product_attention`` computes in query chunks as ``setting`` says:
    ``"auto"`` where this backend trains attention unfused (chunks of :func:`default_size`), an int
    chunk size always, ``None`` never."""
    if setting is None:
        yield
        return
    global _users, _original
    with _lock:
        if _users == 0:
            _original = mx.fast.scaled_dot_product_attention
            mx.fast.scaled_dot_product_attention = _dispatch
        _users += 1
    token = _setting.set(setting)
    try:
        yield
    finally:
        _setting.reset(token)
        with _lock:
            _users -= 1
            if _users == 0:
                assert _original is not None  # saved when the first user came in
                mx.fast.scaled_dot_product_attention = _original
