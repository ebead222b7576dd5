"""How the benchmarks measure: peaks, step times, summaries and the environment.

A peak is read with :func:`nuvec_mlx.memory.measure`: after
:func:`mlx.core.synchronize`, with MLX's buffer cache cleared first, as bytes
above the memory active before the step. A time is one warm step, from
dispatch to :func:`mlx.core.synchronize`, averaged over back-to-back steps
where a step is short (:mod:`benchmarks.timing`). Cases are run round-robin, one
repeat of every case before the next, so that a slow spell of a shared
machine falls on all of them alike.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

import nuvec_mlx as nv
from nuvec_mlx_bench import timing

MiB = 1 << 20
#: How the results describe a time.
TIMES = (f"warm steps until `mx.synchronize()`, each the mean of back-to-back steps that fill "
         f"{timing.MIN_SECONDS:g} s (a single step where one takes longer)")

#: One step: dispatches its work and returns what must be evaluated.
Step = Callable[[], object]
#: Evaluates a step's outputs.
Evaluate = Callable[[object], None]


def peak(step: Step, evaluate: Evaluate) -> int:
    """Peak bytes of one step above the memory active before it, cache cleared first."""
    with nv.memory.measure(clear_cache=True) as m:
        outputs = step()
        evaluate(outputs)
        del outputs
    return m.peak


def seconds(step: Step, evaluate: Evaluate) -> float:
    """Wall time of one step with a warm cache, until the device has finished it."""

    def run() -> None:
        evaluate(step())
        mx.synchronize()

    mx.synchronize()
    return timing.seconds(run)


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_cases(
    cases: dict[str, tuple[Step, Evaluate]], repeats: int, desc: str = "cases"
) -> dict[str, dict[str, dict[str, float]]]:
    """Measure every case ``repeats`` times, round-robin, after one warm-up step each.

    Args:
        cases: name to ``(step, evaluate)``.
        repeats: measurements per case (a peak and a time each).
        desc: the progress bar's label.

    Returns:
        name to ``{"peak": summary, "time": summary}``.

    Example:
        >>> run_cases({"ones": (lambda: mx.ones((1024,)), mx.eval)}, repeats=3)
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    peaks = {name: [] for name in cases}
    times = {name: [] for name in cases}
    with tqdm(total=len(cases) * (repeats + 1), desc=desc, unit="step") as bar:
        for step, evaluate in cases.values():
            evaluate(step())  # compile and warm up
            bar.update()
        for _ in range(repeats):
            for name, (step, evaluate) in cases.items():
                peaks[name].append(peak(step, evaluate))
                times[name].append(seconds(step, evaluate))
                bar.update()
    results = {n: {"peak": summary(peaks[n]), "time": summary(times[n])} for n in cases}
    return add_rank_peaks(results)


def add_rank_peaks(results: dict[str, dict]) -> dict[str, dict]:
    """Under ``mx.distributed`` with several processes, add every rank's median peak.

    MLX's counters are per process; each case gets ``peak_per_rank`` (rank 0
    first) from one ``all_gather``, a collective every rank reaches in the same
    order. In a single process, ``results`` is returned as it is.
    """
    group = mx.distributed.init()
    if group.size() == 1 or not results:
        return results
    mine = mx.array([r["peak"]["median"] for r in results.values()], dtype=mx.int64)
    every = mx.distributed.all_gather(mine, group=group).reshape(group.size(), -1)
    for j, r in enumerate(results.values()):
        r["peak_per_rank"] = every[:, j].tolist()
    return results


def parse_budget(text: str) -> float:
    """A budget from the command line: MiB (``"0"``, ``"64"``, ``"0.5"``) or ``"inf"``, in bytes."""
    if text == "inf":
        return math.inf
    mib = float(text)
    if not mib >= 0:
        raise ValueError(f"a budget must be 'inf' or MiB >= 0, got {text!r}")
    return int(mib * MiB)


def budget_text(nbytes: float) -> str:
    """A budget as the results print it."""
    return "inf (nv.eval runs mx.eval)" if nbytes == math.inf else f"{nbytes / MiB:g} MiB"


def blas() -> str:
    """The BLAS MLX's CPU backend uses: the BLAS libraries mapped into this process
    from MLX's own packages (NumPy's OpenBLAS, also mapped, is not MLX's)."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        maps = Path("/proc/self/maps").read_text().split("\n")
    except OSError:
        return "unknown"
    paths = {Path(line.split()[-1]) for line in maps if "blas" in line.lower()}
    mlx_libs = sorted(p.name for p in paths if any(part.startswith("mlx") for part in p.parts))
    if mlx_libs:
        return ", ".join(mlx_libs) + " (bundled with the mlx wheel)"
    return ", ".join(sorted(p.name for p in paths)) or "unknown"


def environment() -> dict[str, str]:
    """Where the figures came from: command, MLX, backend, device, BLAS, Python, date."""
    on_cpu = mx.default_device() == mx.cpu
    return {
        "command": " ".join(["python", *sys.argv]),
        "mlx": mx.__version__,
        "nuvec_mlx": nv.__version__,
        "backend": "cpu" if on_cpu else ("cuda" if mx.cuda.is_available() else "metal"),
        "device": mx.device_info().get("device_name", platform.machine()),
        "cpu_count": str(os.cpu_count()),
        "blas": blas() if on_cpu else "n/a (GPU)",
        "MLX_MAX_OPS_PER_BUFFER": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "unset (MLX default)"),
        "ranks": str(mx.distributed.init().size()),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
