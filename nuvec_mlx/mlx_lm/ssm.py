"""mlx-lm's state-space scan (Mamba-2's SSD), trained in checkpointed chunks: :func:`ssm_update`.

mlx-lm's ``mamba2``, ``granitemoehybrid``, ``falcon_h1``, ``nemotron_h`` and
``plamo2`` call ``mlx_lm.models.ssm.ssm_update``, which for a sequence runs
``ssm_attn``: already chunkwise parallel (chunks of 256 tokens, each a
(chunk x chunk) "attention" matrix per head, the state carried between
chunks), but differentiated by MLX as one graph, so that every chunk's
matrices and decays stay alive for the backward pass, and each chunk's slice
of the inputs has a vjp of the whole input's size.

:func:`ssm_update` has mlx-lm's signature and contract and runs the same
``ssm_attn`` one chunk at a time through :func:`nuvec_mlx.scan`: only each
chunk's starting state is kept, each chunk is recomputed in the backward
pass, the gradients of ``A_log``, ``D`` and ``dt_bias`` are summed over the
chunks. Values are ``ssm_attn``'s up to the order of float sums (bitwise
with ``chunk=256``, its own step); the default chunk is smaller, since a
chunk's matrices grow with its square. The paths mlx-lm takes for inference are its own: one token
with a state on Metal (its kernel, which has no vjp), and ``lengths`` (the
padded batches of its cache).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

try:
    from mlx_lm.models import ssm as mlx_lm_ssm
except ImportError as e:  # pragma: no cover - the extra is installed where this runs
    raise ImportError('nuvec_mlx.mlx_lm needs mlx-lm: pip install "nuvec-mlx[mlx-lm]"') from e

from .. import _validate
from ..scan import scan

__all__ = ["DEFAULT_CHUNK", "make_ssm_update", "ssm_update"]

#: Tokens per chunk: each chunk's decay and "attention" matrices are (chunk x chunk) per head, so a smaller
#: chunk than mlx-lm's 256 lowers both the peak and the time of a step; 256 gives ``ssm_attn``'s values bitwise.
DEFAULT_CHUNK = 64


def _check(hidden_states: object, B: object, C: object, dt: object, state: object, mask: object) -> None:  # noqa: N803
    for name, x in (("hidden_states", hidden_states), ("B", B), ("C", C), ("dt", dt)):
        if not isinstance(x, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(x).__name__}")
    for name, x in (("state", state), ("mask", mask)):
        if x is not None and not isinstance(x, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array or None, got {type(x).__name__}")
    assert isinstance(hidden_states, mx.array) and isinstance(B, mx.array) and isinstance(C, mx.array)
    assert isinstance(dt, mx.array)
    if hidden_states.ndim != 4:
        raise ValueError(f"hidden_states must be (batch, length, heads, head_dim), got {tuple(hidden_states.shape)}")
    batch, length, heads, head_dim = hidden_states.shape
    for name, x in (("B", B), ("C", C)):
        if x.ndim != 4 or x.shape[:2] != (batch, length) or heads % x.shape[2]:
            raise ValueError(
                f"{name} must be (batch, length, groups, state_size) with groups dividing the {heads} heads, "
                f"got {tuple(x.shape)}"
            )
    if tuple(dt.shape) != (batch, length, heads):
        raise ValueError(f"dt must be (batch, length, heads) = {(batch, length, heads)}, got {tuple(dt.shape)}")
    if state is not None and tuple(state.shape) != (batch, heads, head_dim, B.shape[-1]):  # type: ignore[attr-defined]
        raise ValueError(
            f"state must be (batch, heads, head_dim, state_size) = {(batch, heads, head_dim, B.shape[-1])}, "
            f"got {tuple(state.shape)}"  # type: ignore[attr-defined]
        )
    if mask is not None and tuple(mask.shape) != (batch, length):  # type: ignore[attr-defined]
        raise ValueError(f"mask must be (batch, length) = {(batch, length)}, got {tuple(mask.shape)}")  # type: ignore[attr-defined]


def make_ssm_update(*, chunk: int = DEFAULT_CHUNK) -> Callable[..., Any]:
    """:func:`ssm_update` in chunks of ``chunk`` tokens (mlx-lm's ``ssm_attn`` step for each).

    Example:
        >>> update = make_ssm_update(chunk=128)
    """
    _validate.check_int(chunk, "chunk", minimum=1)

    def update(
        hidden_states: mx.array,
        A_log: mx.array,  # noqa: N803 - mlx-lm's names
        B: mx.array,  # noqa: N803
        C: mx.array,  # noqa: N803
        D: mx.array,  # noqa: N803
        dt: mx.array,
        dt_bias: mx.array,
        state: mx.array | None = None,
        time_step_limit: tuple[float, float] = (0.001, 100.0),
        mask: mx.array | None = None,
        lengths: mx.array | None = None,
    ) -> tuple[mx.array, mx.array]:
        _check(hidden_states, B, C, dt, state, mask)
        batch, length, heads, head_dim = hidden_states.shape
        if lengths is not None or length == 1:  # mlx-lm's inference paths: a cache's lengths, one token
            return mlx_lm_ssm.ssm_update(
                hidden_states, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths
            )
        init = mx.zeros((batch, heads, head_dim, B.shape[-1]), mx.float32) if state is None else state

        def step(s: mx.array, xs: tuple[mx.array, ...]) -> tuple[mx.array, mx.array]:
            x, b, c, delta, a_log, d, bias, *m = xs
            y, new = mlx_lm_ssm.ssm_attn(
                x, a_log, b, c, d, delta, bias, s, time_step_limit, mask=m[0] if m else None, step=x.shape[1]
            )
            return new.astype(s.dtype), y

        xs = (hidden_states, B, C, dt, A_log, D, dt_bias) + (() if mask is None else (mask,))
        axes = (1, 1, 1, 1, None, None, None) + (() if mask is None else (1,))
        new_state, y = scan(step, init, xs, chunk=chunk, axis=axes)
        return y, new_state

    functools.update_wrapper(update, ssm_update)
    return update


def ssm_update(
    hidden_states: mx.array,
    A_log: mx.array,  # noqa: N803 - mlx-lm's names
    B: mx.array,  # noqa: N803
    C: mx.array,  # noqa: N803
    D: mx.array,  # noqa: N803
    dt: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    time_step_limit: tuple[float, float] = (0.001, 100.0),
    mask: mx.array | None = None,
    lengths: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``ssm_update``, a sequence computed in checkpointed chunks of mlx-lm's ``ssm_attn`` (see the module).

    Args:
        hidden_states: ``(batch, length, heads, head_dim)``.
        A_log, D, dt_bias: per head; read whole by every chunk.
        B, C: ``(batch, length, groups, state_size)``.
        dt: ``(batch, length, heads)``.
        state: ``(batch, heads, head_dim, state_size)`` or ``None`` (zeros).
        time_step_limit, mask, lengths: as mlx-lm's (``lengths``: its own path).

    Returns:
        ``(y, state)`` as mlx-lm's: ``y`` in ``hidden_states``'s dtype, the state after the last token.

    Example:
        >>> monkeypatch.setattr(mlx_lm.models.mamba2, "ssm_update", ssm_update)
    """
    return _default(hidden_states, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths)


_default = make_ssm_update()
