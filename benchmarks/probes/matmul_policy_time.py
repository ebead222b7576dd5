"""Throw-away probe: what ``save_matmuls`` costs on the plan sweep's transformer, a part at a time (issue #17).

The H200 sweep measured every block with ``save_matmuls`` at 1.28x the unchecked step's time
(target 1.12x). This takes that time apart, round-robin in one process
(``nuvec_mlx_bench.measure.run_cases``: medians with min–max), every block set up alike:

- ``none``: unchecked, ``mx.eval``: the base;
- ``everything``: ``save_everything`` (nothing recomputed), ``nv.eval``: what the stages cost;
- ``matmuls``: ``save_matmuls``, ``nv.eval``: the sweep's case;
- ``matmuls+attention``: ``save_matmuls`` and the attention's output, through
  ``nv.checkpoint_name(mx.fast.scaled_dot_product_attention, "attention")``;
- ``nothing``: ``save_nothing``, ``nv.eval``;
- ``-ahead1``: evaluated with one stage queued ahead (``nv.eval(..., ahead=1)``);
- ``-unstaged``: the same compiled step evaluated with ``mx.eval``, in one go: the recomputation
  without the stages.

::

    python benchmarks/probes/matmul_policy_time.py OUT.json                       # the H200 size
    python benchmarks/probes/matmul_policy_time.py OUT.json --suite small --repeats 3   # a CPU
"""

import argparse
import json
import sys

import mlx.core as mx

import nuvec_mlx as nv
from nuvec_mlx_bench import environment, measure, plan_sweep

ATTENTION = "attention"


def matmuls_and_attention(value: nv.policies.Saveable) -> bool:
    return nv.policies.save_matmuls(value) or value.name == ATTENTION


VARIANTS = {  # name: (every block's mode, evaluate)
    "none": ("plain", mx.eval),
    "everything": ("save_everything", nv.eval),
    "everything-ahead1": ("save_everything", lambda o: nv.eval(o, ahead=1)),
    "matmuls": ("save_matmuls", nv.eval),
    "matmuls-ahead1": ("save_matmuls", lambda o: nv.eval(o, ahead=1)),
    "matmuls-unstaged": ("save_matmuls", mx.eval),
    "matmuls+attention": (matmuls_and_attention, nv.eval),
    "nothing": ("save_nothing", nv.eval),
    "nothing-unstaged": ("save_nothing", mx.eval),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--suite", choices=sorted(plan_sweep.SUITES), default="full")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    # The benchmark transformer calls mx.fast.scaled_dot_product_attention by name at each call.
    mx.fast.scaled_dot_product_attention = nv.checkpoint_name(mx.fast.scaled_dot_product_attention, ATTENTION)
    shape = plan_sweep.SUITES[a.suite]["transformer"]
    model, loss_fn, batch = plan_sweep.build("transformer", shape)
    blocks = list(model.layers)
    cases = {}
    for name, (mode, evaluate) in VARIANTS.items():
        step, _ = plan_sweep.case(model, loss_fn, batch, blocks, [mode] * len(blocks))
        cases[name] = (step, evaluate)  # no optimizer: the outputs (loss, gradients) are all the step makes
    results = measure.run_cases(cases, a.repeats, desc=f"transformer {shape}")
    base = results["none"]
    for name, r in results.items():
        print(f"{name:18} peak {r['peak']['median'] / 2**20:9.1f} MiB ({r['peak']['median'] / base['peak']['median']:.2f})"
              f"  time {r['time']['median']:.4f} s ({r['time']['min']:.4f}-{r['time']['max']:.4f})"
              f"  {r['time']['median'] / base['time']['median']:.3f}x", flush=True)
    json.dump({"argv": sys.argv, "shape": shape, "environment": environment.environment(" ".join(sys.argv)),
               "results": results}, open(a.out, "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
