"""How the MLX side measures: its peak probe, its cases with their parts, every rank's peak.

A peak is read with :func:`nuvec_mlx.memory.measure`: after
:func:`mlx.core.synchronize`, with MLX's buffer cache cleared first, as bytes
above the memory active before the step. A time is one warm step, from
dispatch to :func:`mlx.core.synchronize`, averaged over back-to-back steps
where a step is short (:func:`~nuvec_mlx_bench.core.rounds.seconds`). Cases run
round-robin (:func:`~nuvec_mlx_bench.core.rounds.measure`); :func:`split`
times a case's dispatch and evaluation apart.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx
from tqdm import tqdm

import nuvec_mlx as nv

from . import rounds

#: What the parts of a step are, as the results describe them.
PARTS = (
    "dispatch: the host building and dispatching the step (the call of the compiled step); "
    "evaluation: its evaluation until the results are computed (mx.eval, or nv.eval's stages); "
    "means per step over each timed repeat's steps"
)


class MlxProbe:
    """MLX's allocator: the peak above the memory active at ``start``, cache cleared first.

    Example:
        >>> rounds.peak(lambda: mx.ones((1024,)), mx.eval, MlxProbe())
        4096
    """

    method = (
        "nuvec_mlx.memory.measure(clear_cache=True): MLX's peak memory after mx.synchronize(), "
        "above the memory active before the step"
    )

    def __init__(self) -> None:
        self.notes: dict[str, Any] = {}
        self._open = contextlib.ExitStack()
        self._measurement: nv.memory.Measurement | None = None

    def start(self) -> None:
        self._measurement = self._open.enter_context(nv.memory.measure(clear_cache=True))

    def stop(self) -> int:
        self._open.close()
        assert self._measurement is not None, "stop() before start()"
        return self._measurement.rise

    def done(self) -> None:
        pass


def finished(evaluate: Callable[[Any], None]) -> Callable[[Any], None]:
    """``evaluate``, then wait until the device has finished (what a time must include)."""

    def finish(outputs: Any) -> None:
        evaluate(outputs)
        mx.synchronize()

    return finish


def split(
    step: rounds.Step, evaluate: Callable[[Any], None], parts: rounds.Parts
) -> tuple[rounds.Step, Callable[[Any], None]]:
    """``step`` and ``evaluate``, each call's dispatch (the step) and evaluation timed into ``parts``.

    Example:
        >>> parts = rounds.Parts()
        >>> step, evaluate = split(lambda: sc.step(sc.inputs), sc.evaluate, parts)
    """
    pending: list[float] = []

    def dispatch() -> Any:
        begin = time.perf_counter()
        outputs = step()
        pending.append(time.perf_counter() - begin)
        return outputs

    def evaluation(outputs: Any) -> None:
        begin = time.perf_counter()
        evaluate(outputs)
        parts.add(dispatch=pending.pop(), evaluation=time.perf_counter() - begin)

    return dispatch, evaluation


def run_cases(
    cases: Mapping[Any, tuple[rounds.Step, Callable[[Any], None]]],
    repeats: int,
    desc: str = "cases",
    parts: Mapping[Any, rounds.Parts] | None = None,
) -> dict[Any, dict[str, Any]]:
    """Measure MLX cases round-robin in this process, with a progress bar.

    Args:
        cases: name to ``(step, evaluate)``; ``evaluate`` need not synchronize.
        repeats: peaks and times per case.
        desc: the progress bar's label.
        parts: name to the :class:`~nuvec_mlx_bench.core.rounds.Parts` its case adds to.

    Returns:
        name to :func:`~nuvec_mlx_bench.core.rounds.measured`'s dict.

    Example:
        >>> run_cases({"ones": (lambda: mx.ones((1024,)), mx.eval)}, repeats=3)["ones"]["peak"]["median"]
        4096
    """
    with tqdm(total=len(cases) * (2 * repeats + 1), desc=desc, unit="step") as bar:
        return rounds.measure(
            {name: (step, finished(evaluate)) for name, (step, evaluate) in cases.items()},
            repeats,
            MlxProbe(),
            progress=bar.update,
            parts=parts,
        )


def add_rank_peaks(results: Mapping[Any, dict]) -> Mapping[Any, dict]:
    """Under ``mx.distributed`` with several processes, add every rank's median peak.

    MLX's counters are per process; each result (a dict with ``peak``'s
    ``median``) gets ``peak_per_rank`` (rank 0 first) from one
    ``all_gather``, a collective every rank reaches in the same order. In a
    single process, ``results`` is returned as it is.
    """
    group = mx.distributed.init()
    if group.size() == 1 or not results:
        return results
    mine = mx.array([r["peak"]["median"] for r in results.values()], dtype=mx.int64)
    every = mx.distributed.all_gather(mine, group=group).reshape(group.size(), -1)
    for j, r in enumerate(results.values()):
        r["peak_per_rank"] = every[:, j].tolist()
    return results
