"""A step's peak against the sequence length: the largest length that fits a memory, and what grows how.

A step *fits* ``memory`` bytes when what it holds between steps (the model's
parameters and the optimizer's state) plus its measured peak above that stays
within ``memory``. :func:`largest_fitting` measures steps, it does not
extrapolate: from the first length it doubles while steps fit (up to a cap),
then bisects between the last length that fit and the first that did not, in
steps of ``granularity`` tokens. It assumes that the peak grows with the
length. :func:`growth` fits ``peak = constant + per_token x T + per_token² x T²``
to measured peaks, to show what grows with the length and what with its square
(attention's scores, where MLX trains attention unfused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np


def largest_fitting(fits: Callable[[int], bool], start: int, granularity: int, cap: int) -> int:
    """The largest multiple of ``granularity`` up to ``cap`` for which ``fits`` holds (0 if none).

    Args:
        fits: measures a step at a sequence length and says whether it fitted.
        start: the first length tried (rounded down to a multiple of ``granularity``).
        granularity: the lengths tried are multiples of it.
        cap: the largest length tried.

    Example:
        >>> largest_fitting(lambda seq: seq * 2 <= 1000, start=256, granularity=64, cap=4096)
        448
    """
    for name, value in (("start", start), ("granularity", granularity), ("cap", cap)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    cap -= cap % granularity
    if cap < granularity:
        raise ValueError(f"cap must be at least the granularity {granularity}, got {cap}")
    seq = min(max(start - start % granularity, granularity), cap)
    if fits(seq):
        good, bad = seq, None
        while bad is None and good < cap:
            trial = min(2 * good, cap)
            good, bad = (trial, None) if fits(trial) else (good, trial)
        if bad is None:
            return good
    else:
        good, bad = 0, seq
    while bad - good > granularity:
        mid = (good + bad) // 2
        mid -= mid % granularity
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def growth(peaks: Mapping[int, float]) -> dict[str, float] | None:
    """The least-squares fit ``peak = constant + per_token x T + per_token_squared x T²`` over the lengths.

    Args:
        peaks: sequence length ``T`` to the peak measured there (bytes, or any unit).

    Returns:
        ``constant``, ``per_token`` and ``per_token_squared`` (the peak's units
        per token and per token squared), and ``max_residual``, the largest
        distance of a measured peak from the fit; ``None`` with fewer than three lengths.

    Example:
        >>> growth({512: 10 + 512 + 512**2, 1024: 10 + 1024 + 1024**2, 2048: 10 + 2048 + 2048**2})["per_token"]
        1.0...
    """
    if len(peaks) < 3:
        return None
    t = np.array(sorted(peaks), dtype=np.float64)
    y = np.array([peaks[int(s)] for s in t], dtype=np.float64)
    scale = t.max()  # fitted in units of the longest length, so that T² stays well conditioned
    basis = np.stack([np.ones_like(t), t / scale, (t / scale) ** 2], axis=1)
    (c0, c1, c2), *_ = np.linalg.lstsq(basis, y, rcond=None)
    fitted = basis @ np.array([c0, c1, c2])
    return {
        "constant": float(c0),
        "per_token": float(c1 / scale),
        "per_token_squared": float(c2 / scale**2),
        "max_residual": float(np.abs(y - fitted).max()),
    }
