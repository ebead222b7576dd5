"""The largest sequence length whose training step fits a memory, found by measuring.

A step *fits* ``memory`` bytes when what it holds between steps (the model's
parameters and the optimizer's state) plus its measured peak above that stays
within ``memory``. The search measures steps, it does not extrapolate: from
the first length it doubles while steps fit (up to a cap), then bisects
between the last length that fit and the first that did not, in steps of
``granularity`` tokens. It assumes that the peak grows with the length.
"""

from __future__ import annotations

from collections.abc import Callable


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
