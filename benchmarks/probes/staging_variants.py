"""Throw-away probe: which stages pay on this machine? (ran at the commit its results README names)

Measures the MLP workloads with nuvec's checkpoint, evaluated six ways, round-robin in one
process: staged as nuvec_mlx does by default (a stage after every block's forward and every
block's backward), staged with ``mx.synchronize()`` after each stage (as inside
``nv.memory.timeline`` and the planner's trial steps: on CUDA a stage's buffers are released by
MLX's completion worker after the GPU passes them, later than ``mx.eval`` returns), staged with
one stage queued ahead, backward stages only (forward marks switched off while the step is
traced), staged with the throttle at budget 0, and plain ``mx.eval`` of the same compiled step;
with the plain step (``none``, ``mx.eval``) as the base. Run it once with
``MLX_MAX_OPS_PER_BUFFER=1`` and once without, to see what staging needs from the size of MLX's
command buffers::

    python benchmarks/probes/staging_variants.py OUT.json [--repeats 9] [--shapes 4096x256,16384x1024]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

import mlx.core as mx

import nuvec_mlx as nv
from nuvec_mlx_bench import environment, measure, results, workloads
from nuvec_mlx_bench.workload import Workload

stages = sys.modules["nuvec_mlx._stages"]


@contextlib.contextmanager
def forward_marks(on: bool):
    """Trace with (or without) the marks after each block's forward."""
    real = stages.mark
    if not on:
        stages.mark = lambda arrays, kind, *rest: (list(arrays) if kind == stages.FORWARD
                                                   else real(arrays, kind, *rest))
    try:
        yield
    finally:
        stages.mark = real


def synchronized(outputs) -> None:
    """nv.eval with mx.synchronize() after every stage."""
    with stages.observing(lambda *_: mx.synchronize()):
        nv.eval(outputs)


VARIANTS = {  # name: (strategy, forward marks, evaluate)
    "none": ("none", True, mx.eval),
    "staged": ("nuvec", True, nv.eval),
    "staged-synchronized": ("nuvec", True, synchronized),
    "staged-ahead1": ("nuvec", True, lambda o: nv.eval(o, ahead=1)),
    "backward-stages-only": ("nuvec", False, nv.eval),
    "staged-budget0": ("nuvec", True, lambda o: nv.eval(o, budget=0)),
    "unstaged-mx.eval": ("nuvec", True, mx.eval),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--shapes", default="4096x256,16384x1024")
    args = p.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        batch, dim = (int(v) for v in shape.split("x"))
        for weight_grads in (False, True):
            w = Workload("mlp", batch, dim, 8, weight_grads=weight_grads)
            cases = {}
            for name, (strategy, fwd, evaluate) in VARIANTS.items():
                sc = workloads.build(strategy, w)
                with forward_marks(fwd):
                    evaluate(sc.step(sc.inputs))  # traced here, under the variant's marks
                cases[name] = (lambda sc=sc: sc.step(sc.inputs), evaluate)
            got = measure.run_cases(cases, args.repeats, desc=f"{shape} wg={weight_grads}")
            rows += results.add_ratios([results.row("variants", "mlx", n, w, got[n]) for n in cases])
            for r in rows[-len(cases):]:
                p = {k: r["peak"][k] / 2**20 for k in ("median", "min", "max")}
                print(f"{shape} wg={weight_grads} {r['strategy']:22s} peak {p['median']:8.1f} MiB "
                      f"({p['min']:.1f}-{p['max']:.1f}) ratio {r.get('peak_ratio', math.nan):.3f} "
                      f"time ratio {r.get('time_ratio', math.nan):.3f}", flush=True)
    env = environment.environment(" ".join(["python", *sys.argv]))
    env["MLX_MAX_OPS_PER_BUFFER"] = os.environ.get("MLX_MAX_OPS_PER_BUFFER", "unset (MLX default)")
    with open(args.out, "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
