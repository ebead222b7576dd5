"""The largest batch or sequence length whose step fits a memory budget: measured, extrapolated, verified.

:func:`largest_fit` measures the step's peak at a few small sizes, fits
``peak(size) = a + b·size + c·size²`` to every size measured, by least squares
(activations grow linearly with the batch, attention scores with the square
of the sequence; all the sizes, since close ones differ by less than their
noise on a busy machine), solves it for the budget, and measures the step
at the answer. Each measurement narrows the bracket between the largest size
measured to fit and the smallest measured not to, and refits, until the
bracket is within ``tolerance`` of the answer (or ``tries`` runs out). The
answer is always a size that was measured to fit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from .. import _validate
from .._units import MiB
from ..nn import find_layers
from ..policies import save_nothing
from ..step import TrainingStep
from . import _trial


@dataclasses.dataclass
class Fit:
    """What :func:`largest_fit` found.

    Attributes:
        size: the largest size measured to fit (0 if none did).
        budget: the budget, bytes.
        predicted: the size the first extrapolation gave.
        below: the smallest size measured not to fit (``None`` if none was).
        peaks: every size measured and its peak, in the order measured.
    """

    size: int
    budget: int
    predicted: int
    below: int | None
    peaks: list[tuple[int, int]]

    def __str__(self) -> str:
        lines = [
            f"largest size that fits {self.budget / MiB:.1f} MiB: {self.size} "
            f"(first extrapolation {self.predicted}; "
            + (f"{self.below} measured not to fit)" if self.below else "no size measured not to fit)"),
            f"{'size':>8} {'peak MiB':>9} fits",
        ]
        lines += [f"{s:>8} {p / MiB:>9.1f} {'yes' if p <= self.budget else 'no'}" for s, p in self.peaks]
        return "\n".join(lines)


def _quadratic(points: Sequence[tuple[int, int]]) -> Callable[[float], float]:
    """The least-squares parabola through the (size, peak) points (through three, the parabola itself), or
    the least-squares line where the parabola would bend down (one point: the line through zero).

    All the points measured, not the last few: peaks measured a few sizes apart near the budget differ by
    less than their noise on a busy machine, and a curve through those alone can bend anywhere."""
    if len(points) == 1:
        (x0, y0), *_ = points
        return lambda s: y0 * s / x0
    top = max(x for x, _ in points)  # sizes scaled to at most 1: the sums stay well conditioned
    us, ys = [x / top for x, _ in points], [float(y) for _, y in points]
    if len(points) >= 3:
        sums = [sum(u**k for u in us) for k in range(5)]
        rhs = [sum(y * u**k for u, y in zip(us, ys)) for k in range(3)]
        a, b, c = _solve3([[sums[i + j] for j in range(3)] for i in range(3)], rhs)
        if c >= 0:
            return lambda s: a + b * (s / top) + c * (s / top) ** 2
    n, su, suu = len(us), sum(us), sum(u * u for u in us)
    sy, suy = sum(ys), sum(u * y for u, y in zip(us, ys))
    slope = (n * suy - su * sy) / (n * suu - su * su)
    level = (sy - slope * su) / n
    return lambda s: level + slope * (s / top)


def _solve3(m: list[list[float]], rhs: list[float]) -> tuple[float, float, float]:
    """``x`` with ``m @ x == rhs`` for a 3 x 3 ``m`` (Cramer's rule)."""

    def det(q: list[list[float]]) -> float:
        return (
            q[0][0] * (q[1][1] * q[2][2] - q[1][2] * q[2][1])
            - q[0][1] * (q[1][0] * q[2][2] - q[1][2] * q[2][0])
            + q[0][2] * (q[1][0] * q[2][1] - q[1][1] * q[2][0])
        )

    whole = det(m)
    x0, x1, x2 = (det([[rhs[i] if j == k else m[i][j] for j in range(3)] for i in range(3)]) / whole for k in range(3))
    return x0, x1, x2


#: The extrapolation goes at most this many times the largest size measured: a flat fit says little about far
#: sizes. An answer there (:func:`at_reach`) is a lower bound, not the largest size that fits.
REACH = 4


def solve(points: Sequence[tuple[int, int]], budget: int, multiple: int) -> int:
    """The largest multiple of ``multiple`` whose fitted peak is at most ``budget``, below :data:`REACH`
    times the largest size in ``points``.

    Example:
        >>> solve([(1, 110), (2, 120), (4, 140)], budget=200, multiple=1)
        10
    """
    model = _quadratic(points)
    top = max(s for s, _ in points)
    if model(top) > budget:  # the fit already overshoots: search below
        hi, lo = top, 0
    else:
        lo, hi = top, top * 2
        while model(hi) <= budget and hi < top * REACH:
            lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if model(mid) <= budget else (lo, mid)
    return lo // multiple * multiple


def at_reach(size: int, measured: int, multiple: int) -> bool:
    """Whether ``size``, an answer of :func:`solve` from sizes up to ``measured``, is as far as it extrapolates
    (:data:`REACH` times ``measured``): longer sizes may fit too.

    Example:
        >>> at_reach(solve([(1, 110), (2, 120), (4, 140)], budget=10**6, multiple=1), measured=4, multiple=1)
        True
    """
    return size + multiple >= REACH * measured


def largest_fit(
    step: TrainingStep,
    make_batch: Callable[[int], Any],
    budget: int,
    *,
    sizes: Sequence[int] = (1, 2, 4),
    multiple: int = 1,
    layers: Any = None,
    checkpoint: bool = True,
    tolerance: float = 0.02,
    tries: int = 6,
    progress: bool = True,
) -> Fit:
    """The largest batch or sequence length (``size``) whose training step fits ``budget``.

    The step is the user's (:class:`nuvec_mlx.TrainingStep`, with its own
    settings); with ``checkpoint`` (the default) every block is checkpointed
    (policy ``save_nothing``), about the smallest peak any plan reaches, so
    the answer is the largest size worth planning for (run
    :func:`nuvec_mlx.plan` at it for the cheapest plan). Each size is
    measured by two steps run as a training loop runs them (the first
    compiles; both count), not read stage by stage as :func:`nuvec_mlx.plan`
    reads its steps, which costs each step in proportion to its stages and
    memory. The model, the optimizer and MLX's random key are left as they were. Each extrapolation goes at
    most :data:`REACH` times the largest size measured so far: where the budget holds far more than the sizes
    measured and the tries run out first, ``below`` is ``None`` and the answer is a lower bound.

    Args:
        step: the training step.
        make_batch: ``size -> batch`` (the loss's arguments after the model).
        budget: bytes of MLX memory the step may peak at.
        sizes: the small sizes measured first (at least two, increasing).
        multiple: the answer is a multiple of it (a sequence length of 64s, say).
        layers: the blocks; ``None`` for ``model.layers`` or ``model.model.layers``.
        checkpoint: measure with every block checkpointed; ``False`` measures the model as it is.
        tolerance: stop once the largest size measured to fit is within this
            fraction of the smallest measured not to.
        tries: the most measurements after ``sizes`` (0: the answer is the largest of
            ``sizes`` that fits, and ``predicted`` the extrapolation alone).
        progress: show a progress bar.

    Returns:
        A :class:`Fit`; ``print(fit)`` lists every size measured.

    Example:
        >>> fit = nv.largest_fit(step, lambda t: (tokens[:, : t + 1],), 12 << 30,
        ...                      sizes=(256, 512, 1024), multiple=64)
        >>> fit.size
    """
    _trial.check_step(step)
    _validate.check_callable(make_batch, "make_batch")
    _validate.check_int(budget, "budget", minimum=1)
    _check_sizes(sizes)
    _validate.check_int(multiple, "multiple", minimum=1)
    _validate.check_bool(checkpoint, "checkpoint")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be a number between 0 and 1, got {tolerance!r}")
    _validate.check_int(tries, "tries", minimum=0)
    _validate.check_bool(progress, "progress")
    blocks = find_layers(step.model, layers)
    trial = _trial.Trial(step, blocks)
    peaks: list[tuple[int, int]] = []

    def peak(size: int) -> int:  # two steps as a loop runs them, not observed stage by stage: only the peak counts
        batch = make_batch(size)
        _trial.check_batch(batch, f"make_batch({size})", "return ")
        with trial.session(batch) as session:
            peaks.append((size, session.peak(steps=2)))
        bar.update()
        return peaks[-1][1]

    with (
        trial.restoring(),
        tqdm(total=len(sizes) + tries, desc="nv.largest_fit", unit="size", disable=not progress) as bar,
    ):
        if checkpoint:
            trial.set_modes([save_nothing] * len(blocks))
        for s in sizes:
            peak(s)
        fit = max((s for s, p in peaks if p <= budget), default=0)
        below = min((s for s, p in peaks if p > budget), default=None)
        predicted = solve(peaks, budget, multiple)
        guess = predicted
        for _ in range(tries):
            close = max(multiple, math.floor(tolerance * fit / multiple) * multiple)
            if below is not None and below - fit <= close:
                break
            # Within the bracket; above the fit by `close` at least while nothing above failed.
            guess = max(guess, fit + (multiple if below is not None else close))
            if below is not None:
                guess = min(guess, below - multiple)
            if peak(guess) <= budget:
                fit = guess
            else:
                below = guess
            guess = solve(peaks, budget, multiple)
    return Fit(fit, budget, predicted, below, peaks)


def _check_sizes(sizes: object) -> None:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise TypeError(f"sizes must be a sequence of ints, got {type(sizes).__name__}")
    for i, s in enumerate(sizes):
        _validate.check_int(s, f"sizes[{i}]", minimum=1)
    if len(sizes) < 2 or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"sizes must hold at least two increasing sizes, got {list(sizes)}")
