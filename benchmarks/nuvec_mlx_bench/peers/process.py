"""A peer's process: what it runs (``python -m nuvec_mlx_bench.peers``) and how it is launched.

The child measures one peer's step (:func:`measure_peer`), checks its outputs
against MLX's (:func:`check`, the one path that imports MLX) or measures a
known allocation (:func:`calibrate`), and prints one JSON line.
:func:`run_isolated` launches it in a fresh interpreter with
:data:`~nuvec_mlx_bench.peers.peak_probes.ENV`, so that no two frameworks
share a process or an allocator with MLX, and turns every failure into
``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
from typing import Any

import numpy as np

from ..core import rounds
from ..seed.workload import MODELS, Workload
from . import PEERS, STRATEGIES
from .framework import load
from .peak_probes import ENV

#: How the command line spells each workload field's type.
FIELD_TYPES = {"str": str, "int": int, "bool": bool}


def measure_peer(peer: str, workload: Workload, strategy: str, repeats: int) -> dict[str, Any]:
    """Measure one peer's step in this process: a measurement with its ``method`` and framework info.

    Raises:
        ValueError: ``strategy`` is not one of the peers' strategies, or the
            workload is not compiled (the peers are counterparts of the
            compiled MLX step; ``torch-eager`` is the eager counterpart).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not workload.compiled:
        raise ValueError("workload.compiled must be True: the peers measure counterparts of the compiled step")
    fw = load(peer)
    step, extra = fw.train_step(workload, strategy)
    probe = fw.probe()
    result = rounds.measure({"step": (step, fw.sync)}, repeats, probe)["step"]
    how = extra.pop("step")
    return {**result, "method": f"{how}; peak: {probe.method}", **probe.notes, **extra, **fw.info()}


def calibrate(peer: str, mib: int, repeats: int) -> dict[str, Any]:
    """Measure a step that allocates ``mib`` MiB and frees it: the probe should read about that."""
    fw = load(peer)
    probe = fw.probe()
    result = rounds.measure({"alloc": (fw.allocation(mib << 20), fw.sync)}, repeats, probe)["alloc"]
    return {**result, "method": probe.method, **probe.notes, **fw.info(), "expected": mib << 20}


def mlx_outputs(workload: Workload) -> list[np.ndarray]:
    """The same step in MLX: ``seed.strategies.build("none")``, uncompiled (imports MLX)."""
    import mlx.core as mx

    from ..seed import strategies

    sc = strategies.build("none", dataclasses.replace(workload, compiled=False))
    outputs = sc.step(sc.inputs)
    mx.eval(outputs)
    return [np.array(o) for o in outputs]


def check(peer: str, workload: Workload, strategy: str) -> list[float]:
    """Relative max-norm errors of a peer's outputs against MLX's, one per output.

    Example:
        >>> max(check("jax-jit", Workload("transformer", 8, 16, 3, seq=4, weight_grads=True), "checkpoint")) <= 1e-4
        True
    """
    fw = load(peer)
    step, _ = fw.train_step(workload, strategy)
    got, want = fw.to_numpy(step()), mlx_outputs(workload)
    if [g.shape for g in got] != [w.shape for w in want]:
        raise AssertionError(f"shapes differ: {[g.shape for g in got]} vs {[w.shape for w in want]}")
    return [float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)) for g, w in zip(got, want)]


def workload_args(workload: Workload) -> list[str]:
    """The command-line arguments that give a peer process ``workload`` (:func:`parse_args` reads them)."""
    args = []
    for f in dataclasses.fields(Workload):
        value, flag = getattr(workload, f.name), f.name.replace("_", "-")
        args += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return args


def run_isolated(
    peer: str,
    workload: Workload,
    strategy: str = "none",
    repeats: int = 3,
    python: str = sys.executable,
    timeout: float = 1800,
) -> dict[str, Any]:
    """Measure one peer's step in a fresh ``python`` process; failures come back as ``{"error": ...}``.

    Args:
        peer: one of :data:`~nuvec_mlx_bench.peers.PEERS`.
        workload: what to measure (compiled).
        strategy: ``"none"`` or ``"checkpoint"``.
        repeats: peaks and times after the warm-up.
        python: the interpreter; it must import the peer's framework, NumPy and
            nuvec_mlx_bench (it inherits this process's environment).
        timeout: seconds before the process is killed.

    Returns:
        :func:`measure_peer`'s dict (``peak``, ``time``, ``warmup_s``,
        ``method``, ``version``, ``device`` and more), for
        :func:`nuvec_mlx_bench.seed.rows.row`.

    Example:
        >>> run_isolated("jax-jit", Workload("mlp", 8, 16, 3), "checkpoint")["peak"]["median"]
    """
    if peer not in PEERS:
        return {"error": f"unknown peer {peer!r}"}
    cmd = [
        python,
        "-m",
        "nuvec_mlx_bench.peers",
        "--peer",
        peer,
        "--strategy",
        strategy,
        "--repeats",
        str(repeats),
        *workload_args(workload),
    ]
    try:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as e:
        return {"error": f"cannot run {python}: {e.strerror or e}"}
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The whole group: torch.compile's workers would otherwise hold the pipes open.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"timed out after {timeout:g} s"}
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        reason = (stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return {"error": reason[:300]}
    return json.loads(lines[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The child's command line: the peer, what to do, and the workload's fields."""
    p = argparse.ArgumentParser(prog="python -m nuvec_mlx_bench.peers", description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=PEERS, required=True)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="print the outputs' relative errors against MLX")
    mode.add_argument("--calibrate", type=int, metavar="MIB", help="measure a step that allocates MIB MiB")
    p.add_argument("--strategy", choices=STRATEGIES, default="none")
    p.add_argument("--repeats", type=int, default=3, help="peaks and times after the warm-up")
    for f in dataclasses.fields(Workload):
        flag, kind = "--" + f.name.replace("_", "-"), FIELD_TYPES[f.type]
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            default = None if f.default is dataclasses.MISSING else f.default
            p.add_argument(flag, type=kind, default=default, choices=MODELS if f.name == "model" else None)
    args = p.parse_args(argv)
    if args.calibrate is None:
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(Workload)}
        missing = [f"--{k}" for k, v in fields.items() if v is None]
        if missing:
            p.error(f"{', '.join(missing)} required, unless --calibrate")
        try:
            args.workload = Workload(**fields)
        except (TypeError, ValueError) as e:
            p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    """Print one JSON line: a measurement, a calibration or a check; exit status 0."""
    args = parse_args(argv)
    if args.check:
        errors = check(args.peer, args.workload, args.strategy)
        result: dict[str, Any] = {"errors": errors, "max_error": max(errors)}
    elif args.calibrate is not None:
        result = calibrate(args.peer, args.calibrate, args.repeats)
    else:
        result = measure_peer(args.peer, args.workload, args.strategy, args.repeats)
    print(json.dumps(result))
    return 0
