"""mlx-lm's gated delta rule, trained in checkpointed chunks: :func:`gated_delta_update`.

mlx-lm's gated-delta models (``qwen3_5``, ``qwen3_next``, ``kimi_linear``,
``olmo_hybrid`` ...) call ``mlx_lm.models.gated_delta.gated_delta_update``.
In training (``use_kernel=not self.training``), and on the CPU or CUDA, that
runs ``gated_delta_ops``: a Python loop over tokens whose slices ``q[:, t]``
each have a vjp that builds a gradient buffer of the whole sequence, and
whose per-token states all stay alive for the backward pass, so the training
peak grows faster than the sequence. On Metal its fused kernel has no vjp.

:func:`gated_delta_update` has mlx-lm's signature and contract (the same
``y`` and final state, up to the order of float32 sums) and computes the
recurrence with :func:`nuvec_mlx.scan`: in chunks of tokens, only each chunk's
starting state kept, each chunk recomputed in the backward pass. Within a
chunk the rule is computed in blocks of tokens, in its chunkwise-parallel form
(as flash-linear-attention's chunked gated delta rule): with ``M`` the state
``S`` transposed (key by value), ``M_0`` at the block's start, ``D_t`` the
decay of token ``t`` (a scalar, or a diagonal over the key dimension for
vector gates) and ``G_t`` its product from the block's start to ``t``,

- ``A[t, i] = beta_t k_t' G_t G_i^-1 k_i`` for ``i < t`` (strictly lower);
- ``W = (I + A)^-1 diag(beta) (V - K~ M_0)``, ``K~`` the rows ``G_t k_t``: the
  corrections each token writes (the WY / UT form); ``(I + A)^-1`` of the unit
  lower-triangular matrix is built by block forward substitution in matrix
  products (diagonal blocks of 1, 2, 4 ... rows: the inverse of a 2x2 block
  lower triangle from those of its diagonal blocks), since MLX's
  linear-algebra solvers run on the CPU stream only, and products of powers of
  ``A`` (a Neumann series) lose precision where neighbouring keys are alike;
- ``Y = Q~ M_0 + P W`` with ``P[t, i] = q_t' G_t G_i^-1 k_i`` for ``i <= t``;
- ``M_L = G_L M_0 + sum_i G_L G_i^-1 k_i w_i'`` after the block's ``L`` tokens.

What does not depend on ``M_0`` is computed for all the chunk's blocks at once,
batched over a block axis: the decays, ``A`` and its inverse, ``P``,
``U = (I + A)^-1 diag(beta) V`` and ``W~ = (I + A)^-1 diag(beta) K~`` (so
that ``W = U - W~ M_0``). Only the recurrence from block to block runs block
after block, three ops each: ``W = U - W~ M_c``, then
``M_{c+1} = G_L M_c + K^' W`` (``K^`` the rows ``G_L G_i^-1 k_i``); ``Y``
follows for all blocks at once from the blocks' starting states. Each of the
form's many small ops so covers a chunk of several blocks rather than one
block: far fewer ops per token, each of which costs a launch, for the same
arithmetic. A chunk's tokens past a multiple of the block are padded with
zeros: tokens with no key, query or write and no decay, which change nothing.

The decays between tokens, ``G_t G_i^-1``, are the exponentials of sums of the
log-gates between them (a segment sum), not ratios of cumulative products:
exact where gates are tiny. Matrix products replace the per-token loop; the
per-token ops remain the form where a mask is given (``mlx-lm``'s own
``gated_delta_ops``, run in chunks of a block at most, exact by definition: a
masked token's output is computed, its state update dropped).

On Metal (``use_kernel=True`` on the GPU), the forward pass is mlx-lm's fused
kernel in one call, and the backward pass runs it chunk by chunk to rebuild
the chunks' starting states, then recomputes each chunk with the
differentiable form (:func:`nuvec_mlx.scan`'s ``forward``).
:func:`make_gated_delta_update` builds the function with another chunk or
block size or kernel (a kernel stand-in is how the tests run that path on a
CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

try:
    from mlx_lm.models.gated_delta import gated_delta_kernel, gated_delta_ops
except ImportError as e:  # pragma: no cover - the extra is installed where this runs
    raise ImportError('nuvec_mlx.mlx_lm needs mlx-lm: pip install "nuvec-mlx[mlx-lm]"') from e

from .. import _validate
from ..scan import scan

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_CHUNK",
    "DEFAULT_VECTOR_BLOCK",
    "DEFAULT_VECTOR_CHUNK",
    "gated_delta_update",
    "make_gated_delta_update",
]

#: Tokens per chunk of :func:`gated_delta_update` with one gate per head: the forward pass keeps one state per
#: chunk, the backward pass recomputes one chunk at a time, in blocks of :data:`DEFAULT_BLOCK`. 8 blocks a chunk:
#: about 6x fewer MLX ops per token than chunks of one block, for one chunk's intermediates alive at a time.
DEFAULT_CHUNK = 512
#: Tokens per block with one gate per head: each block's intermediates are a few (block x block) matrices per head.
DEFAULT_BLOCK = 64
#: Tokens per chunk with one gate per head and key dimension (``a`` of ``(B, T, Hv, Dk)``): 8 blocks of
#: :data:`DEFAULT_VECTOR_BLOCK`, whose decays make a chunk's intermediates larger than with one gate per head.
DEFAULT_VECTOR_CHUNK = 128
#: Tokens per block with vector gates: the decays between tokens are then (block x block x key size) per head,
#: whose memory and time grow with the block.
DEFAULT_VECTOR_BLOCK = 16

Kernel = Callable[..., tuple[mx.array, mx.array]]


def _segment_sums(x: mx.array, axis: int) -> mx.array:
    """``s[..., t, i, ...] = x[i+1] + ... + x[t]`` along ``axis`` for ``t >= i``, ``-inf`` above (``t < i``).

    Summed from the terms between ``i`` and ``t``, not as a difference of
    cumulative sums, which would lose the small sums after a large one.
    The pair of axes ``(t, i)`` replaces ``axis``.
    """
    n = x.shape[axis]
    t = mx.arange(n)[:, None]
    i = mx.arange(n)[None, :]
    shape = [1] * (x.ndim + 1)
    shape[axis], shape[axis + 1] = n, n
    moved = mx.expand_dims(x, axis + 1)  # x[..., t, 1, ...]: the term of token t, for every i
    terms = mx.where((t > i).reshape(shape), moved, mx.zeros((), x.dtype))
    sums = mx.cumsum(terms, axis=axis)
    return mx.where((t >= i).reshape(shape), sums, mx.array(-mx.inf, x.dtype))


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """``(I + a)^-1`` for ``a`` strictly lower triangular in its last two axes, by block forward substitution.

    Blocks of 1, 2, 4 ... rows: the inverse of ``[[L11, 0], [L21, L22]]`` is
    ``[[X11, 0], [-X22 L21 X11, X22]]``, ``X`` the inverses of the diagonal
    blocks. Matrix products only; the size is padded to a power of 2.
    """
    n = a.shape[-1]
    size = 1 << (n - 1).bit_length()
    lead = a.shape[:-2]
    if size != n:
        a = mx.pad(a, [(0, 0)] * len(lead) + [(0, size - n), (0, size - n)])
    inverse = mx.ones((*lead, size, 1, 1), dtype=a.dtype)  # the diagonal blocks of 1 row
    b = 1
    while b < size:
        m = size // (2 * b)
        pairs = inverse.reshape(*lead, m, 2, b, b)
        x11, x22 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        blocks = mx.diagonal(a.reshape(*lead, m, 2 * b, m, 2 * b), axis1=-4, axis2=-2)  # (..., 2b, 2b, m)
        l21 = mx.moveaxis(blocks, -1, -3)[..., b:, :b]
        x21 = -(x22 @ l21 @ x11)
        top = mx.concatenate([x11, mx.zeros_like(x11)], axis=-1)
        inverse = mx.concatenate([top, mx.concatenate([x21, x22], axis=-1)], axis=-2)
        b *= 2
    out = inverse.reshape(*lead, size, size)
    return out[..., :n, :n] if size != n else out


def _heads_first(x: mx.array, repeat: int) -> mx.array:
    """``(B, C, H, ...)`` to float32 ``(B, H * repeat, C, ...)``, each head repeated ``repeat`` times in place."""
    if repeat > 1:
        x = mx.repeat(x, repeat, axis=2)
    return mx.swapaxes(x.astype(mx.float32), 1, 2)


def _blocks(x: mx.array, block: int) -> mx.array:
    """``(B, H, N, ...)`` to ``(B, H, N / block, block, ...)``, ``N`` padded with zeros to a multiple of ``block``.

    Zeros are tokens that change nothing: no key, no query, no write (``beta`` 0), no decay (log-gate 0).
    """
    pad = -x.shape[2] % block
    if pad:
        x = mx.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
    return x.reshape(*x.shape[:2], -1, block, *x.shape[3:])


def _across_blocks(
    m0: mx.array, u: mx.array, wk: mx.array, kt: mx.array, end: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """The recurrence from block to block, the only part of a chunk computed block after block, three ops each.

    From ``M_0`` (``m0``, ``(B, H, Dk, Dv)``): a block's corrections ``W = U - W~ M_c``, then
    ``M_{c+1} = G_L M_c + K^' W`` (``kt`` is ``K^'``, ``end`` is ``G_L``). Returns the state at each block's start
    and the corrections, for every block (``(B, H, blocks, Dk, Dv)``, ``(B, H, blocks, L, Dv)``), and the state
    after the last block.
    """
    n = u.shape[2]
    m = m0[:, :, None]
    starts, corrections = [], []
    for u_c, wk_c, kt_c, end_c in zip(*(mx.split(x, n, axis=2) for x in (u, wk, kt, end))):
        w = mx.addmm(u_c, wk_c, m, alpha=-1.0)
        starts.append(m)
        corrections.append(w)
        m = mx.addmm(end_c * m, kt_c, w)
    return mx.concatenate(starts, axis=2), mx.concatenate(corrections, axis=2), m[:, :, 0]


def _chunk_parallel(state: mx.array, xs: tuple[mx.array, ...], *, block: int) -> tuple[mx.array, mx.array]:
    """One chunk of the gated delta rule in its chunkwise-parallel form, in blocks of ``block`` tokens (see the
    module): the state after the chunk and the chunk's outputs, as mlx-lm's per-token ``gated_delta_ops``
    computes them."""
    q, k, v, log_g, beta = xs
    size = min(block, q.shape[1])
    repeat = v.shape[2] // q.shape[2]
    qh, kh = _blocks(_heads_first(q, repeat), size), _blocks(_heads_first(k, repeat), size)  # (B, H, n, L, Dk)
    vh = _blocks(_heads_first(v, 1), size)  # (B, H, n, L, Dv)
    bh = _blocks(mx.swapaxes(beta.astype(mx.float32), 1, 2)[..., None], size)  # (B, H, n, L, 1)
    lg = _blocks(mx.swapaxes(log_g.astype(mx.float32), 1, 2), size)  # (B, H, n, L) or (B, H, n, L, Dk)
    strict = mx.arange(size)[:, None] > mx.arange(size)[None, :]
    decay = mx.exp(_segment_sums(lg, axis=3))  # G_t / G_i in each block, zero above the diagonal
    start = mx.exp(mx.cumsum(lg, axis=3))  # G_t
    if lg.ndim == 4:  # one gate per head: (B, H, n, L, L)
        a = mx.where(strict, bh * decay * (kh @ mx.swapaxes(kh, -1, -2)), 0.0)
        p = decay * (qh @ mx.swapaxes(kh, -1, -2))
        start = start[..., None]  # (B, H, n, L, 1)
        tail = decay[..., -1, :, None]  # G_L / G_i, (B, H, n, L, 1)
    else:  # one gate per key dimension, the decays diagonal: (B, H, n, L, L, Dk)
        a = mx.where(strict, bh * mx.einsum("bhctd,bhcid,bhctid->bhcti", kh, kh, decay), 0.0)
        p = mx.einsum("bhctd,bhcid,bhctid->bhcti", qh, kh, decay)
        tail = decay[..., -1, :, :]  # (B, H, n, L, Dk)
    end = mx.swapaxes(start[..., -1:, :], -1, -2)  # G_L, (B, H, n, 1, 1) or (B, H, n, Dk, 1): scales M's key rows
    solve = _unit_lower_inverse(a)
    u = solve @ (bh * vh)  # W = U - W~ M_c: the corrections each token writes, from the block's start M_c
    wk = solve @ (bh * start * kh)
    kt = mx.swapaxes(tail * kh, -1, -2)  # K^', (B, H, n, Dk, L)
    starts, w, m = _across_blocks(mx.swapaxes(state, -1, -2), u, wk, kt, end)
    y = mx.addmm((start * qh) @ starts, p, w)  # (B, H, n, L, Dv)
    y = y.reshape(*y.shape[:2], -1, y.shape[-1])[:, :, : q.shape[1]]
    return mx.swapaxes(m, -1, -2), mx.swapaxes(y, 1, 2).astype(q.dtype)


def _chunk_per_token(state: mx.array, xs: tuple[mx.array, ...]) -> tuple[mx.array, mx.array]:
    """One chunk by mlx-lm's own per-token ``gated_delta_ops`` (masks): the state after it and its outputs."""
    q, k, v, log_g, beta, mask = xs
    y, new_state = gated_delta_ops(q, k, v, mx.exp(log_g), beta, state, mask)
    return new_state.astype(state.dtype), y


def _kernel_forward(kernel: Kernel) -> Callable[[mx.array, tuple[mx.array, ...]], tuple[mx.array, mx.array]]:
    """The whole scan by ``kernel`` (of mlx-lm's ``gated_delta_kernel`` signature), as ``nv.scan``'s ``forward``."""

    def forward(state: mx.array, xs: tuple[mx.array, ...]) -> tuple[mx.array, mx.array]:
        q, k, v, log_g, beta, *mask = xs
        y, new_state = kernel(q, k, v, mx.exp(log_g), beta, state, mask[0] if mask else None)
        return new_state.astype(state.dtype), y

    return forward


def _kernel_applies(k: mx.array) -> bool:
    """Where mlx-lm's ``gated_delta_update`` runs its Metal kernel (``use_kernel`` aside)."""
    dk = k.shape[-1]
    return mx.default_device() == mx.gpu and mx.metal.is_available() and dk >= 32 and dk % 32 == 0


def _check(
    q: object, k: object, v: object, a: object, b: object, a_log: object, dt_bias: object, state: object, mask: object
) -> None:
    """mlx-lm's shapes, or ``TypeError``/``ValueError`` naming the argument."""
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("A_log", a_log), ("dt_bias", dt_bias)):
        if not isinstance(x, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(x).__name__}")
    for name, x in (("state", state), ("mask", mask)):
        if x is not None and not isinstance(x, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array or None, got {type(x).__name__}")
    assert isinstance(q, mx.array) and isinstance(k, mx.array) and isinstance(v, mx.array)  # checked above
    assert isinstance(a, mx.array) and isinstance(b, mx.array)
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must have one shape (B, T, Hk, Dk), got q {tuple(q.shape)}, k {tuple(k.shape)}")
    batch, length, hk, dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (batch, length) or v.shape[2] % hk:
        raise ValueError(f"v must be (B, T, Hv, Dv) with Hv a multiple of q's {hk} heads, got {tuple(v.shape)}")
    hv, dv = v.shape[2:]
    if tuple(b.shape) != (batch, length, hv):
        raise ValueError(f"b must be (B, T, Hv) = {(batch, length, hv)}, got {tuple(b.shape)}")
    if tuple(a.shape) not in ((batch, length, hv), (batch, length, hv, dk)):
        raise ValueError(f"a must be (B, T, Hv) or (B, T, Hv, Dk) = {(batch, length, hv, dk)}, got {tuple(a.shape)}")
    if state is not None and tuple(state.shape) != (batch, hv, dv, dk):  # type: ignore[attr-defined]
        raise ValueError(f"state must be (B, Hv, Dv, Dk) = {(batch, hv, dv, dk)}, got {tuple(state.shape)}")  # type: ignore[attr-defined]
    if mask is not None and tuple(mask.shape) != (batch, length):  # type: ignore[attr-defined]
        raise ValueError(f"mask must be (B, T) = {(batch, length)}, got {tuple(mask.shape)}")  # type: ignore[attr-defined]


def make_gated_delta_update(
    *, chunk: int | None = None, block: int | None = None, kernel: Kernel | str | None = "auto"
) -> Callable[..., Any]:
    """:func:`gated_delta_update` with another chunk or block size or kernel.

    Args:
        chunk: tokens per chunk of the scan (the last may be shorter): the forward pass keeps one state per
            chunk, the backward pass recomputes one chunk at a time; ``None`` for :data:`DEFAULT_CHUNK` with one
            gate per head, :data:`DEFAULT_VECTOR_CHUNK` with vector gates.
        block: tokens per block of the chunkwise-parallel form inside a chunk (at most the chunk; the last
            may be shorter), and per chunk of the per-token form (with a mask) where smaller than ``chunk``;
            ``None`` for :data:`DEFAULT_BLOCK` with one gate per head, :data:`DEFAULT_VECTOR_BLOCK` with vector
            gates.
        kernel: the fused forward for ``use_kernel=True``: ``"auto"`` for
            mlx-lm's ``gated_delta_kernel`` where mlx-lm runs it (Metal, on the
            GPU, key size a multiple of 32); a function with its signature
            ``(q, k, v, g, beta, state, mask) -> (y, state)``, used whenever
            ``use_kernel`` is true; ``None`` for never.

    Returns:
        A function with the signature and contract of :func:`gated_delta_update`.

    Example:
        >>> update = make_gated_delta_update(chunk=1024, block=32)
        >>> y, state = update(q, k, v, a, b, A_log, dt_bias)
    """
    for name, value in (("chunk", chunk), ("block", block)):
        if value is not None:
            _validate.check_int(value, name, minimum=1)
    if kernel is not None and kernel != "auto" and not callable(kernel):
        raise TypeError(f"kernel must be 'auto', None or a function like mlx-lm's gated_delta_kernel, got {kernel!r}")

    def update(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        a: mx.array,
        b: mx.array,
        A_log: mx.array,  # noqa: N803 - mlx-lm's name
        dt_bias: mx.array,
        state: mx.array | None = None,
        mask: mx.array | None = None,
        *,
        use_kernel: bool = True,
        lower_bound: float | None = None,
        allow_neg_eigval: bool = False,
    ) -> tuple[mx.array, mx.array]:
        _check(q, k, v, a, b, A_log, dt_bias, state, mask)
        beta = mx.sigmoid(b)
        if allow_neg_eigval:
            beta = beta * 2.0
        # mlx-lm's gates (compute_g, compute_lower_bound_g), kept as logarithms: exact where g underflows.
        if lower_bound is None:
            log_g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)
        else:
            log_g = lower_bound * mx.sigmoid(mx.exp(A_log.astype(mx.float32)) * (a.astype(mx.float32) + dt_bias))
        batch, _, _, dk = q.shape
        hv, dv = v.shape[2:]
        init = mx.zeros((batch, hv, dv, dk), dtype=mx.float32) if state is None else state.astype(mx.float32)
        xs: tuple[mx.array, ...] = (q, k, v, log_g, beta) if mask is None else (q, k, v, log_g, beta, mask)
        fused = kernel if kernel != "auto" else (gated_delta_kernel if _kernel_applies(k) else None)
        forward = _kernel_forward(fused) if use_kernel and callable(fused) else None
        chunk_size = chunk if chunk is not None else DEFAULT_CHUNK if a.ndim == 3 else DEFAULT_VECTOR_CHUNK
        block_size = block if block is not None else DEFAULT_BLOCK if a.ndim == 3 else DEFAULT_VECTOR_BLOCK
        if mask is None:
            step: Callable[..., tuple[mx.array, mx.array]] = functools.partial(_chunk_parallel, block=block_size)
        else:  # each token's slices have a vjp the size of their chunk: chunks of a block at most
            step, chunk_size = _chunk_per_token, min(chunk_size, block_size)
        new_state, y = scan(step, init, xs, chunk=chunk_size, axis=1, forward=forward)
        return y, new_state

    functools.update_wrapper(update, gated_delta_update)
    return update


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,  # noqa: N803 - mlx-lm's name
    dt_bias: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    use_kernel: bool = True,
    lower_bound: float | None = None,
    allow_neg_eigval: bool = False,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``gated_delta_update``, computed in checkpointed chunks (see the module).

    The same contract as ``mlx_lm.models.gated_delta.gated_delta_update``:
    callers normalise ``q`` and ``k`` (``normalize_qk``, which folds the readout
    scale into ``q``); ``beta = sigmoid(b)`` (times 2 with
    ``allow_neg_eigval``); the gate ``g = exp(-exp(A_log) softplus(a + dt_bias))``,
    or with ``lower_bound`` ``exp(lower_bound sigmoid(exp(A_log) (a + dt_bias)))``,
    one per head (``a`` of ``(B, T, Hv)``) or per head and key dimension
    (``(B, T, Hv, Dk)``); the state ``(B, Hv, Dv, Dk)``, zeros if ``None``,
    returned in float32. Values are those of mlx-lm's ``gated_delta_ops`` up to
    the order of float32 sums; gradients too, for every input and the initial
    state. A ``mask`` (``(B, T)``, mlx-lm's padding mask) is computed with the
    per-token form chunk by chunk.

    Args:
        q, k: ``(B, T, Hk, Dk)`` queries and keys.
        v: ``(B, T, Hv, Dv)`` values, ``Hv`` a multiple of ``Hk``.
        a, b: the gate's and the write strength's logits.
        A_log, dt_bias: the gate's parameters.
        state: ``(B, Hv, Dv, Dk)`` or ``None``.
        mask: ``(B, T)`` booleans or ``None``.
        use_kernel: on Metal (GPU), run mlx-lm's fused kernel for the forward
            pass; the backward pass recomputes the chunks with the
            differentiable form. Elsewhere it changes nothing.
        lower_bound, allow_neg_eigval: as mlx-lm's.

    Returns:
        ``(y, state)``: ``(B, T, Hv, Dv)`` outputs in ``q``'s dtype, and the state after the last token.

    Example:
        >>> monkeypatch.setattr(mlx_lm.models.qwen3_5, "gated_delta_update", gated_delta_update)
    """
    return _default(
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        state,
        mask,
        use_kernel=use_kernel,
        lower_bound=lower_bound,
        allow_neg_eigval=allow_neg_eigval,
    )


_default = make_gated_delta_update()
