"""Throw-away probe: where nuvec's LoRA step spends the time it takes beyond mlx-lm's (issue #16's target).

The fine-tuning benchmark's Llama LoRA case (``nuvec_mlx_bench.train_steps``), its strategies and
variants of nuvec's step that take one thing away at a time, peaks and times round-robin in one
process (``nuvec_mlx_bench.measure.run_cases``: medians with min–max)::

    python benchmarks/probes/lora_time.py OUT.json                     # the H200 size (1B Llama)
    python benchmarks/probes/lora_time.py OUT.json --hidden 128 --seq 256 --repeats 3   # a CPU

- ``none``, ``mlx-lm``, ``nuvec-mx-eval``, ``nuvec-ahead0/1/2``: as in the benchmark;
- ``nuvec-unfolded``: ``nuvec`` (ahead 1) with every update a stage of its own, as before
  ``_marks.FOLD`` (set to infinity while the step is traced);
- ``nuvec-unstaged``: nuvec's compiled step evaluated with ``mx.eval``, in one go: what
  checkpoints and compile cost without the stages.
"""

import argparse
import contextlib
import json
import math
import sys

import mlx.core as mx

from nuvec_mlx import _marks
from nuvec_mlx_bench import environment, measure
from nuvec_mlx_bench.train_steps import Case, TrainWorkload


@contextlib.contextmanager
def unfolded():
    held, _marks.FOLD = _marks.FOLD, math.inf
    try:
        yield
    finally:
        _marks.FOLD = held


def workload_and_args() -> tuple[TrainWorkload, argparse.Namespace]:
    """The command line's workload (the fine-tuning benchmark's H200 Llama LoRA by default)."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--arch", default="llama")
    p.add_argument("--mode", default="lora")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    return TrainWorkload(a.arch, a.hidden, a.layers, batch=a.batch, seq=a.seq, mode=a.mode), a


def measure_and_report(cases: dict, w: TrainWorkload, a: argparse.Namespace) -> None:
    """Measure ``cases`` round-robin, print each against ``mlx-lm``, write them to ``a.out``."""
    results = measure.run_cases(cases, a.repeats, desc=w.label())
    base = results["mlx-lm"]
    for s, r in results.items():
        print(f"{s:15} peak {r['peak']['median'] / 2**20:9.1f} MiB ({r['peak']['median'] / base['peak']['median']:.2f})"
              f"  time {r['time']['median']:.4f} s ({r['time']['min']:.4f}-{r['time']['max']:.4f})"
              f"  {r['time']['median'] / base['time']['median']:.3f}x mlx-lm", flush=True)
    json.dump({"argv": sys.argv, "workload": w.label(), "environment": environment.environment(" ".join(sys.argv)),
               "results": results}, open(a.out, "w"), indent=1, default=str)


def main() -> None:
    w, a = workload_and_args()
    cases = {}
    for s in ("none", "mlx-lm", "nuvec-mx-eval", "nuvec-ahead0", "nuvec-ahead1", "nuvec-ahead2"):
        c = Case(w, s)
        b = c.batch(w.seq)
        cases[s] = (lambda c=c, b=b: c.step(b), c.evaluate)
    c_unfolded, c_unstaged = Case(w, "nuvec-ahead1"), Case(w, "nuvec-ahead1")

    def unfolded_step(c=c_unfolded, b=c_unfolded.batch(w.seq)):
        with unfolded():
            return c.step(b)

    cases["nuvec-unfolded"] = (unfolded_step, c_unfolded.evaluate)
    b = c_unstaged.batch(w.seq)
    cases["nuvec-unstaged"] = (lambda: c_unstaged.step(b), lambda out: mx.eval(c_unstaged.state, out))
    measure_and_report(cases, w, a)


if __name__ == "__main__":
    main()
